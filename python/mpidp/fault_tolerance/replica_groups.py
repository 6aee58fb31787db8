"""FT-HSDP's rule for torch.distributed programs that shard a model within
groups of ranks and replicate it across them (FSDP2's `fully_shard` over a
2-D mesh, replicate x shard): a group that lost a rank lost part of its
replica, so after recover() it is dropped and the whole groups go on over
their own communicator. The survivors of a dropped group leave training.
After recover(replace=True) the group is made whole again instead: each
replacement takes a lost rank's place, and its shards from the rank of the
same place in another replica group (give_replacements_shards)."""

from __future__ import annotations

import sys
from typing import List, Optional

import torch
import torch.distributed as dist

from .._runtime import fault_tolerant_mode
from .._runtime import mpi as _mpi
from .._runtime.args import check_int
from .._runtime.deadline import deadline
from .._runtime.mpi import MPI
from ..collectives.process_groups import init_process_group
from .recovery import Membership


def keep_whole_groups(membership: Optional[Membership],
                      group_size: int) -> Optional[MPI.Intracomm]:
    """After `membership = mpidp.recover()` (or recover(comm=...) of the
    communicator this returned before): the replica groups -- consecutive
    blocks of `group_size` places, a rank's place being its rank in the
    communicator this returned last on it (else in the communicator before
    the loss; after a growth the job's world is in the order the ranks
    joined, not in their places) -- that lost no rank go on. Returns their
    communicator (ranks in the same order, so each keeps its place in its
    group, and so its shards), over which
    torch.distributed's default group is made again ("mpidp" backend; build
    the device mesh and the sharded model again over it, copying each
    rank's local shards across). Returns None on the survivors of a group
    that lost a rank: they hold a part of a replica that no longer exists
    and leave training (their default group is destroyed).

    Collective over membership.comm. The loop then agrees on its steps over
    the returned communicator (mpidp.fault_tolerance.step_boundary(comm))
    and passes it to recover(comm=...) at the next loss.

    After recover(replace=True) (replacements joined: membership.joined;
    on a replacement, pass membership=None) no group is dropped: every rank
    of the job, each replacement in a lost rank's place, is returned in the
    order of the places, with the default group made over it. The
    survivors' shards carry across as above; give_replacements_shards then
    gives each replacement its own. Steps are still agreed, and losses
    recovered, over the job (comm=None), which can grow back again."""
    joining = fault_tolerant_mode.is_replacement() and membership is None
    if not joining and not isinstance(membership, Membership):
        raise TypeError("membership: expected what mpidp.recover() returned (None only on a "
                        f"replacement), got {type(membership).__name__}")
    comm = _mpi.world_mpi() if joining else membership.comm
    with deadline("keep_whole_groups", caller="keep_whole_groups",
                  hint="a survivor is not calling it (every survivor of the recovery must)"):
        # Compared before any check of one rank's own, so that every rank raises
        # alike (one raising alone would leave the others in the split).
        sizes = sorted(set(comm.allgather(group_size)), key=repr)
        if len(sizes) > 1:
            raise ValueError(f"group_size: the ranks passed different sizes ({sizes}); every "
                             "rank must pass the size of the shard groups")
        check_int("group_size", group_size, 1)
        if joining:
            layout = _regroup_with_replacements(comm, None, group_size)
        else:
            layout = _keep_or_regroup(membership, group_size)
    global _last_layout
    _last_layout = layout
    return layout


# The communicator keep_whole_groups returned last on this rank: its order is
# the ranks' places (a grown job's world is in the order the ranks joined).
_last_layout: Optional[MPI.Intracomm] = None


def _places_before_loss(membership: Membership) -> List[int]:
    """The place before the loss of each survivor (by its rank in
    membership.comm): its rank in the layout keep_whole_groups returned
    last, else in the communicator recovered (membership's numbering)."""
    if _last_layout is None or _last_layout.Get_size() != membership.previous_size:
        lost = set(membership.lost)
        return [r for r in range(membership.previous_size) if r not in lost]
    # (A replacement's is MPI.UNDEFINED: it takes a lost rank's place later.)
    return MPI.Group.Translate_ranks(membership.comm.Get_group(),
                                     list(range(membership.comm.Get_size())),
                                     _last_layout.Get_group())


