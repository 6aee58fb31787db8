"""Fault-tolerant mode: training goes on when ranks die (MPI's ULFM).

Asked for with MPIDP_FAULT_TOLERANCE=1 (or mpidp.enable_fault_tolerance()),
under an MPI with the ULFM extension launched with it on (Open MPI 5:
``mpirun --with-ft ulfm``). The default mode is unchanged: a lost rank ends
the job.

The rule, on every survivor alike:

- A training step is a transaction. Its end (the optimizer's step under
  DataParallel) is an agreement of every rank (MPIX_Comm_agree, which either
  succeeds everywhere or fails everywhere). A step in which a rank died is
  discarded by every survivor: nobody applies it, whether or not its own
  gradient averaging happened to complete.
- Every survivor raises mpidp.RanksLost within that step: where it saw the
  failure (forward, backward, any mpidp collective) or at the step's end.
  The rank that sees a failure first revokes every communicator of mpidp, so
  no survivor waits on a rank that is gone or busy recovering.
- The training loop catches RanksLost and calls mpidp.recover(): the
  survivors agree on who died, shrink the world to themselves (rank order
  kept), and every algorithm that ran over the world is set up again over
  the survivors. recover() returns the new Membership, so the loop re-shards
  its data (DistributedSampler(num_replicas=m.size, rank=m.rank)) and may
  scale its learning rate; mpidp.rank(), size(), topology() and
  MPI.COMM_WORLD passed to mpidp follow.

Why an exception and not a callback or a generator of steps: the failed step
must be abandoned wherever each survivor is in it (a callback cannot unwind
a backward pass), and the loop -- which alone knows its sampler, its step
counter and its batch -- decides what to do next. It is the pattern of
Horovod's elastic mode and torchft's should_commit, in one except clause.

Every survivor holds the full training state after a failure (data
parallelism keeps a replica per rank), so the survivors' new rank 0 can
write a checkpoint from memory (mpidp.fault_tolerance.save_checkpoint)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

from .. import _C
from .._runtime import config
from .._runtime import membership
from .._runtime import mpi as _mpi
from .._runtime.membership import (RanksLost, agree_all_alive, commit_step, defer, enable,
                                   enabled, is_replacement, participate, raise_deferred,
                                   revoke_everything, step_boundary, world_agreement, world_comm)
from .._runtime.mpi import MPI
from .._runtime.topology import forget_splits
from ..algorithms.driver import continue_on_survivors
from ..collectives import process_groups as process_group

_state = membership._state

__all__ = ["Membership", "RanksLost", "enable", "enabled", "recover", "is_replacement",
           "share_state", "world_comm", "steps_committed", "save_checkpoint", "recovery_times",
           "reset_grad_scaler",
           # the per-step half, for the algorithms (mpidp/_runtime/membership.py):
           "step_boundary", "agree_all_alive", "world_agreement", "commit_step", "participate",
           "defer", "raise_deferred", "revoke_everything"]


class Membership(NamedTuple):
    """The job after a recovery. `rank`, `size`: this rank's and the job's
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


