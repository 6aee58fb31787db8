"""The C core is layered: no two of its files call each other, directly or
round a longer loop, and no header includes itself round a loop. Calls are
read from the symbols of each file compiled on its own (what one object
leaves undefined and another defines); includes from the sources."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "csrc" / "core"
INCLUDE = ROOT / "csrc" / "include"

pytestmark = pytest.mark.serial


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def symbols(obj: Path):
    out = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TDBR":
            defined.add(parts[2])
        elif len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
    return defined, undefined


def test_cycles_finds_a_loop_and_passes_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.skipif(shutil.which("mpicc") is None or shutil.which("nm") is None,
                    reason="needs mpicc and nm (Debian: libopenmpi-dev, binutils)")
def test_no_two_core_files_call_each_other(tmp_path):
    objects = {}
    for src in sorted(CORE.glob("*.c")):
        obj = tmp_path / (src.stem + ".o")
        subprocess.run(["mpicc", "-c", "-O0", "-std=c11", "-D_GNU_SOURCE", f"-I{INCLUDE}",
                        f"-I{CORE}", str(src), "-o", str(obj)], check=True)
        objects[src.stem] = symbols(obj)
    graph = {a: {b for b, (defined, _) in objects.items() if b != a and undefined & defined}
             for a, (_, undefined) in objects.items()}
    assert len(graph) > 30                       # every core file was read
    assert cycles(graph) == []


def test_no_header_includes_itself_round_a_loop():
    headers = {p.relative_to(INCLUDE).as_posix(): p for p in INCLUDE.rglob("*.h")}
    headers.update({p.name: p for p in CORE.glob("*.h")})
    include = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
    graph = {name: {inc for inc in include.findall(path.read_text()) if inc in headers}
             for name, path in headers.items()}
    assert any(graph.values())                   # the includes were read
    assert cycles(graph) == []


def test_the_public_headers_name_no_internal_function():
    """csrc/include/mpidp/ is the core's interface: a core-internal name
    (mpidp__*) appears there in no declaration and no comment, and every
    such function the core defines is declared in a private header under
    csrc/core/, as libuv keeps uv__ out of uv.h."""
    leaked = {p.name: sorted(set(re.findall(r"\bmpidp__\w+", p.read_text())))
              for p in (INCLUDE / "mpidp").glob("*.h")}
    assert {name: names for name, names in leaked.items() if names} == {}
    sources = "".join(p.read_text() for p in CORE.glob("*.c"))
    defined = set(re.findall(r"^(?!static\b)[\w \*]*?\b(mpidp__\w+)\s*\(", sources, re.M))
    assert len(defined) > 10                     # the definitions were read
    private = "".join(p.read_text() for p in CORE.glob("*.h"))
    assert sorted(n for n in defined if not re.search(rf"\b{n}\s*\(", private)) == []


def test_the_glue_posts_no_mpi_operation():
    """csrc/py asks MPI only what mpidp/mpi_info.h and the start-up need
    (versions, thread level, the rank for a message, Abort); every
    communication and every communicator it holds goes through the core."""
    allowed = {"MPI_Initialized", "MPI_Finalized", "MPI_Comm_rank", "MPI_Abort",
               "MPI_Get_library_version", "MPI_Query_thread", "MPI_Comm_c2f"}
    comments = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
    calls = set()
    for src in (ROOT / "csrc" / "py").glob("*.c"):
        code = comments.sub("", src.read_text())
        calls |= set(re.findall(r"\b(MPI_[A-Z][a-z_]+)\s*\(", code))
    assert "MPI_Get_library_version" in calls      # the sources were read
    assert calls - allowed == set()

