"""mpidp: Heat-style data-parallel training for PyTorch over MPI, with a C core.

    import mpidp
    opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=True)

Launch with `mpirun -np N python train.py` or `srun python train.py`.
"""

# Imports mpi4py.MPI first and checks the MPI library.
from ._runtime.mpi import MPI, mpi_library_version
from . import _C
from ._C import CommError, CommTimeout, RanksLost
from . import algorithms
from .primitives import gossip, kernels
from .algorithms.averaging import (HierarchicalModelAverager, PeriodicModelAverager,
                                   PostLocalSGDOptimizer)
from .algorithms.bagua import BaguaModule, with_bagua
from .collectives.model_state import broadcast_optimizer_state, broadcast_parameters
from .collectives.tensors import (Work, allgather, allreduce, allreduce_scalar, barrier, broadcast,
                                  local_rank, rank, size, reduce_scatter)
from .algorithms.daso import DASO
from .algorithms.diloco import DiLoCo
from .algorithms.demo import DeMo
from .algorithms.sparseloco import SparseLoCo
from .algorithms.muloco import MuLoCo
from .algorithms.noloco import NoLoCo
from .algorithms.eager_diloco import EagerDiLoCo
from .algorithms.desloc import DESLOC
from .algorithms.slowmo import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
from .algorithms.data_parallel import DataParallel
from .algorithms.data_parallel_multi import DataParallelMultiGPU
from .algorithms.optimizer import DataParallelOptimizer
from .collectives.process_groups import init_process_group
from . import c10d  # registers the "mpidp" backend
from ._runtime.topology import Topology, cross_node_comm, node_comm, topology
from .algorithms.driver import WrapperCopy
from . import nn, optim  # Heat's names: ht.nn, ht.optim
from . import fault_tolerance
from .fault_tolerance import Membership, recover
from .fault_tolerance import enable as enable_fault_tolerance
from .collectives.communication import MPI_WORLD, MPI_SELF, MPICommunication  # ... and ht.MPI_WORLD

from ._version import __version__

# The modules' former paths (before the package's layers were folders, and
# before algorithms/ kept one module per algorithm), for programs and pickles
# that name them: `import mpidp.daso`, a WrapperCopy saved as
# mpidp.wrapper_copy.WrapperCopy or mpidp.algorithms.wrapper_copy.WrapperCopy.
_FORMER_PATHS = {
    "daso": "algorithms.daso", "data_parallel": "algorithms.data_parallel",
    "data_parallel_multi": "algorithms.data_parallel_multi", "optimizer": "algorithms.optimizer",
    "averaging": "algorithms.averaging", "async_average": "algorithms.async_average",
    "slowmo": "algorithms.slowmo", "diloco": "algorithms.diloco",
    "sparseloco": "algorithms.sparseloco", "demo": "algorithms.demo", "bagua": "algorithms.bagua",
    "qadam": "algorithms.qadam", "decentralized": "algorithms.decentralized",
    "replica_algorithms": "algorithms.bagua.adapters", "wrapper_copy": "algorithms.driver",
    "algorithms.replica_algorithms": "algorithms.bagua.adapters",
    "algorithms.bagua_family": "algorithms.bagua",
    "algorithms.algorithm": "algorithms.bagua.algorithm",
    "algorithms.wrapper_copy": "algorithms.driver",
    "gossip": "primitives.gossip", "kernels": "primitives.kernels",
    "broadcast": "collectives.model_state", "communication": "collectives.communication",
    "process_group": "collectives.process_groups", "topology": "_runtime.topology",
}


def _alias_former_paths() -> None:
    import importlib
    import sys
    for old, new in _FORMER_PATHS.items():
        module = importlib.import_module(f"{__name__}.{new}")
        sys.modules.setdefault(f"{__name__}.{old}", module)
        parent, _, name = old.rpartition(".")
        package = sys.modules[f"{__name__}.{parent}" if parent else __name__]
        if not hasattr(package, name):   # mpidp.daso as before (not over a function's name)
            setattr(package, name, module)


_alias_former_paths()

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
    "MuLoCo",
    "NoLoCo",
    "EagerDiLoCo",
    "DESLOC",
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
