"""Heat's communicator wrapper, for scripts that use `ht.MPI_WORLD`:
`.rank`, `.size` and `.handle` (the mpi4py communicator); any other attribute
(Barrier, allreduce, bcast, ...) is the mpi4py communicator's. mpidp's
functions accept it wherever they take a communicator."""

from __future__ import annotations

from .._runtime.mpi import MPI

__all__ = ["MPICommunication", "MPI_WORLD", "MPI_SELF"]


class MPICommunication:
    """Heat's communicator object: `handle` (an mpi4py intra-communicator),
    `rank` and `size`. mpidp.MPI_WORLD and mpidp.MPI_SELF are the two Heat
    scripts use; mpidp's wrappers accept one wherever they take a comm."""

    def __init__(self, handle: MPI.Intracomm = MPI.COMM_WORLD):
        if not isinstance(handle, MPI.Intracomm):
            raise TypeError(f"handle: expected an mpi4py intra-communicator, got "
                            f"{type(handle).__name__}")
        self.handle = handle
        self.rank = handle.Get_rank()
        self.size = handle.Get_size()

    def is_distributed(self) -> bool:
        return self.size > 1

    def __getattr__(self, name: str):
        return getattr(self.handle, name)

    def __repr__(self) -> str:
        return f"MPICommunication(rank {self.rank} of {self.size})"


MPI_WORLD = MPICommunication(MPI.COMM_WORLD)
MPI_SELF = MPICommunication(MPI.COMM_SELF)
