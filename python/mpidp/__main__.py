"""`python -m mpidp`: what a bug report needs, and whether the installation works.

    python -m mpidp                  # this process
    mpirun -np 4 python -m mpidp     # plus one line per rank: where it runs

`python -m mpidp calibrate` and `python -m mpidp plan` measure a cluster and
say which algorithm fits it (mpidp/planning, docs/planning.md).

Prints the versions of mpidp, torch, mpi4py and the MPI library, whether
mpi4py and mpidp run on the same MPI, MPI's thread level, the SIMD path of the
bf16/fp16 kernels, whether mpidp's CUDA kernels are built and a GPU is
visible, every rank's place (host, node, local rank) under the current launch,
what the launcher's environment says, and the effective MPIDP_* settings.
Exits 1 with the reason when something is broken (the settings cannot be
read, the SIMD kernels failed their self-check, mpidp was launched by
something that is not MPI)."""

from __future__ import annotations

import os
import platform
import socket
import sys
from typing import Dict, List, Tuple

import mpi4py
import torch

import mpidp
from mpidp import _C
from mpidp._engines import grad_hook_loader as _grad_hook_loader
from mpidp._runtime import config as _config
from mpidp._runtime.launch import launcher_mismatch
from mpidp._runtime.mpi import MPI
from mpidp._runtime.topology import topology

_THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
# Open MPI's coll_libnbc_iallreduce_algorithm (mpidp sets 3 at import).
_IALLREDUCE_ALGORITHMS = {-1: "MPI's own (not Open MPI's libnbc)", 0: "Open MPI's choice",
                          1: "ring", 2: "binomial", 3: "Rabenseifner", 4: "recursive doubling"}


def report() -> Tuple[List[Tuple[str, str]], List[str]]:
    """(label, value) lines about this process, and the problems found."""
    problems: List[str] = []
    ours = _C.mpi_library_version().strip().splitlines()[0]
    theirs = MPI.Get_library_version().strip().splitlines()[0]
    lines = [
        ("mpidp", f"{mpidp.__version__} ({os.path.dirname(mpidp.__file__)})"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", torch.__version__),
        ("mpi4py", mpi4py.__version__),
        ("MPI library (mpidp)", ours),
        ("MPI library (mpi4py)", theirs),
        ("same MPI", "yes" if ours == theirs else "NO"),
        ("built against", _C.mpi_header_version()),
        ("MPI thread level", _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread()))),
        ("MPI_Iallreduce algorithm", _IALLREDUCE_ALGORITHMS.get(_C.iallreduce_algorithm(), "?")),
        ("SIMD path", f"{_C.simd_path()} (this CPU: {', '.join(_C.simd_paths())})"),
        ("CUDA kernels", "built, GPU usable" if _C.cuda_available() else "not usable here"),
        ("gradient hook", _grad_hook_loader.describe()),
        ("GPUs visible to torch", str(torch.cuda.device_count() if torch.cuda.is_available() else 0)),
        ("MPI CUDA-aware", "yes: takes device pointers" if _C.mpi_cuda_aware() else "no"),
    ]
    if ours != theirs:
        problems.append("mpidp and mpi4py run on different MPI libraries")
    if _C.simd_fallback_reason():
        problems.append(f"SIMD kernels: {_C.simd_fallback_reason()}")
    mismatch = launcher_mismatch(MPI.COMM_WORLD.Get_size())
    if mismatch:
        problems.append(mismatch)
    return lines, problems


def settings() -> Tuple[List[Tuple[str, str]], List[str]]:
    """Every MPIDP_* setting's effective value (and whether it was set)."""
    lines, problems = [], []
    for name in _config.SETTINGS:
        raw = os.environ.get(name)
        try:
            value = _config.get(name) if _config.SETTINGS[name].parse else raw
        except ValueError as exc:
            problems.append(str(exc))
            value = "INVALID"
        lines.append((name, f"{value!r}" + (" (set)" if raw is not None else "")))
    return lines, problems


def where() -> str:
    """This rank's place: rank, host, node, local rank."""
    world = MPI.COMM_WORLD
    t = topology()
    return (f"rank {world.Get_rank()} of {world.Get_size()}: host {socket.gethostname()}, node "
            f"{t.node} of {t.n_nodes}, local rank {t.local_rank} of {t.local_size}, pid {os.getpid()}")


def main() -> int:
    world = MPI.COMM_WORLD
    lines, problems = report()
    setting_lines, setting_problems = settings()
    problems += setting_problems
    ranks: List[str] = world.gather(where(), root=0)
    everyone: List[List[str]] = world.gather(problems, root=0)
    if world.Get_rank() != 0:
        return 1 if problems else 0
    width = max(len(label) for label, _ in lines + setting_lines)
    out = [f"{label:<{width}}  {value}" for label, value in lines]
    out += ["", "ranks:"] + [f"  {line}" for line in ranks]
    out += ["", "settings:"] + [f"  {label:<{width}}  {value}" for label, value in setting_lines]
    found: Dict[str, List[int]] = {}
    for rank, said in enumerate(everyone):
        for p in said:
            found.setdefault(p, []).append(rank)
    if found:
        out += ["", "PROBLEMS:"] + [f"  rank(s) {r}: {p}" for p, r in found.items()]
    print("\n".join(out), flush=True)
    return 1 if found else 0


USAGE = """usage: python -m mpidp [calibrate | plan] [options]

  python -m mpidp             the environment report (under mpirun: every rank's place)
  python -m mpidp calibrate   measure this allocation's costs (python -m mpidp calibrate -h)
  python -m mpidp plan        predict each algorithm's step time (python -m mpidp plan -h)"""


def dispatch(argv: List[str]) -> int:
    """The command `argv` names; an unknown word or option is refused with
    the usage and status 2, as argparse does (a typo must not look like a
    report that passed)."""
    if argv[:1] == ["calibrate"]:
        from mpidp.planning.calibrate import main as calibrate_main
        return calibrate_main(argv[1:])
    if argv[:1] == ["plan"]:
        from mpidp.planning.plan import main as plan_main
        return plan_main(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if argv:
        print(f"{USAGE}\npython -m mpidp: error: unknown command {argv[0]!r} (choose calibrate "
              "or plan, or nothing for the report)", file=sys.stderr)
        return 2
    return main()


if __name__ == "__main__":
    sys.exit(dispatch(sys.argv[1:]))
