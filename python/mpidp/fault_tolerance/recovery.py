"""recover(): after RanksLost, every survivor agrees on the ranks lost, shrinks
the world (or one worker group, domains.py) to the survivors and sets every
algorithm up again over them; a failure meanwhile starts the round over with
the survivors of both."""

from __future__ import annotations

import sys
import time
from typing import Dict, NamedTuple, Tuple

from .. import _C
from .._runtime import fault_tolerant_groups, fault_tolerant_mode
from .._runtime import mpi as _mpi
from .._runtime.fault_tolerant_mode import revoke_everything
from .._runtime.mpi import MPI
from ..algorithms.driver import refusing_replacements
# survivors.shrink is looked up on its module at each call, so that a test can
# put a rank's death inside it (tests/fault_tolerance/ulfm/train_ft.py).
from . import survivors as _survivors
from .._runtime.deadline import deadline
from .domains import GroupDomain, WorldDomain
from .replacements import spawn_replacements
from .survivors import is_failure, lost_ranks, retire

_state = fault_tolerant_mode._state


class Membership(NamedTuple):
    """The job after a recovery (after recover(comm=...): the group, in its
    own numbering). `rank`, `size`: this rank's and the job's
    now; `lost`: the ranks lost, numbered in the world before the recovery;
    `previous_size`: the size before it; `generation`: how many recoveries
    the job has been through; `comm`: the new world's mpi4py communicator
    (for the program's own MPI calls; MPI.COMM_WORLD still holds the dead
    ranks, though mpidp calls given it use the new world); `joined`: the
    ranks of the replacements that joined (recover(replace=True))."""
    rank: int
    size: int
    lost: Tuple[int, ...]
    previous_size: int
    generation: int
    comm: MPI.Intracomm
    joined: Tuple[int, ...] = ()    # the replacements' ranks (recover(replace=True))


