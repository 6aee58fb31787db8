"""`python -m mpidp plan`: which algorithm fits a cluster, predicted from a
calibration profile (calibrate.py) with the cost model (algorithms.py).

    python -m mpidp plan --profile cluster.json --nodes 8,64,1024 \\
        [--ranks-per-node 4] [--bandwidth 1gbit,25gbit] [--latency 20ms] \\
        [--params 124e6] [--step-ms 350] [--json] [--plot map.png]

For every (nodes, bandwidth) cell and algorithm: the predicted step time,
communication per step, bytes each rank sends per step, compute
utilisation, and the network bandwidth each algorithm needs for 80, 90 and
95% utilisation ("unreachable": no bandwidth gets there, the latency or
the algorithm's own compression keeping it below). A prediction outside
what was calibrated (more nodes, or larger messages, than measured; a
network given on the command line) is labelled "extrapolated", with the term that dominates its step. Without
--steps-to-target (JSON {algorithm: steps}, e.g. from bench_daso's output)
the ranking is by step time alone, which assumes every algorithm needs the
same number of steps to reach the target: it says so."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Dict, List, Optional, Sequence

from . import algorithms as alg
from .profile import Profile, load

_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
          "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9}
_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
UTILISATIONS = (0.8, 0.9, 0.95)


def parse_bandwidth(text: str) -> float:
    """'25gbit' or '3GB' (per second) -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]+)(?:/s)?\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--bandwidth: expected a rate like 1gbit or 10GB, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_latency(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+)\s*(s|ms|us)\s*", text)
    if not m:
        raise ValueError(f"--latency: expected a time like 20ms or 5us, got {text!r}")
    return float(m.group(1)) * _TIMES[m.group(2)]


def _extrapolated(prof: Profile, nodes: int, rpn: int, params: int, given_network: bool,
                  dominant: str) -> Optional[str]:
    reasons = []
    if nodes > max(prof.nodes, 1):
        reasons.append(f"{nodes} nodes (calibrated: {prof.nodes})")
    if rpn != prof.ranks_per_node:
        reasons.append(f"{rpn} ranks per node (calibrated: {prof.ranks_per_node})")
    largest = max((f.sizes[1] for f in prof.levels.values() if f is not None), default=0)
    if params * 4 > largest:
        reasons.append(f"messages of {params * 4 / 1e6:.0f} MB (measured up to "
                       f"{largest / 1e6:.0f} MB)")
    if given_network:
        reasons.append("the network given, not measured")
    if not reasons:
        return None
    return "extrapolated: " + "; ".join(reasons) + f" ({dominant} dominates)"


def plan(prof: Profile, nodes: Sequence[int], rpn: int, bandwidths: Sequence[Optional[float]],
         latency: Optional[float], params: int, step_s: float,
         steps_to_target: Optional[Dict[str, float]] = None) -> List[dict]:
    """One row per (nodes, bandwidth, algorithm)."""
    work = alg.Workload(params, step_s, prof.overlap, overheads=prof.overheads)
    rows = []
    for n in nodes:
        for bw in bandwidths:
            cluster = prof.cluster(n, rpn, bandwidth=bw, latency=latency)
            cell = []
            for a in alg.ALGORITHMS:
                p = alg.predict(a, cluster, work)
                row = {"nodes": n, "ranks_per_node": rpn, "bandwidth": bw,
                       "latency": cluster.inter.alpha if n > 1 else cluster.intra.alpha,
                       "algorithm": a.name, "settings": a.settings, "step_s": p.step_s,
                       "comm_s": p.comm_s, "bytes_per_step": p.bytes_per_step,
                       "utilisation": p.utilisation, "dominant": p.dominant,
                       "bandwidth_for": {f"{u:.0%}": alg.bandwidth_for(a, cluster, work, u)
                                         for u in UTILISATIONS} if n > 1 else {},
                       "label": _extrapolated(prof, n, rpn, params,
                                              bw is not None or latency is not None,
                                              p.dominant)}
                steps = (steps_to_target or {}).get(a.name)
                row["time_to_target_s"] = steps * p.step_s if steps is not None else None
                cell.append(row)
            key = "time_to_target_s" if steps_to_target else "step_s"
            ranked = [r for r in cell if r[key] is not None]
            best = min(ranked, key=lambda r: r[key]) if ranked else None
            for r in cell:
                r["recommended"] = r is best
            rows += cell
    return rows


