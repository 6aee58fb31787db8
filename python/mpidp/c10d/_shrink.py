"""torch.distributed.shrink_group on an "mpidp" group: the C++ backend's
shrink() (csrc/torch/c10d_backend.cpp) asks for a backend over the group's
ranks less the excluded ones, which only the remaining ranks call.

Outside fault-tolerant mode the remaining ranks make MPI's communicator of
themselves (MPI_Comm_create_group, which only they take part in). In
fault-tolerant mode the excluded ranks are the failed ones: a failure
revokes the group's communicator, where only ULFM's shrink still works, and
the shrink (under the group's deadline) is taken part in by every live
rank -- so a live rank left out (a mistake in ranks_to_exclude) ends the
job at the deadline with a message saying so, and a failed rank left in is
named. Either way the remaining ranks then check that each passed
the same ranks_to_exclude."""

from __future__ import annotations

import datetime
import zlib

import torch
import torch.distributed as dist

from .._runtime import mpi as _mpi
from .._runtime.argument_agreement import agree, crc_of
from .._runtime.mpi import MPI, revocable
from .._runtime.deadline import deadline
from . import _registration
from ._registration import backend_over


def shrunk_backend(group, ranks_to_exclude, shrink_flags: int):
    """The backend over `group`'s ranks less ranks_to_exclude (group ranks,
    which torch has checked: in range, no duplicates, not this rank's)."""
    parent = group.mpi_comm
    excluded = sorted({int(r) for r in ranks_to_exclude})
    remaining = [r for r in range(parent.Get_size()) if r not in excluded]
    if _mpi.fault_tolerant:
        comm = _survivors(parent, remaining, excluded, group.timeout_s)
    else:
        members = parent.Get_group().Incl(remaining)
        comm = parent.Create_group(members, zlib.crc32(repr(("shrink", excluded)).encode())
                                   % 32768)
        members.Free()
    backend = backend_over(revocable(comm), datetime.timedelta(seconds=group.timeout_s),
                           [group.global_ranks[r] for r in remaining])
    python_group = getattr(backend, "python_group", backend)
    agree(python_group.core_comm, "shrink_group", torch.tensor(excluded, dtype=torch.int64),
          layout=crc_of(excluded))
    return backend


def _survivors(parent, remaining, excluded, timeout_s: float):
    """ULFM's shrink of `parent` (revoked or not) to its live ranks, which
    must be `remaining`. The shrink is blocking (Open MPI 5's MPIX_Comm_ishrink
    fails with MPI_ERR_INTERN on a revoked communicator): past the group's
    deadline the job ends, with a message, as recover()'s waits do."""
    with deadline("the live ranks' shrink", timeout_s, caller="shrink_group",
                  hint="in fault-tolerant mode every live rank of the group takes part, so "
                       "ranks_to_exclude must name failed ranks only, and every other rank must "
                       f"call shrink_group (excluded: {excluded})"):
        comm = parent.Shrink()
    live = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                     parent.Get_group())
    failed_too = sorted(set(remaining) - set(live))
    if failed_too:
        comm.Free()
        raise dist.DistBackendError(
            f"shrink_group: group rank(s) {failed_too} failed too; exclude them as well "
            f"(excluded: {excluded})")
    return comm


# The C++ backend's shrink() calls shrunk_backend through its own module
# (csrc/torch/c10d_backend.cpp): registered from here, so the extension
# imports no Python layer above it.
if _registration._c10d is not None:
    _registration._c10d.shrunk_backend = shrunk_backend
