"""FT-HSDP's rule for torch.distributed programs that shard a model within
groups of ranks and replicate it across them (FSDP2's `fully_shard` over a
2-D mesh, replicate x shard): a group that lost a rank lost part of its
replica, so after recover() it is dropped and the whole groups go on over
their own communicator. The survivors of a dropped group leave training."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .._runtime.args import check_int
from .._runtime.mpi import MPI
from ..collectives.process_groups import init_process_group
from .recovery import Membership


def keep_whole_groups(membership: Membership, group_size: int) -> Optional[MPI.Intracomm]:
    """After `membership = mpidp.recover()` (or recover(comm=...) of the
    communicator this returned before): the replica groups -- consecutive
    blocks of `group_size` ranks of the communicator before the loss -- that
    lost no rank go on. Returns their communicator (ranks in the same order,
    so each keeps its place in its group, and so its shards), over which
    torch.distributed's default group is made again ("mpidp" backend; build
    the device mesh and the sharded model again over it, copying each
    rank's local shards across). Returns None on the survivors of a group
    that lost a rank: they hold a part of a replica that no longer exists
    and leave training (their default group is destroyed).

    Collective over membership.comm. The loop then agrees on its steps over
    the returned communicator (mpidp.fault_tolerance.step_boundary(comm))
    and passes it to recover(comm=...) at the next loss."""
    if not isinstance(membership, Membership):
        raise TypeError("membership: expected what mpidp.recover() returned, got "
                        f"{type(membership).__name__}")
    # Compared before any check of one rank's own, so that every rank raises
    # alike (one raising alone would leave the others in the split).
    sizes = sorted(set(membership.comm.allgather(group_size)), key=repr)
    if len(sizes) > 1:
        raise ValueError(f"group_size: the ranks passed different sizes ({sizes}); every rank "
                         "must pass the size of the shard groups")
    check_int("group_size", group_size, 1)
    if membership.previous_size % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the {membership.previous_size} "
                         "ranks there were before the loss, so they were not whole groups of it")
    lost = set(membership.lost)
    survivors = [r for r in range(membership.previous_size) if r not in lost]
    before = survivors[membership.rank]        # this rank's number before the loss
    broken = {r // group_size for r in lost}
    whole = before // group_size not in broken
    kept = membership.comm.Split(0 if whole else MPI.UNDEFINED, membership.rank)
    if dist.is_initialized():
        dist.destroy_process_group()
    if not whole:
        return None
    init_process_group(comm=kept, backend="mpidp")
    return kept