def _rate(bytes_per_s: Optional[float]) -> str:
    if bytes_per_s is None:
        return "unreachable"
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit", 1e12), ("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}/s"
    return f"{bits:.3g} bit/s"


def table(rows: List[dict], ranking_note: str) -> str:
    out = []
    cells: Dict[tuple, List[dict]] = {}
    for r in rows:
        cells.setdefault((r["nodes"], r["bandwidth"]), []).append(r)
    for (n, bw), cell in cells.items():
        net = _rate(bw) if bw is not None else "as calibrated"
        out.append(f"\n{n} node(s) x {cell[0]['ranks_per_node']} ranks, network {net}:")
        out.append(f"  {'algorithm':<17}{'settings':<48}{'step ms':>9}{'comm ms':>9}"
                   f"{'MB/step':>9}{'util':>6}  needs for 80/90/95%")
        for r in sorted(cell, key=lambda r: r["step_s"]):
            need = " / ".join(_rate(v) for v in r["bandwidth_for"].values()) or "-"
            mark = "*" if r["recommended"] else " "
            out.append(f"{mark} {r['algorithm']:<17}{r['settings']:<48}{r['step_s'] * 1e3:>9.1f}"
                       f"{r['comm_s'] * 1e3:>9.1f}{r['bytes_per_step'] / 1e6:>9.2f}"
                       f"{r['utilisation']:>6.0%}  {need}")
            if r["label"]:
                out.append(f"    {r['label']}")
    out.append(f"\n* recommended: {ranking_note}")
    return "\n".join(out)


def _short(name: str) -> str:
    """A label for the pictures: the algorithm, with DataParallel's wire or mode."""
    algorithm, _, settings = name.partition(" (")
    return f"{algorithm} {settings.split()[0]}" if algorithm == "DataParallel" else algorithm


def plot(rows: List[dict], path: str) -> None:
    """Two panels: the fastest algorithm over nodes x bandwidth, and each
    algorithm's step time over bandwidth (the largest node count)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = sorted({f"{r['algorithm']} ({r['settings']})" for r in rows})
    nodes = sorted({r["nodes"] for r in rows})
    bws = sorted({r["bandwidth"] for r in rows if r["bandwidth"] is not None})
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    if bws:
        grid = [[names.index(next(f"{r['algorithm']} ({r['settings']})" for r in rows
                                  if r["nodes"] == n and r["bandwidth"] == b and r["recommended"]))
                 for b in bws] for n in nodes]
        left.imshow(grid, aspect="auto", origin="lower", cmap="tab10", vmin=0, vmax=9)
        left.set_xticks(range(len(bws)), [_rate(b) for b in bws], rotation=30)
        left.set_yticks(range(len(nodes)), [str(n) for n in nodes])
        for i, row in enumerate(grid):
            for j, k in enumerate(row):
                left.text(j, i, _short(names[k]), ha="center", va="center", fontsize=7)
        left.set_xlabel("network bandwidth per node")
        left.set_ylabel("nodes")
        left.set_title("fastest algorithm (predicted)")
        big = nodes[-1]
        for name in names:
            pts = sorted((r["bandwidth"], r["step_s"]) for r in rows if r["nodes"] == big
                         and r["bandwidth"] is not None
                         and f"{r['algorithm']} ({r['settings']})" == name)
            right.plot([p[0] * 8 for p in pts], [p[1] * 1e3 for p in pts], marker="o",
                       label=_short(name))
        right.set_xscale("log")
        right.set_yscale("log")
        right.set_xlabel("bandwidth (bit/s)")
        right.set_ylabel("step time (ms)")
        right.set_title(f"step time at {big} nodes")
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _counts(flag: str, text: str) -> list:
    """Comma-separated counts >= 1 ("1,2,8"), or a ValueError naming `flag`."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"{flag}: expected counts >= 1, comma-separated (e.g. 1,2,8), got "
                         f"{text!r}")
    return counts


