"""What one recover() shrinks: the job's world (every survivor of the job
calls it) or one group, a sub-communicator that algorithms run over
(recover(comm=group): only that group's survivors call it, and the other
groups train on). Each says where its ranks agree, takes its survivors and
sets up again what ran over it; recovery.py runs the rounds for either."""

from __future__ import annotations

from typing import List

from .._runtime import fault_tolerant_groups, fault_tolerant_mode
from .._runtime import mpi as _mpi
from .._runtime.fault_tolerant_groups import Group
from .._runtime.mpi import MPI
from .._runtime.topology import forget_splits
from ..algorithms.driver import continue_on_survivors
from ..collectives import process_groups as process_group
from .replacements import send_plan
from .survivors import retire

_state = fault_tolerant_mode._state

# MPI_Comm_create_group's tag for a group made again of its survivors inside
# a recovery of the whole job (each rank makes its own groups, one at a time).
_GROUP_TAG = 0x6D70


class WorldDomain:
    """The job's world: a recovery of it sets up again every algorithm of the
    job, each group's too (made again of the group's survivors)."""

    what = "the job"
    agreed_holder = _state

    def comm(self) -> MPI.Intracomm:
        return _mpi.world_mpi()

    @property
    def agree_comm(self) -> MPI.Intracomm:
        return _state.agree_comm

    def take(self, survivors: MPI.Intracomm, agree_comm: MPI.Intracomm) -> None:
        retire(_state.agree_comm)
        _state.agree_comm = agree_comm
        _mpi.replace_world(survivors)
        forget_splits()

    def restart_from(self, survivors: MPI.Intracomm) -> None:
        """A survivor died after the shrink agreed on it: the next round agrees
        and shrinks over the shrink's communicator."""
        retire(_state.agree_comm)
        _state.agree_comm = survivors

    def rebuild(self, survivors: MPI.Intracomm, old_comms: List[MPI.Intracomm]) -> None:
        world_participants = [obj for obj in fault_tolerant_mode.participants()
                              if fault_tolerant_groups.of(_participant_comm(obj)) is None]
        before_growth = fault_tolerant_mode.survivors_before_growth()
        if before_growth is not None:
            send_plan(survivors)
            # Replacements joined: what the loss interrupted is finished over
            # the survivors alone first, so the replacements' set-up gives
            # them the state the survivors go on from.
            for obj in world_participants:
                finish = getattr(obj, "_finish_before_growth", None)
                if finish is not None:
                    finish(before_growth)
        if fault_tolerant_groups.of(process_group.default_group_source()) is None:
            process_group.continue_on(survivors, growing=before_growth is not None)
        continue_on_survivors(survivors, {c.py2f() for c in old_comms})
        for obj in world_participants:
            if not _owned(obj):
                obj._continue_on(survivors)
        # Every group is made again of its survivors in the new world (the
        # ranks of the job revoked every communicator they are in).
        for group in fault_tolerant_groups.every_group():
            members = MPI.Group.Intersection(group.comm.Get_group(), survivors.Get_group())
            regrouped = survivors.Create_group(members, _GROUP_TAG)
            old = set(group.keys)
            retire(group.agree_comm)
            group.moved_to(regrouped, regrouped.Dup())
            _rebuild_group(group, regrouped, old)


class GroupDomain:
    """One group: a recovery of it sets up again what ran over the group."""

    def __init__(self, group: Group):
        self.group = group
        self.agreed_holder = group
        self.what = "the group"

    def comm(self) -> MPI.Intracomm:
        return self.group.comm

    @property
    def agree_comm(self) -> MPI.Intracomm:
        return self.group.agree_comm

    def take(self, survivors: MPI.Intracomm, agree_comm: MPI.Intracomm) -> None:
        retire(self.group.agree_comm)
        self.group.moved_to(survivors, agree_comm)
        forget_splits()

    def restart_from(self, survivors: MPI.Intracomm) -> None:
        retire(self.group.agree_comm)
        self.group.agree_comm = survivors

    def rebuild(self, survivors: MPI.Intracomm, old_comms: List[MPI.Intracomm]) -> None:
        _rebuild_group(self.group, survivors, {c.py2f() for c in old_comms})


def _rebuild_group(group: Group, survivors: MPI.Intracomm, old_keys) -> None:
    if fault_tolerant_groups.of(process_group.default_group_source()) is group:
        process_group.continue_on(survivors)     # torch.distributed's, made over the group
    continue_on_survivors(survivors, old_keys)
    for obj in fault_tolerant_mode.participants():
        if fault_tolerant_groups.of(_participant_comm(obj)) is group and not _owned(obj):
            obj._continue_on(survivors)


def _participant_comm(obj):
    """The communicator a participant (a model averager, DeMo) runs over."""
    return obj._recovery_comm()


def _owned(obj) -> bool:
    """A participant that a driver owns (with_bagua LocalSGD's averager) goes
    on through that driver's _continue_on, in the order of the driver's own
    set-up (which a replacement repeats)."""
    return getattr(obj, "_owned_by_driver", False)