def recover(replace: bool = False, comm=None) -> Membership:
    """After RanksLost, on every survivor: agree on the ranks lost, shrink the
    world to the survivors, set every algorithm that ran over the world up
    again over them (completing, where the algorithm's rule says so, the
    sync the loss interrupted). Should another rank fail meanwhile, it starts
    over with the survivors of both. Returns the new Membership.

    Every wait in it has a deadline (MPIDP_TIMEOUT): a survivor that never
    comes to recover() ends the job, with a message, instead of leaving the
    others waiting. An error taken for a failure that proves not to be one
    (no rank lost) is settled by going on at the same size; one that keeps
    recurring with no rank lost raises CommError here.

    comm: a group's communicator (one that algorithms run over, split off
    the world): only that group's survivors call it, and only it is shrunk
    and set up again; the other groups, which the lost rank was not in, train
    on. Membership then numbers the group's ranks (`comm` is its survivors).
    The world still holds the lost rank: a later recover() of every survivor
    of the job shrinks it too (and makes every group again of its survivors).

    replace=True: grow back to the size before, as far as the launcher
    allows: as many processes as were lost are spawned (MPI_Comm_spawn, the
    same Python and command line), join at the end of the world and build
    their model and algorithms as the script does (is_replacement() tells
    them), whose set-up gives them rank 0's parameters; the loop then calls
    share_state() on every rank for the rest of the training state."""
    if not _state.enabled:
        raise RuntimeError("recover: fault-tolerant mode is off (MPIDP_FAULT_TOLERANCE=1)")
    domain = _domain_of(comm)
    if replace:
        if not isinstance(domain, WorldDomain):
            # A replacement must join the job's world, which only every rank
            # of the job can grow, and the other groups never hear of this loss.
            raise NotImplementedError(
                "recover(comm=..., replace=True): a replacement joins the job's world, which "
                "only every rank of the job can grow, and the other groups go on untouched: "
                "call mpidp.recover(replace=True) on every survivor of the job, or "
                "recover(comm=...) to go on with the group's survivors")
        _refuse_replacements()
    cause = sys.exc_info()[1]       # the RanksLost being handled, if any
    first_comm = domain.comm()
    unexplained = None              # an error of the last rebuild that was no failure, yet
    comms = [first_comm]            # every communicator this recovery has had (a round may fail)
    holder = domain.agreed_holder   # whose `agreed` says this round's agreement is behind us
    spawned = None                  # (the world a spawn made, its replacements' ranks in it)
    spawns_lost = 0                 # spawns whose replacements ended before the recovery did
    while True:
        times = {}
        t0 = time.perf_counter()
        revoke_everything()
        old_comm = domain.comm()
        if not holder.agreed:
            with deadline(f"the survivors' agreement that a rank of {domain.what} failed"):
                try:
                    domain.agree_comm.Agree(0)   # this round's agreement: every survivor is in it
                except MPI.Exception:
                    pass
        holder.agreed = False
        _state.deferred = None
        _drain_core()
        times["agreement"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        with deadline(f"shrinking {domain.what} to the survivors"):
            survivors = _survivors.shrink(domain.agree_comm)
        times["shrink"] = time.perf_counter() - t1
        if spawned is not None and _a_replacement_was_lost(*spawned, survivors):
            spawns_lost += 1
            if spawns_lost >= _SPAWN_TRIES:
                raise RuntimeError(
                    f"recover(replace=True): the replacements spawned ended before the "
                    f"recovery did, {spawns_lost} times (their own error, if they "
                    "raised one, is printed above: a replacement runs this program again, so "
                    "each fails alike); ending the job rather than spawning again. To go on "
                    "without replacements, call mpidp.recover() without replace")
        spawned = None
        joined, before_growth = (), None
        if replace and survivors.Get_size() < old_comm.Get_size():
            before_growth = survivors
            t_spawn = time.perf_counter()
            with deadline("spawning the replacements"):
                survivors, joined = spawn_replacements(
                    survivors, old_comm.Get_size() - survivors.Get_size())
            spawned = (survivors, joined)
            times["spawn"] = time.perf_counter() - t_spawn
        t2 = time.perf_counter()
        try:
            agree_comm = survivors.Dup()
        except MPI.Exception as error:
            if not is_failure(error):
                raise
            # A survivor died after the shrink agreed on it: again, with
            # the survivors of both (the shrink's communicator serves).
            domain.restart_from(survivors)
            holder.agreed = False
            continue
        domain.take(survivors, agree_comm)
        comms.append(survivors)
        if unexplained is not None and survivors.Get_size() == old_comm.Get_size():
            raise unexplained      # no rank was lost after all: a defect, not a failure
        unexplained = None
        _state.before_growth = before_growth    # growing(): replacements joined
        try:
            if not _rebuild(domain, survivors, comms):
                continue    # a rank failed during the rebuild: again, with the survivors of both
        except _Unexplained as error:
            unexplained = error.__cause__
            continue        # the shrink tells whether a rank failed meanwhile
        finally:
            _state.before_growth = None
            if before_growth is not None:
                retire(before_growth)
        times["rebuild"] = time.perf_counter() - t2
        break
    _state.generation += 1
    _state.times = times
    lost = lost_ranks(first_comm, survivors)
    _state.fruitless = 0 if lost or joined else _state.fruitless + 1
    if _state.fruitless >= _FRUITLESS_LIMIT:
        raise _C.CommError(
            f"recover on rank {survivors.Get_rank()}: {_state.fruitless} recoveries in a row "
            "found no rank lost, so the MPI errors that started them are not failures of ranks"
            + (f"; the last: {cause}" if cause is not None else ""))
    return Membership(survivors.Get_rank(), survivors.Get_size(), lost,
                      first_comm.Get_size(), _state.generation, survivors, joined)


# Spawns of replacements a recovery tries. A replacement can end before the
# recovery that spawned it does through no fault of its own: another loss
# restarts the survivors' round and revokes the set-up it is in, which it
# cannot survive (its program has not reached its recovery loop), and a
# second spawn then joins. One whose program fails fails every time.
_SPAWN_TRIES = 2


def _a_replacement_was_lost(world, joined, survivors) -> bool:
    """Whether a replacement the last spawn made (ranks `joined` of `world`)
    is missing from the survivors (the shrink is agreed: every survivor
    finds the same)."""
    return bool(set(lost_ranks(world, survivors)) & set(joined))


def _domain_of(comm):
    """What recover(comm=...) shrinks: the job's world (None, MPI.COMM_WORLD or
    the world now) or the group of `comm`."""
    if comm is None or comm is MPI.COMM_WORLD or comm is _mpi.world_mpi():
        return WorldDomain()
    group = fault_tolerant_groups.of(comm)
    if group is None:
        raise ValueError(
            "comm: no mpidp algorithm runs over this communicator in fault-tolerant mode, so "
            "there is no group of it to recover; pass the communicator an algorithm was given "
            "(or the Membership.comm of the group's last recovery), or comm=None for the job")
    return GroupDomain(group)


def _refuse_replacements() -> None:
    """recover(replace=True) with an algorithm that cannot take a replacement
    raises at once, on every survivor alike (the same algorithms run on
    each), before anything of the recovery: a replacement's set-up would
    otherwise wait for survivors that never repeat it, until MPIDP_TIMEOUT."""
    refusing = [obj for obj in fault_tolerant_mode.participants()
                if not getattr(obj, "_takes_replacements", lambda: False)()]
    names, why = refusing_replacements()
    names += sorted({type(obj).__name__ for obj in refusing})
    if names:
        why += sorted({obj._why_no_replacements() for obj in refusing
                       if hasattr(obj, "_why_no_replacements")})
        raise NotImplementedError(
            f"recover(replace=True): {', '.join(names)} cannot take a replacement ("
            + ("; ".join(why) if why else
               "its recovery does not say that it repeats, call for call, the set-up a "
               "replacement's construction runs: a driver that does returns True from "
               "_takes_replacements()")
            + "); call mpidp.recover() without replace to go on with the survivors")


# Recoveries in a row that found no rank lost (each started by an error taken
# for a failure) after which recover() takes the error for what it is.
_FRUITLESS_LIMIT = 3


class _Unexplained(Exception):
    """A rebuild failed with an error that is not MPI's word for a failure
    (its cause): the next shrink tells whether a rank was lost."""


def _rebuild(domain, survivors: MPI.Intracomm, comms) -> bool:
    """Every algorithm and group set up again over `survivors`; then every
    survivor agrees that each of them did. False (on every survivor alike)
    when a rank failed meanwhile: a survivor that finished its part would
    otherwise train on while another starts over.

    A rank that dies in the middle of a collective may also leave the
    others with data that is not an error of MPI's but is wrong all the
    same (a pickled object cut short: UnpicklingError). Any error here
    therefore starts the round over like a failure (_Unexplained); if the
    shrink then finds no rank lost, recover() raises it for what it is."""
    done, unexplained = True, None
    try:
        with deadline(f"rebuilding the algorithms of {domain.what} over the survivors"):
            domain.rebuild(survivors, comms)
    except Exception as error:    # noqa: BLE001 -- sorted here, re-raised when no rank failed
        if not is_failure(error):
            unexplained = error
        revoke_everything()
        done = False
    with deadline("the survivors' agreement that the rebuild is complete"):
        try:
            done = bool(domain.agree_comm.Agree(int(done)))
        except MPI.Exception:
            done = False
    # This round's agreement is behind every survivor: the next round starts
    # at the shrink.
    domain.agreed_holder.agreed = not done
    if unexplained is not None:
        raise _Unexplained() from unexplained
    return done


def steps_committed() -> int:
    """Training steps every rank agreed to apply since fault-tolerant mode
    was turned on (one per step, however many optimizers it steps). After
    recover(), the loop goes on from this step: the step in flight when a
    rank died is not among them (non-blocking DataParallel: the step that
    was due, which the loop had already passed)."""
    return _state.committed


def recovery_times() -> Dict[str, float]:
    """Seconds of the last recover()'s phases: agreement (from the call to the
    survivors agreeing that a rank failed), shrink and rebuild."""
    return dict(_state.times)


def _drain_core() -> None:
    """Every request mpidp had in flight completes (with an error, on the
    revoked communicators), so no buffer is left to MPI."""
    # Each failed request ends the wait with its error (and frees its slot):
    # wait again until a wait ends cleanly. At least one wait even with no
    # request live: it runs the multi-stage engines (a quantized allreduce
    # between stages), which fail on the revoked communicators and let go.
    # A request that neither completes nor fails within MPIDP_TIMEOUT (one
    # on a communicator nobody revoked) raises CommTimeout out of here.
    while True:
        try:
            _C.finish_pending()
            return
        except _C.CommTimeout:
            raise
        except _C.CommError:
            continue
