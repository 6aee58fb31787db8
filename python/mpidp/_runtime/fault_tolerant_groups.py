"""Fault-tolerant mode over sub-communicators: every communicator other than
the job's world that an algorithm runs over (a worker group split off the
world, as in Propulate's multi-rank workers) is a group whose steps agree
among its own ranks, over a duplicate of it that is never revoked. A rank's
death in one group therefore stops only that group: its survivors call
recover(comm=group) and shrink it, and the other groups train on, their own
agreements untouched (a rank only ever revokes the communicators it is in).
recover() of the whole job makes every group again of its survivors."""

from __future__ import annotations

from typing import List, Optional

from . import mpi as _mpi
from .mpi import MPI

__all__ = ["Group", "join", "of", "is_domain", "survivors_of", "every_group"]


class Group:
    """One sub-communicator's ranks, as recoveries leave them."""

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm                 # its ranks now (after a recovery: the survivors)
        self.agree_comm = comm.Dup()     # never revoked: the steps' and recover()'s agreements
        self.agreed = False              # this round's agreement is behind us (see _State)
        # Every communicator it has been: the drivers over any of them (their
        # claims' keys) go on over the group's survivors.
        self.keys = {comm.py2f()}

    def moved_to(self, survivors: MPI.Intracomm, agree_comm: MPI.Intracomm) -> None:
        """The group is `survivors` now, agreeing over `agree_comm`."""
        self.comm, self.agree_comm, self.agreed = survivors, agree_comm, False
        self.keys.add(survivors.py2f())
        _groups[survivors.py2f()] = self


# Every group of this rank, by each communicator it has been (in the order
# they were joined: the program's, the same on every rank of a group).
_groups: "dict[int, Group]" = {}


def join(comm: MPI.Intracomm) -> Group:
    """The group of `comm`, made at its first algorithm's set-up (collective
    over `comm`: the agreement's duplicate)."""
    group = _groups.get(comm.py2f())
    if group is None:
        group = _groups[comm.py2f()] = Group(comm)
    return group


def of(comm) -> Optional[Group]:
    """The group `comm` (an mpi4py communicator, or None for the world)
    belongs to; None for the world and for communicators no algorithm made a
    group of (mpidp's duplicates, _C.Comm, are not looked up: pass the
    mpi4py communicator an algorithm was given)."""
    if comm is None or not isinstance(comm, MPI.Comm):
        return None
    return _groups.get(comm.py2f())


def is_domain(comm) -> bool:
    """Whether the ranks of `comm` (an mpi4py communicator, mpidp's world
    duplicate, or None for the world) agree on their steps: the job's world
    or a group."""
    return (comm is None or comm is MPI.COMM_WORLD or comm is _mpi.world_mpi()
            or _mpi.is_world(comm) or of(comm) is not None)


def survivors_of(comm) -> MPI.Intracomm:
    """The communicator `comm` stands for now: its group's survivors after
    recoveries (recover(comm=...) or recover() of the job), the world's for
    the world; `comm` itself where no algorithm made a group of it."""
    if comm is None or comm is MPI.COMM_WORLD or comm is _mpi.world_mpi():
        return _mpi.world_mpi()
    group = of(comm)
    return comm if group is None else group.comm


def every_group() -> List[Group]:
    """This rank's groups, each once, in the order they were joined."""
    seen: List[Group] = []
    for group in _groups.values():
        if group not in seen:
            seen.append(group)
    return seen
