#!/usr/bin/env python3
"""Summarise valgrind memcheck XML files and fail on errors in mpidp's code.

    vg_report.py [--fail-on-leaks] [--verbose] DIR_OR_FILE...

An error counts as mpidp's when any frame of any of its stacks (where it
happened, and where the block involved was allocated or freed) lies in the
extension (python/mpidp/_C*.so) or in a source file under csrc/. Those are
printed in full, and the exit status is 1 if there is any. Every other error
(Python, torch, Open MPI, libc start-up noise) is only counted, by kind and by
the library of its top frame, so a change in the noise is visible too.

Exit status: 0 clean; 1 errors (or, with --fail-on-leaks, definite leaks) in
mpidp's code; 2 otherwise, when an XML file is missing, unreadable or
truncated (a rank that crashed or was killed before valgrind could finish).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import xml.etree.ElementTree as ET

MPIDP_OBJ = re.compile(r"/mpidp/_C[^/]*\.so$")
LEAK_KINDS = ("Leak_DefinitelyLost", "Leak_IndirectlyLost", "Leak_PossiblyLost",
              "Leak_StillReachable")


def is_mpidp_frame(frame: dict) -> bool:
    obj = frame.get("obj", "")
    src = os.path.join(frame.get("dir", ""), frame.get("file", ""))
    return bool(MPIDP_OBJ.search(obj)) or "/csrc/" in src or src.startswith("csrc/")


def parse_frame(el) -> dict:
    return {child.tag: (child.text or "") for child in el}


def parse_error(block: str) -> dict | None:
    try:
        el = ET.fromstring(block)
    except ET.ParseError:
        return None
    what = el.findtext("what") or el.findtext("xwhat/text") or ""
    stacks = [[parse_frame(f) for f in st.findall("frame")] for st in el.findall("stack")]
    aux = [a.text or "" for a in el.findall("auxwhat")] + \
          [a.findtext("text") or "" for a in el.findall("xauxwhat")]
    return {"unique": el.findtext("unique"), "kind": el.findtext("kind") or "?", "what": what,
            "stacks": stacks, "aux": aux}


def read_file(path: str):
    """Returns (errors, counts by unique id, complete?, pid, command line)."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    errors = [e for e in (parse_error(b) for b in re.findall(r"<error>.*?</error>", text, re.S)) if e]
    counts = {}
    m = re.search(r"<errorcounts>.*?</errorcounts>", text, re.S)
    if m:
        for pair in ET.fromstring(m.group(0)).findall("pair"):
            counts[pair.findtext("unique")] = int(pair.findtext("count") or 1)
    complete = "</valgrindoutput>" in text
    pid = re.search(r"<pid>(\d+)</pid>", text)
    exe = re.search(r"<argv>\s*<exe>(.*?)</exe>(.*?)</argv>", text, re.S)
    args = ""
    if exe:
        args = " ".join([os.path.basename(exe.group(1))] +
                        re.findall(r"<arg>(.*?)</arg>", exe.group(2)))
    return errors, counts, complete, pid.group(1) if pid else "?", args


def top_object(err: dict) -> str:
    """The library of the first frame that is not valgrind's allocator."""
    for frame in (err["stacks"][0] if err["stacks"] else []):
        if frame.get("obj") and "vgpreload" not in frame["obj"]:
            return os.path.basename(frame["obj"])
    return "?"


def describe(err: dict, count: int) -> str:
    lines = [f"  {err['kind']}: {err['what']}  (x{count})"]
    for i, stack in enumerate(err["stacks"]):
        if i > 0:
            lines.append(f"    {err['aux'][i - 1] if i - 1 < len(err['aux']) else 'and'}:")
        for frame in stack:
            where = (f"{frame.get('file')}:{frame.get('line')}" if frame.get("file")
                     else os.path.basename(frame.get("obj", "?")))
            mark = "*" if is_mpidp_frame(frame) else " "
            lines.append(f"   {mark} {frame.get('fn', frame.get('ip', '?'))} ({where})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--fail-on-leaks", action="store_true",
                    help="also fail on definite leaks allocated by mpidp")
    ap.add_argument("--verbose", action="store_true", help="print the noise too")
    opts = ap.parse_args()

    files = []
    for p in opts.paths:
        files += sorted(glob.glob(os.path.join(p, "*.xml"))) if os.path.isdir(p) else [p]
    if not files:
        print("vg_report: no valgrind XML files found", file=sys.stderr)
        return 2

    status = 0
    ours_total = leaks_total = 0
    for path in files:
        try:
            errors, counts, complete, pid, args = read_file(path)
        except OSError as exc:
            print(f"{path}: unreadable: {exc}")
            status = max(status, 2)
            continue
        if not args:
            continue  # a process valgrind followed but that never ran (should not happen)
        ours, noise = [], collections.Counter()
        leaks = []
        for err in errors:
            n = counts.get(err["unique"], 1)
            mine = any(is_mpidp_frame(f) for st in err["stacks"] for f in st)
            if err["kind"] in LEAK_KINDS:
                if mine and err["kind"] == "Leak_DefinitelyLost":
                    leaks.append((err, n))
                else:
                    noise[(err["kind"], top_object(err))] += n
            elif mine:
                ours.append((err, n))
            else:
                noise[(err["kind"], top_object(err))] += n
        state = "complete" if complete else "TRUNCATED (the process died before valgrind finished)"
        print(f"{os.path.basename(path)}: pid {pid} [{args}]: {state}; "
              f"{sum(n for _, n in ours)} error(s) in mpidp code, "
              f"{sum(n for _, n in leaks)} definite leak(s) from mpidp, "
              f"{sum(noise.values())} elsewhere ({len(errors)} unique in all)")
        for err, n in ours:
            print(describe(err, n))
        for err, n in leaks:
            print(describe(err, n))
        if noise and (opts.verbose or ours):
            for (kind, obj), n in noise.most_common(12):
                print(f"    noise: {n:6d} x {kind} at {obj}")
        if not complete:
            status = max(status, 2)
        ours_total += len(ours)
        leaks_total += len(leaks)
    if ours_total or (opts.fail_on_leaks and leaks_total):
        status = 1  # errors in our code matter more than a truncated file
    print(f"vg_report: {len(files)} process(es), {ours_total} unique error(s) in mpidp code, "
          f"{leaks_total} unique definite leak(s) from mpidp -> "
          f"{['OK', 'FAIL', 'FAIL (incomplete output)'][status]}")
    return status


if __name__ == "__main__":
    sys.exit(main())
