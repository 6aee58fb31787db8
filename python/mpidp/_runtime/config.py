"""Every MPIDP_* environment variable mpidp reads, in one place.

Each setting is declared once below, with its default, what values it takes
and what it does; code asks `get(NAME)` instead of reading `os.environ`, so a
bad value fails the same way everywhere (a ValueError naming the variable and
what was expected) and the README's settings table can be checked against
this list (tests/package/test_config.py). Values are read when asked for, not cached
at import: a job may set them before it builds each wrapper, and the tests
change them between cases.

Build-time variables (MPICC, MPIDP_CUDA, MPIDP_CUDA_ARCH, MPIDP_BUILD_DIR,
MPIDP_TORCH_HOOK, NVCC) are read by
setup.py, and test-harness ones (MPIDP_TEST_DEVICE, MPIDP_TEST_LIMIT,
MPIDP_PYTHON) by the tests and scripts; both are listed in BUILD_AND_TEST for
the same README check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

__all__ = ["Setting", "SETTINGS", "BUILD_AND_TEST", "get"]


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    parse: Optional[Callable[[str], Any]]  # raises ValueError; None: read by the C extension
    expected: str                          # for the error message
    doc: str


def _positive(kind: type, zero_too: bool = False) -> Callable[[str], Any]:
    """A parser of numbers of `kind` (int or float) > 0, or >= 0 with zero_too."""
    def parse(raw: str):
        value = kind(raw)
        if not (value >= 0 if zero_too else value > 0):  # NaN fails both
            raise ValueError
        return value
    return parse


def _flag(raw: str) -> bool:
    if raw.strip() not in ("0", "1"):
        raise ValueError
    return raw.strip() == "1"


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ValueError
        return value
    return parse


def _text(raw: str) -> str:
    if not raw.strip():
        raise ValueError
    return raw.strip()


SETTINGS: Dict[str, Setting] = {s.name: s for s in (
    Setting("MPIDP_TIMEOUT", 1800.0, _positive(float), "a positive number of seconds",
            "seconds any wait on a collective may take before it is reported as stuck"),
    Setting("MPIDP_ON_TIMEOUT", "abort", _choice("abort", "raise"), "'abort' or 'raise'",
            "abort: print what was pending and abort the job; raise: raise mpidp.CommTimeout"),
    Setting("MPIDP_DEPARTURE_GRACE", 10.0, _positive(float, zero_too=True),
            "a number of seconds >= 0",
            "how long a wait goes on after a rank of its communicator ended its program "
            "(sys.exit, SystemExit, a shorter loop) before it ends the job naming that rank"),
    Setting("MPIDP_ABORT_ON_EXCEPTION", True, _flag, "0 or 1",
            "1: an uncaught exception on any rank aborts the whole job instead of leaving the "
            "others waiting"),
    Setting("MPIDP_FAULT_TOLERANCE", False, _flag, "0 or 1",
            "1: keep training when ranks die (MPI's ULFM; Open MPI 5 under mpirun --with-ft "
            "ulfm): mpidp.RanksLost, then mpidp.recover() (docs/fault-tolerance.md)"),
    Setting("MPIDP_IGNORE_LAUNCHER", False, _flag, "0 or 1",
            "1: run even when torchrun, Slurm or another MPI's launcher started several "
            "processes but MPI sees one (each would train alone; refused by default)"),
    Setting("MPIDP_RANKS_PER_NODE", None, _positive(int), "a positive integer",
            "split the ranks into 'nodes' of k consecutive ranks (emulate several nodes on one "
            "machine); unset: the machine's real nodes"),
    # The extension chooses its kernels when it loads, before any Python code
    # runs, so it reads this one itself (csrc/py/module.c) and checks it there.
    Setting("MPIDP_SIMD", None, None, "'ref', 'avx2' or 'avx512'",
            "force the bf16/fp16 kernels' CPU path (mpidp.simd_path() says which runs)"),
    Setting("MPIDP_C10D_CHECK", True, _flag, "0 or 1",
            "the torch.distributed backend 'mpidp' checks that every rank passed the same "
            "shape, dtype and settings before each collective (one small allreduce)"),
    Setting("MPIDP_C10D_DEVICE_COMM", "auto", _choice("auto", "nccl", "mpi", "staging", "standin"),
            "'auto', 'nccl', 'mpi', 'staging' or 'standin'",
            "how the \"mpidp\" torch.distributed backend moves CUDA tensors (all_reduce, "
            "broadcast, all_gather_into_tensor, reduce_scatter_tensor): as MPIDP_DP_DEVICE_COMM "
            "chooses for DataParallel; staging copies through the host, standin runs the device "
            "path's logic on CPU tensors over MPI (tests)"),
    Setting("MPIDP_C10D_IMPL", "cpp", _choice("python", "cpp"), "'cpp' or 'python'",
            "the 'mpidp' backend's groups: 'cpp' (where mpidp was built with torch) runs the "
            "common collectives on host tensors inline in C++ (mpidp._c10d, a c10d::Backend "
            "that torch's functional collectives reach) and the rest through the Python group; "
            "'python': the Python group alone"),
    Setting("MPIDP_STORE_ADDR", None, _text, "a host name or address",
            "address of the TCP store init_process_group opens on the group's first rank"),
    Setting("MPIDP_HOOK_PROGRESS", True, _flag, "0 or 1",
            "0 stops gradient hooks (DataParallel, at most every 10 us) and forward and gradient "
            "hooks (DASO) from driving MPI progress (for measurements)"),
    Setting("MPIDP_WAIT_SPIN_MS", None, _positive(float, zero_too=True),
            "a number of milliseconds >= 0",
            "how long a wait tests MPI in a loop, yielding the core, before it sleeps 100 us "
            "between tests; default 3 where MPI yields the core when idle (Open MPI's "
            "mpi_yield_when_idle: mpirun sets it when a node has more ranks than cores), else 20"),
    Setting("MPIDP_GRAD_HOOK", "cpp", _choice("cpp", "python"), "'cpp' or 'python'",
            "DataParallel's gradient hooks: cpp (mpidp._grad_hook, a C++ hook on each "
            "gradient accumulator, where it was built for this torch; else python) or python "
            "(a Python-level post-accumulate-grad hook per parameter)"),
    Setting("MPIDP_CHECK", False, _flag, "0 or 1",
            "1: compare parameter checksums across ranks every MPIDP_CHECK_EVERY training "
            "steps and raise when they drifted apart"),
    Setting("MPIDP_CHECK_EVERY", 100, _positive(int), "a positive integer",
            "training steps between MPIDP_CHECK comparisons"),
    Setting("MPIDP_DP_STAGING", False, _flag, "0 or 1",
            "1: DataParallel reduces CPU gradients through the staging buckets GPU gradients "
            "take (tests the GPU path's logic on CPUs)"),
    Setting("MPIDP_DP_DEVICE_COMM", "auto", _choice("auto", "nccl", "mpi", "staging", "standin"),
            "'auto', 'nccl', 'mpi', 'staging' or 'standin'",
            "how DataParallel reduces GPU gradients: auto (NCCL on the device where every rank "
            "has a GPU of its own; where ranks share a GPU, a CUDA-aware MPI on the device "
            "pointers; else staging), nccl (NCCL, or an error saying why not), mpi (MPI on the "
            "device pointers, or an error where MPI is not CUDA-aware), staging (through pinned "
            "host buffers and MPI), standin (the device path's logic on CPU tensors over MPI, "
            "for tests); wire_dtype, hierarchical=True and fault tolerance go through the host"),
    Setting("MPIDP_DASO_STAGING", False, _flag, "0 or 1",
            "1: DASO syncs parameters through a host mirror (GPU parameters' fallback; tests "
            "its logic on CPUs)"),
    Setting("MPIDP_DASO_DEVICE_SYNC", False, _flag, "0 or 1",
            "1: DASO packs and merges CPU parameters in place as it does GPU ones (tests the "
            "GPU path's logic on CPUs)"),
)}

# Read elsewhere (setup.py; tests and scripts), listed for the README check.
BUILD_AND_TEST = ("MPICC", "MPIDP_CUDA", "MPIDP_CUDA_ARCH", "MPIDP_BUILD_DIR", "MPIDP_TORCH_HOOK", "NVCC",
                  "MPIDP_TEST_DEVICE", "MPIDP_TEST_LIMIT", "MPIDP_PYTHON")


def get(name: str) -> Any:
    """The value of setting `name` now: parsed from the environment, or its
    default when unset (an empty value counts as unset). A value that does not
    parse raises ValueError naming the variable and what it takes."""
    setting = SETTINGS[name]
    if setting.parse is None:
        raise KeyError(f"{name} is read by the C extension, not through mpidp._runtime.config")
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError:
        raise ValueError(f"{name} must be {setting.expected}, got {raw!r}") from None
