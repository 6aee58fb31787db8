"""torch.distributed over MPI: the "mpidp" backend.

`import mpidp` registers it; then, under mpirun or srun,

    dist.init_process_group("mpidp")        # no MASTER_ADDR, MASTER_PORT or TCP store

runs torch.distributed's collectives, DDP, FSDP2 and DTensor on mpidp's C
core over MPI. `mpidp.init_process_group(comm=subcomm, backend="mpidp")`
makes the default group from any mpi4py communicator. See
docs/torch-distributed.md."""

from ._process_group import ProcessGroupMPIDP
from ._registration import register
from . import _shrink  # noqa: F401 -- registers shrunk_backend with the C++ backend

register()

__all__ = ["ProcessGroupMPIDP"]
