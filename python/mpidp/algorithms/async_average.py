"""Bagua's AsyncModelAverageAlgorithm on the core's background averaging
engine (mpidp/bgavg.h).

Each rank trains on its own; a background thread (C, on its own duplicate of
the communicator, never holding the GIL) averages the weights over all ranks
every sync_interval_ms: snapshot s under the weight lock, S = the sum of the
ranks' snapshots while training goes on, then under the lock
x <- (x - s) + S/n, so what training changed meanwhile is kept. Averaging
moves weight between ranks and never creates or loses any: the sum over the
ranks of the weights is the starting sum plus every local update.

Fault-tolerant mode: each round is applied only once every rank's thread
agrees that its own went well (an MPIX_Comm_agree in the thread), so a rank
lost mid-round leaves no survivor with a half-applied average; the training
threads raise RanksLost at their next step, and recover() starts the thread
again over the survivors.

The training thread holds the weight lock from each training forward to the
next optimizer step (so a step applies its gradient to the weights it was
taken at), and around any other forward; it never waits for the thread
otherwise. The first warmup_steps steps average gradients instead
(mpidp.DataParallel, every rank stepping alike), then the thread starts.
`abort(model)` stops the thread (every rank at the same round; collective)
and `resume(model)` starts it again. Needs MPI initialized with
MPI_THREAD_MULTIPLE (mpi4py's default) and says so otherwise.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Dict

import torch

from .. import _C
from .bagua.algorithm import Algorithm
from .._runtime import fault_tolerant_mode
from .._runtime.args import check_bool, check_choice, check_int
from .._runtime.model_consistency import check_every, ranks_range
from .driver import Driver
from .._runtime.mpi import communicator, resolve_comm
from .._runtime.hook_handles import remove_handles
from .._runtime.model_checks import float32_cpu_trainable
from .data_parallel import DataParallel

__all__ = ["AsyncModelAverageAlgorithm"]

# Handles whose thread may run: stopped before MPI is finalized at exit.
_RUNNING: "weakref.WeakSet[_AsyncHandle]" = weakref.WeakSet()


@atexit.register
def _stop_every_thread() -> None:
    for handle in list(_RUNNING):
        handle._stop()


class _AsyncHandle(Driver):
    what = "AsyncModelAverageAlgorithm"

    def __init__(self, algorithm: "AsyncModelAverageAlgorithm", module, optimizers, comm):
        self.module, self.comm = module, comm
        self.params = tuple(float32_cpu_trainable(module))
        self.interval_s = algorithm.sync_interval_ms / 1000.0
        self.warmup_steps = algorithm.warmup_steps
        self.step = 0              # steps of the first optimizer (Bagua's counter)
        self.aborted = False
        self.rounds_before = 0     # rounds of the threads stopped so far
        self.averager = None       # the background thread's engine while it runs
        self._warmup = None        # DataParallel during the warm-up
        self._locked = False
        self._restart = False      # fault-tolerant mode: start the thread at the next forward
        if not optimizers and self.warmup_steps:
            raise ValueError(f"optimizers: the warm-up ({self.warmup_steps} steps) counts the "
                             "steps of the first optimizer; pass it to with_bagua")
        self._claim(module, communicator(comm))
        self._handles = [opt.register_step_post_hook(self._after_step) for opt in optimizers]
        self._counting = optimizers[0] if optimizers else None
        if fault_tolerant_mode.joining():
            # A replacement (recover(replace=True)): rank 0's step count, as
            # the survivors' _continue_on sends it; past the warm-up its
            # thread starts with theirs, at the next training forward.
            self.step = communicator(comm).mpi.bcast(None, root=0)
            self._restart = self.step >= self.warmup_steps
        if not self._restart:
            self._begin()

    @property
    def rounds(self) -> int:
        """Averaging rounds completed since the algorithm was attached."""
        return self.rounds_before + (self.averager.rounds if self.averager is not None else 0)

    def _begin(self) -> None:
        """The warm-up until warmup_steps steps, then the thread (unless aborted)."""
        if self.step < self.warmup_steps:
            if self._warmup is None:
                with self._building_parts():
                    self._warmup = DataParallel(self.module, self.comm,
                                                blocking_parameter_updates=True)
            return
        if self._warmup is not None:
            self._warmup.synchronize()
            self._warmup.remove_hooks()
            self._warmup = None
        if not self.aborted and self.averager is None:
            self.averager = _C.BackgroundAverager(resolve_comm(self.comm),
                                                  tuple(p.detach() for p in self.params),
                                                  self.interval_s)
            self._storage = [p.data_ptr() for p in self.params]
            _RUNNING.add(self)

    def _stop(self) -> None:
        if self.averager is None:
            return
        averager, self.averager = self.averager, None
        _RUNNING.discard(self)
        if self._locked:                 # the thread may be waiting for the lock
            self._locked = False
            averager.unlock()
        averager.stop()                  # raises the thread's failure, if any
        self.rounds_before += averager.rounds
        if check_every():
            self._check_rounds(averager.rounds)

    def _continue_on(self, comm) -> None:
        """Fault-tolerant mode: the thread's rounds are agreed (mpidp/bgavg.h),
        so a round a rank's death cut short was applied by no survivor, and
        every survivor's thread ended at that round with the loss. The thread
        starts again over the survivors (in the warm-up, its DataParallel goes
        on by its own rule); each survivor keeps its weights and its step
        count, and the lost rank's weights leave with it. Where replacements
        joined, each starts from rank 0's weights (with_bagua's set-up) and
        step count, its weights adding to the ones averaged from then on."""
        self._leave_old_world()
        self.comm = comm
        handle = communicator(comm)
        self._claim(self.module, handle)     # found again at the next loss
        if fault_tolerant_mode.growing():    # as a replacement's construction takes it
            handle.mpi.bcast(self.step if handle.mpi.Get_rank() == 0 else None, root=0)
        if self._warmup is not None:
            self._warmup._continue_on(comm)
        # The thread starts again at the next training forward, which every
        # rank makes (an evaluation may run on one rank only); not inside
        # recover(), where its rounds would run beside the other survivors'
        # rebuild (seen to garble a pickled allgather of the rebuild's, 1 job
        # in 5, Open MPI 5.0 with ULFM).
        self._restart = True

    def _leave_old_world(self) -> None:
        """The thread, which ended with the loss, joined: its failure is
        raised here (and revokes the old communicators), not after the
        set-up over the survivors (with_bagua's, where replacements join)."""
        averager, self.averager = self.averager, None
        if averager is None:
            return
        _RUNNING.discard(self)
        if self._locked:                 # the cut-short step's forward took the lock
            self._locked = False
            averager.unlock()
        try:
            averager.stop()
        except _C.CommError:             # the loss it ended with (RanksLost)
            pass
        self.rounds_before += averager.rounds

    def _takes_replacements(self) -> bool:
        return True    # _continue_on sends the step count a replacement's construction takes

    def _check_rounds(self, rounds: int) -> None:
        """MPIDP_CHECK: every rank's thread took part in the same rounds."""
        (least, most), = ranks_range(resolve_comm(self.comm), rounds)
        if least != most:
            raise RuntimeError(f"AsyncModelAverageAlgorithm: the ranks' background threads "
                               f"completed between {int(least)} and {int(most)} "
                               "averaging rounds, which must be equal (MPIDP_CHECK)")

    def train_forward(self, *inputs, **kwargs):
        self._check_attached()
        if self._restart and self.module.training and torch.is_grad_enabled():
            self._restart = False
            self._begin()
        if self._warmup is not None:
            return self._warmup(*inputs, **kwargs)
        if self.averager is None or self._locked:
            return self.module(*inputs, **kwargs)
        self.averager.lock()
        if [p.data_ptr() for p in self.params] != self._storage:
            self.averager.unlock()
            raise RuntimeError("AsyncModelAverageAlgorithm: a parameter's storage was replaced "
                               "(p.data = ...?) while the background thread averages the old "
                               "one; change parameters in place (p.copy_(...)), or call "
                               "abort(model) before and resume(model) after on every rank")
        if self.module.training and torch.is_grad_enabled():
            self._locked = True          # until the optimizer's step
            return self.module(*inputs, **kwargs)
        try:                             # evaluation: a forward that sees no half-average
            return self.module(*inputs, **kwargs)
        finally:
            self.averager.unlock()

    def _after_step(self, optimizer, _args, _kwargs) -> None:
        if self._locked:
            self._locked = False
            self.averager.unlock()
        if optimizer is self._counting:
            self.step += 1
            if self._warmup is None:
                # Fault-tolerant mode: a rank's own step stands (nothing is
                # agreed: the ranks train apart), so steps_committed() goes on
                # from it. (In the warm-up, DataParallel's step end counts it.)
                fault_tolerant_mode.commit_step()
            elif self.step >= self.warmup_steps:
                self._begin()
        if self.averager is not None:
            self.averager.check()        # the thread's failure, in the training thread

    def abort(self) -> None:
        self.aborted = True
        self._stop()

    def resume(self) -> None:
        self.aborted = False
        self._begin()

    def drain(self) -> None:
        self._stop()                     # a switch: the weights stop moving

    def _remove_hooks(self) -> None:
        if self._warmup is not None:
            self._warmup.remove_hooks()
            self._warmup = None
        remove_handles(self._handles)

    def algorithm_state(self) -> Dict[str, Any]:
        return {"step": self.step, "aborted": self.aborted}

    def load_algorithm_state(self, state: Dict[str, Any]) -> None:
        """Collective (it stops and restarts the thread on every rank)."""
        if set(state) != {"step", "aborted"}:
            raise ValueError(f"state: expected the keys ['aborted', 'step'], got {sorted(state)}")
        step = check_int("state['step']", state["step"], 0)
        aborted = check_bool("state['aborted']", state["aborted"])
        self._stop()
        self.step, self.aborted = step, aborted
        self._begin()


class AsyncModelAverageAlgorithm(Algorithm):
    """Weights averaged over all ranks by a background thread every
    sync_interval_ms while training goes on (see the module's docstring);
    gradients averaged for the first warmup_steps steps.

    peer_selection_mode: "all" (Bagua's only mode: every rank averages with
    every rank)."""

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500,
                 warmup_steps: int = 0):
        self.peer_selection_mode = check_choice("peer_selection_mode", peer_selection_mode,
                                                ("all",))
        self.sync_interval_ms = check_int("sync_interval_ms", sync_interval_ms, 0)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)

    def attach(self, module, optimizers, comm):
        return _AsyncHandle(self, module, optimizers, comm)

    def _handle_of(self, model) -> _AsyncHandle:
        handle = getattr(model, "bagua_driver", None)
        if not isinstance(handle, _AsyncHandle) or getattr(model, "bagua_algorithm", None) is not self:
            raise ValueError("model: expected the module that mpidp.with_bagua returned for this "
                             f"algorithm, got {type(model).__name__}"
                             + ("" if handle is None else " trained with another algorithm"))
        return handle

    def abort(self, model) -> None:
        """Stop averaging `model` (every rank calls it; the threads stop at the
        same round). Training goes on, each rank on its own."""
        self._handle_of(model).abort()

    def resume(self, model) -> None:
        """Start averaging `model` again after abort() (every rank calls it)."""
        self._handle_of(model).resume()
