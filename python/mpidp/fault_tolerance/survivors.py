"""Who survived: the shrink of the world to the ranks alive (MPI's agreement
and shrink), which errors are a rank's failure, the ranks a shrink left out,
and the agreement communicators of earlier recoveries."""

from __future__ import annotations

from typing import Tuple

from .._runtime.fault_tolerant_mode import RanksLost
from .._runtime.mpi import MPI


def shrink(comm: MPI.Intracomm) -> MPI.Intracomm:
    """The survivors of `comm` (MPIX_Comm_shrink), agreed to be alive."""
    survivors = comm
    while True:
        survivors = survivors.Shrink()
        try:        # a rank may have died unseen during the shrink: shrink again
            survivors.Agree(1)
            return survivors
        except MPI.Exception:
            survivors.Ack_failed()


def failure_classes() -> Tuple[int, ...]:
    """MPI error classes that a rank's failure causes or can cause (see
    mpidp_ft_classify in csrc/core/ft.c)."""
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED", "ERR_OTHER",
             "ERR_INTERN", "ERR_TRUNCATE", "ERR_IN_STATUS", "ERR_PENDING", "ERR_UNKNOWN")
    return tuple(getattr(MPI, n) for n in names if hasattr(MPI, n))


def is_failure(error: BaseException) -> bool:
    """Whether `error`, raised while the survivors rebuild, is (or may be) a
    rank's failure rather than a defect."""
    if isinstance(error, RanksLost):
        return True
    return isinstance(error, MPI.Exception) and error.Get_error_class() in failure_classes()


def lost_ranks(old_world: MPI.Intracomm, survivors: MPI.Intracomm) -> Tuple[int, ...]:
    kept = set(MPI.Group.Translate_ranks(survivors.Get_group(), list(range(survivors.Get_size())),
                                         old_world.Get_group()))
    return tuple(r for r in range(old_world.Get_size()) if r not in kept)


# The revoked agreement communicators of earlier recoveries, never freed:
# Open MPI 5.0's MPI_Comm_free of a revoked communicator, where a rank died
# during the recovery, corrupted the heap of every survivor ("malloc():
# unsorted double linked list corrupted" at their next allocation) in 5 of 8
# quiet runs of tests/fault_tolerance/ulfm's 4-rank kill in the agreement, 1
# of 10 without it. A communicator handle per recovery is what that costs.
_retired: list = []


def retire(comm: MPI.Intracomm) -> None:
    _retired.append(comm)
