"""mpidp: Heat-style data-parallel training for PyTorch over MPI, with a C core.

    import mpidp
    opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=True)

Launch with `mpirun -np N python train.py` or `srun python train.py`.
"""

from ._mpi import MPI, mpi_library_version  # imports mpi4py.MPI first, checks the MPI library
from . import _C
from ._C import CommError, CommTimeout, RanksLost
from . import algorithms, gossip
from .averaging import HierarchicalModelAverager, PeriodicModelAverager, PostLocalSGDOptimizer
from .bagua import BaguaModule, with_bagua
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .collectives import (Work, allgather, allreduce, allreduce_scalar, barrier, broadcast,
                          local_rank, rank, size, reduce_scatter)
from .daso import DASO
from .diloco import DiLoCo
from .demo import DeMo
from .sparseloco import SparseLoCo
from .slowmo import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
from .data_parallel import DataParallel
from .data_parallel_multi import DataParallelMultiGPU
from .optimizer import DataParallelOptimizer
from .process_group import init_process_group
from . import c10d                                         # registers the "mpidp" backend
from .topology import Topology, cross_node_comm, node_comm, topology
from .wrapper_copy import WrapperCopy
from . import nn, optim                                   # Heat's names: ht.nn, ht.optim
from . import fault_tolerance
from .fault_tolerance import Membership, recover
from .fault_tolerance import enable as enable_fault_tolerance
from .communication import MPI_WORLD, MPI_SELF, MPICommunication  # ... and ht.MPI_WORLD

from ._version import __version__

__all__ = [
    "__version__",
    "CommError",
    "CommTimeout",
    "RanksLost",
    "Membership",
    "recover",
    "enable_fault_tolerance",
    "fault_tolerance",
    "DASO",
    "DiLoCo",
    "DeMo",
    "SparseLoCo",
    "SlowMoBaseAlgorithm",
    "SlowMoDistributedDataParallel",
    "HierarchicalModelAverager",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizer",
    "DataParallel",
    "DataParallelMultiGPU",
    "DataParallelOptimizer",
    "MPI",
    "MPI_SELF",
    "MPI_WORLD",
    "MPICommunication",
    "Work",
    "allgather",
    "allreduce",
    "allreduce_scalar",
    "barrier",
    "broadcast",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "fp16_overflows",
    "mpi_library_version",
    "nn",
    "optim",
    "Topology",
    "get_timeout",
    "init_process_group",
    "local_rank",
    "rank",
    "size",
    "set_timeout",
    "simd_path",
    "topology",
    "reduce_scatter",
    "with_bagua",
    "BaguaModule",
    "WrapperCopy",
    "algorithms",
    "gossip",
    "node_comm",
    "cross_node_comm",
]


def simd_path() -> str:
    """The SIMD path of the bf16/fp16 conversion kernels: "ref", "avx2", "avx512"
    or "avx512_bf16" (chosen at import; MPIDP_SIMD=ref|avx2|avx512 forces one)."""
    return _C.simd_path()


if _C.simd_fallback_reason():
    import warnings as _warnings

    _warnings.warn(f"mpidp: {_C.simd_fallback_reason()}", RuntimeWarning, stacklevel=2)


def set_timeout(seconds: float) -> None:
    """Deadline, in seconds, of every mpidp wait on a collective (<= 0: none).
    Default 1800, or MPIDP_TIMEOUT from the environment."""
    _C.configure(timeout=float(seconds))


def get_timeout() -> float:
    """The deadline set by set_timeout (or MPIDP_TIMEOUT), in seconds."""
    return _C.process_state()["timeout"]


def fp16_overflows() -> int:
    """Finite values this process packed to float16 for the wire that became
    inf (beyond +-65504) so far (wire_dtype=torch.float16)."""
    return _C.process_state()["fp16_overflows"]