def share_state(state: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """After recover(replace=True), on every rank of the new world: rank 0's
    `state` (whatever the loop needs to go on: optimizer state_dicts, the
    step, the epoch) for everyone; a replacement passes None. Model
    parameters and buffers need not be in it: the algorithms' set-up made
    them rank 0's. Also brings a replacement's steps_committed() level, and
    a replacement's call completes the recovery: it joins the survivors'
    agreement that the rebuild is complete (RanksLost where a rank failed
    meanwhile)."""
    comm = _mpi.world_mpi()
    if _state.owes_rebuild_agreement:
        _state.owes_rebuild_agreement = False
        try:
            complete = _state.agree_comm.Agree(1)
        except MPI.Exception:
            complete = False
        if not complete:     # a rank failed as this one joined: recover() with the others
            _state.agreed = True
            raise RanksLost(f"share_state on rank {comm.Get_rank()}: a rank failed while this "
                            "replacement joined; call mpidp.recover() to go on with the survivors")
    mine = (state, _state.committed, _state.generation) if comm.Get_rank() == 0 else None
    state, _state.committed, _state.generation = comm.bcast(mine, root=0)
    return state


def reset_grad_scaler(scaler) -> None:
    """After RanksLost: a torch.amp.GradScaler whose step was cut short still
    holds that step's unscale and inf checks, so its next unscale_() or
    step() would raise (or skip a step); this drops them, keeping the scale
    and its growth tracker as they were -- as if the step never began. Call
    it in the except clause, beside recover()."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        raise TypeError(f"scaler: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
    states.clear()


def recover(replace: bool = False) -> Membership:
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

    replace=True: grow back to the size before, as far as the launcher
    allows: as many processes as were lost are spawned (MPI_Comm_spawn, the
    same Python and command line), join at the end of the world and build
    their model and algorithms as the script does (is_replacement() tells
    them), whose set-up gives them rank 0's parameters; the loop then calls
    share_state() on every rank for the rest of the training state."""
    if not _state.enabled:
        raise RuntimeError("recover: fault-tolerant mode is off (MPIDP_FAULT_TOLERANCE=1)")
    cause = sys.exc_info()[1]       # the RanksLost being handled, if any
    first_world = _mpi.world_mpi()
    unexplained = None              # an error of the last rebuild that was no failure, yet
    worlds = [first_world]          # every world this recovery has had (a round may fail)
    while True:
        times = {}
        t0 = time.perf_counter()
        revoke_everything()
        old_world = _mpi.world_mpi()
        if not _state.agreed:
            with deadline("the survivors' agreement that a rank failed"):
                try:
                    _state.agree_comm.Agree(0)   # this round's agreement: every survivor is in it
                except MPI.Exception:
                    pass
        _state.agreed = False
        _state.deferred = None
        _drain_core()
        times["agreement"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        with deadline("shrinking the world to the survivors"):
            survivors = _shrink(_state.agree_comm)
        times["shrink"] = time.perf_counter() - t1
        joined = ()
        if replace and survivors.Get_size() < old_world.Get_size():
            t_spawn = time.perf_counter()
            with deadline("spawning the replacements"):
                survivors, joined = _spawn_replacements(
                    survivors, old_world.Get_size() - survivors.Get_size())
            times["spawn"] = time.perf_counter() - t_spawn
        t2 = time.perf_counter()
        try:
            agree_comm = survivors.Dup()
        except MPI.Exception as error:
            if not _is_failure(error):
                raise
            # A survivor died after the shrink agreed on it: again, with
            # the survivors of both (the shrink's communicator serves).
            _retire(_state.agree_comm)
            _state.agree_comm = survivors
            _state.agreed = False
            continue
        _retire(_state.agree_comm)
        _state.agree_comm = agree_comm
        _mpi.replace_world(survivors)
        worlds.append(survivors)
        forget_splits()
        if unexplained is not None and survivors.Get_size() == old_world.Get_size():
            raise unexplained      # no rank was lost after all: a defect, not a failure
        unexplained = None
        try:
            if not _rebuild(survivors, worlds):
                continue    # a rank failed during the rebuild: again, with the survivors of both
        except _Unexplained as error:
            unexplained = error.__cause__
            continue        # the shrink tells whether a rank failed meanwhile
        times["rebuild"] = time.perf_counter() - t2
        break
    _state.generation += 1
    _state.times = times
    lost = _lost_ranks(first_world, survivors)
    _state.fruitless = 0 if lost or joined else _state.fruitless + 1
    if _state.fruitless >= _FRUITLESS_LIMIT:
        raise _C.CommError(
            f"recover on rank {survivors.Get_rank()}: {_state.fruitless} recoveries in a row "
            "found no rank lost, so the MPI errors that started them are not failures of ranks"
            + (f"; the last: {cause}" if cause is not None else ""))
    return Membership(survivors.Get_rank(), survivors.Get_size(), lost,
                      first_world.Get_size(), _state.generation, survivors, joined)


# Recoveries in a row that found no rank lost (each started by an error taken
# for a failure) after which recover() takes the error for what it is.
_FRUITLESS_LIMIT = 3


def _shrink(comm: MPI.Intracomm) -> MPI.Intracomm:
    """The survivors of `comm` (MPIX_Comm_shrink), agreed to be alive."""
    survivors = comm
    while True:
        survivors = survivors.Shrink()
        try:        # a rank may have died unseen during the shrink: shrink again
            survivors.Agree(1)
            return survivors
        except MPI.Exception:
            survivors.Ack_failed()


class _Unexplained(Exception):
    """A rebuild failed with an error that is not MPI's word for a failure
    (its cause): the next shrink tells whether a rank was lost."""


def _rebuild(survivors: MPI.Intracomm, worlds) -> bool:
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
        with deadline("rebuilding the algorithms over the survivors"):
            process_group.continue_on(survivors)
            continue_on_survivors(*worlds)
            for obj in membership.participants():
                obj._continue_on(survivors)
    except Exception as error:    # noqa: BLE001 -- sorted here, re-raised when no rank failed
        if not _is_failure(error):
            unexplained = error
        revoke_everything()
        done = False
    with deadline("the survivors' agreement that the rebuild is complete"):
        try:
            done = bool(_state.agree_comm.Agree(int(done)))
        except MPI.Exception:
            done = False
    # This round's agreement is behind every survivor: the next round starts
    # at the shrink.
    _state.agreed = not done
    if unexplained is not None:
        raise _Unexplained() from unexplained
    return done


def _failure_classes() -> Tuple[int, ...]:
    """MPI error classes that a rank's failure causes or can cause (see
    mpidp_ft_classify in csrc/core/ft.c)."""
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED", "ERR_OTHER",
             "ERR_INTERN", "ERR_TRUNCATE", "ERR_IN_STATUS", "ERR_PENDING", "ERR_UNKNOWN")
    return tuple(getattr(MPI, n) for n in names if hasattr(MPI, n))


def _is_failure(error: BaseException) -> bool:
    """Whether `error`, raised while the survivors rebuild, is (or may be) a
    rank's failure rather than a defect."""
    if isinstance(error, RanksLost):
        return True
    return isinstance(error, MPI.Exception) and error.Get_error_class() in _failure_classes()


@contextlib.contextmanager
def deadline(what: str, seconds: float | None = None, caller: str = "recover()",
             hint: str = "a survivor is not taking part (stuck, or never called "
                         "mpidp.recover())"):
    """A wait of fault-tolerant mode that outlives `seconds` (MPIDP_TIMEOUT)
    ends the job with a message naming `caller`, `what` and `hint`: MPI's
    agreement, shrink and the rebuild's collectives wait for every survivor,
    cannot be interrupted, and one survivor that never comes (stuck
    elsewhere, a bug) would hold the others forever."""
    limit = float(config.get("MPIDP_TIMEOUT")) if seconds is None else float(seconds)
    source = "MPIDP_TIMEOUT" if seconds is None else "the group's timeout"
    rank = _mpi.world_mpi().Get_rank()

    def expire():
        sys.stderr.write(f"mpidp: {caller} on rank {rank}: {what} took longer than "
                         f"{source} ({limit:g} s); {hint}: aborting the job\n")
        sys.stderr.flush()
        _C.abort_job(4)

    timer = threading.Timer(limit, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


_RUNTIME_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "OPAL_", "PMI_", "HYDRA_", "MPI_LOCAL")


def _spawn_replacements(survivors: MPI.Intracomm, n: int):
    """Spawns n processes running this program, merged after the survivors:
    (the merged communicator, the replacements' ranks in it)."""
    if not sys.argv or sys.argv[0] in ("", "-c", "-m") or not os.path.exists(sys.argv[0]):
        raise RuntimeError("recover(replace=True): this program was not started from a script "
                           f"file (sys.argv[0] is {sys.argv[:1]}), so it cannot be started "
                           "again for a replacement; recover() without replace goes on smaller")
    # The replacements get this rank's environment (spawned processes start
    # from the launcher's), less the MPI runtime's own per-process variables.
    env = [f"{k}={v}" for k, v in sorted(os.environ.items())
           if not k.startswith(_RUNTIME_PREFIXES)]
    command = shutil.which("env") or "/usr/bin/env"
    inter = survivors.Spawn(command, env + [sys.executable] + sys.argv, maxprocs=n, root=0)
    merged = inter.Merge(high=False)
    inter.Disconnect()
    size = merged.Get_size()
    return merged, tuple(range(size - n, size))


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


def save_checkpoint(path: str, state: Dict[str, Any]) -> None:
    """Write `state` (state_dicts) from memory to `path`, by the survivors'
    rank 0 only (every survivor holds the same replica), atomically (a
    temporary file renamed), then wait for every rank; a relaunch at any size
    loads it with the usual load_state_dict calls."""
    comm = _mpi.world_mpi()
    if comm.Get_rank() == 0:
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)
    try:
        comm.Barrier()
    except MPI.Exception as error:
        raise membership.lost(f"save_checkpoint on rank {comm.Get_rank()}", error) from None


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


def _lost_ranks(old_world: MPI.Intracomm, survivors: MPI.Intracomm) -> Tuple[int, ...]:
    kept = set(MPI.Group.Translate_ranks(survivors.Get_group(), list(range(survivors.Get_size())),
                                         old_world.Get_group()))
    return tuple(r for r in range(old_world.Get_size()) if r not in kept)


# The revoked agreement communicators of earlier recoveries, never freed:
# Open MPI 5.0's MPI_Comm_free of a revoked communicator, where a rank died
# during the recovery, corrupted the heap of every survivor ("malloc():
# unsorted double linked list corrupted" at their next allocation) in 5 of 8
# quiet runs of tests/ft's 4-rank kill in the agreement, 1 of 10 without it.
# A communicator handle per recovery is what that costs.
_retired: list = []


def _retire(comm: MPI.Intracomm) -> None:
    _retired.append(comm)