def _keep_or_regroup(membership: Membership, group_size: int) -> Optional[MPI.Intracomm]:
    if membership.previous_size % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the {membership.previous_size} "
                         "ranks there were before the loss, so they were not whole groups of it")
    places = _places_before_loss(membership)
    place = places[membership.rank]        # this rank's place before the loss
    if membership.joined:
        return _regroup_with_replacements(membership.comm, place, group_size)
    lost = set(range(membership.previous_size)) - set(places)      # no replacement here
    broken = {p // group_size for p in lost}
    whole = place // group_size not in broken
    kept = membership.comm.Split(0 if whole else MPI.UNDEFINED, place)
    if dist.is_initialized():
        dist.destroy_process_group()
    if not whole:
        return None
    init_process_group(comm=kept, backend="mpidp")
    return kept


def _regroup_with_replacements(comm: MPI.Intracomm, place: Optional[int],
                               group_size: int) -> MPI.Intracomm:
    """The grown job in the order of the places before the loss (`place`:
    this survivor's; None on a replacement, which takes a lost rank's, the
    lowest first in rank order), the default group made over it."""
    places = fault_tolerant_mode.places_after_growth(comm, place, comm.Get_size())
    if len(places) % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the {len(places)} ranks of "
                         "the job grown back")
    ordered = comm.Split(0, places[comm.Get_rank()])
    if dist.is_initialized():
        dist.destroy_process_group()
    init_process_group(comm=ordered, backend="mpidp")
    return ordered



def give_replacements_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             comm: MPI.Intracomm, group_size: int) -> None:
    """After keep_whole_groups grew the groups back (`comm`, what it
    returned), with `model` sharded again over its mesh and the survivors'
    local shards copied in: each replacement takes the local shards of its
    parameters and of the optimizer's state (every tensor of it, e.g.
    momentum) from the rank of its place in the first replica group that
    has a survivor there (the replicas are equal: every group applied the
    same averaged steps). The other ranks keep theirs. Collective over
    `comm`."""
    with deadline("give_replacements_shards", caller="give_replacements_shards",
                  hint="a rank of `comm` is not calling it (every rank must)"):
        _give_shards(model, optimizer, comm, group_size)


def _give_shards(model, optimizer, comm, group_size) -> None:
    rank = comm.Get_rank()
    peers = comm.Split(rank % group_size, rank)      # the same shard in every group
    try:
        joined = peers.allgather(fault_tolerant_mode.is_replacement())
        if not any(joined):
            return
        if all(joined):
            raise RuntimeError("give_replacements_shards: every replica group lost the rank of "
                               f"shard {rank % group_size}, so no rank holds it any more")
        root = joined.index(False)
        params = list(model.parameters())
        mine = None
        if peers.Get_rank() == root:
            # Each state entry: its local shard (sharded like the
            # parameter, e.g. momentum), or as it is (a step count).
            mine = ([_local(p).clone() for p in params],
                    [{k: (_is_dtensor(v), _local(v).clone()
                          if isinstance(v, torch.Tensor) else v)
                      for k, v in optimizer.state.get(p, {}).items()} for p in params])
        shards, states = peers.bcast(mine, root=root)
        if not joined[peers.Get_rank()]:
            return
        with torch.no_grad():
            for p, shard, state in zip(params, shards, states):
                _local(p).copy_(shard)
                for k, (sharded, v) in state.items():
                    if sharded:
                        like = torch.zeros_like(p)
                        _local(like).copy_(v)
                        v = like
                    optimizer.state[p][k] = v
    finally:
        peers.Free()


def _is_dtensor(t) -> bool:
    # Looked up, not imported: torch.distributed.tensor takes most of a
    # second to import, and a program that made a DTensor has it already.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters), or the tensor itself."""
    return t.to_local() if _is_dtensor(t) else t