def _steps_to_target(path: str) -> dict:
    """--steps-to-target's JSON {algorithm: steps}, or a ValueError naming the flag."""
    try:
        with open(path) as f:
            raw = json.load(f)
        return {str(k): float(v) for k, v in raw.items()}
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"--steps-to-target {path}: expected a JSON object {{algorithm: "
                         f"steps}} ({exc})") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpidp plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="a profile from python -m mpidp calibrate")
    ap.add_argument("--nodes", default=None, help="node counts, comma-separated (default: the "
                    "profile's)")
    ap.add_argument("--ranks-per-node", type=int, default=None)
    ap.add_argument("--bandwidth", default=None, help="network rates per node, comma-separated "
                    "(e.g. 1gbit,25gbit; default: as calibrated)")
    ap.add_argument("--latency", default=None, help="the network's latency (e.g. 20ms)")
    ap.add_argument("--params", type=float, default=None, help="trainable parameters (default: "
                    "the calibrated model's)")
    ap.add_argument("--step-ms", type=float, default=None, help="compute per step without "
                    "communication (default: the calibrated model's)")
    ap.add_argument("--steps-to-target", default=None, help="JSON {algorithm: steps} measured "
                    "to the target accuracy")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--plot", default=None, help="write the pictures to this PNG")
    args = ap.parse_args(argv)
    try:
        from .._runtime.mpi import MPI
        size = MPI.COMM_WORLD.Get_size()
        prof = load(args.profile, world_size=size if size > 1 else None)
        nodes = _counts("--nodes", args.nodes) if args.nodes is not None else [prof.nodes]
        rpn = (args.ranks_per_node if args.ranks_per_node is not None
               else prof.ranks_per_node)
        if rpn < 1:
            raise ValueError(f"--ranks-per-node: expected a count >= 1, got {rpn}")
        bws = ([parse_bandwidth(b) for b in args.bandwidth.split(",")] if args.bandwidth
               else [None])
        latency = parse_latency(args.latency) if args.latency else None
        params = int(args.params) if args.params is not None else prof.params
        if params < 1:
            raise ValueError(f"--params: expected a positive count, got {args.params:g}")
        step_s = args.step_ms / 1e3 if args.step_ms is not None else prof.step_s
        if step_s <= 0:
            raise ValueError(f"--step-ms: expected a positive time, got {args.step_ms:g}")
        targets = _steps_to_target(args.steps_to_target) if args.steps_to_target else None
        rows = plan(prof, nodes, rpn, bws, latency, params, step_s, targets)
    except (ValueError, OSError) as exc:
        print(f"python -m mpidp plan: {exc}", file=sys.stderr)
        return 2
    note = ("by time to target (steps measured to the target x predicted step time)" if targets
            else "by step time alone: without --steps-to-target it assumes every algorithm "
                 "needs the same number of steps, which the local-update ones (DiLoCo, "
                 "SparseLoCo, DeMo, LocalSGD) usually do not")
    if args.json:
        print(json.dumps({"ranking": note, "rows": rows}, indent=1))
    else:
        print(f"profile {args.profile}: {prof.model}; planning for {params / 1e6:.3g} M "
              f"parameters, {step_s * 1e3:.3g} ms of compute per step")
        print(table(rows, note))
    if args.plot:
        plot(rows, args.plot)
    return 0
