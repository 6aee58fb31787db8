"""Collectives over MPI for tensors and models, below the algorithms: the
tensor operations (`mpidp.allreduce`, `allgather`, `broadcast`, ...; the
names of the former module mpidp.collectives), means of tensors over the
ranks as the averaging algorithms take them (means), broadcasts of a
model's parameters and an optimizer's state (model_state), Heat's communicator
(communication) and torch.distributed process groups built from MPI
(process_groups)."""

from .tensors import (Work, allgather, allreduce, allreduce_agreed, allreduce_scalar, barrier,
                      broadcast, check_root, local_rank, rank, reduce_scatter,
                      reduce_scatter_agreed, size)

__all__ = ["allreduce", "allreduce_scalar", "allgather", "broadcast", "barrier", "rank", "size",
           "local_rank", "Work", "reduce_scatter", "check_root", "allreduce_agreed",
           "reduce_scatter_agreed"]
