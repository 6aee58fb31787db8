"""Non-blocking DataParallel's deferred optimizer step, and its one owner.

In non-blocking mode `optimizer.step()` only records that a step is due;
the next forward applies it layer by layer, each bucket's averaged
gradients delivered and the optimizer stepped on that bucket's parameters
just before the first layer that owns one of them runs (forward pre-hooks),
so the averaging overlaps the forward. This object holds everything about
that step -- which optimizer is due and with which hyperparameters, whether
this forward is applying it, whether DataParallel's own step is running,
and how the reads of parameters are watched -- and the reducer's pass (the
core: what each `.grad` becomes) is asked for each bucket's part.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Sequence

from .._runtime import fault_tolerant_mode
from .apply_on_read import set_pending

__all__ = ["DeferredStep", "bucket_members"]


class DeferredStep:
    """The deferred step of one non-blocking DataParallel. `bucket_params`:
    each bucket's indices into `params`; `watched`: the modules' parameter
    dicts that make a read apply the pending update (apply_on_read.py);
    `agreement_comm()`: the mpi4py communicator whose ranks agree on a step's
    end in fault-tolerant mode (the wrapper's Driver._agreement_comm)."""

    def __init__(self, reducer, params: Sequence, bucket_params: Sequence[Sequence[int]],
                 watched: List, device_resident: bool = False,
                 agreement_comm: Callable[[], Any] = lambda: None):
        self.reducer = reducer
        self.agreement_comm = agreement_comm
        self.params = params
        self.bucket_params = bucket_params
        self.watched = watched
        self.backwards_at_step = 0  # the reducer's backward count at the last step() (both modes)
        self.optimizer = None       # the DataParallelOptimizer whose step is due, else None
        self.applying = False       # this forward applies it
        self.stepping = False       # DataParallel's own delivery and step are running
        self.reads_checked = False  # the first applying forward watched the reads
        # Applied whole at the start of each forward: where a parameter is read
        # before its layer (found by the first applying forward), and where
        # buckets are summed on the device, whose waits are the GPU's (each
        # layer's hook would only add host work: the first layers' bucket is
        # the last one summed, so the forward waits for every sum anyway).
        self.apply_all_first = device_resident
        self._together = device_resident  # ... with one optimizer step for all buckets
        self._hyper = None          # the optimizer's hyperparameters when step() was called
        self._subsets: List = []    # per bucket, per group: the group's parameters in it
        self._subset_sig = None     # the optimizer's groups _subsets were built for

    @property
    def due(self) -> bool:
        return self.optimizer is not None

    def schedule(self, optimizer) -> None:
        """optimizer.step() was called: the step is due, with the
        hyperparameters it has now (a scheduler may change them before the
        next forward)."""
        groups = optimizer.torch_optimizer.param_groups
        self._hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self.optimizer = optimizer
        set_pending(self.watched, True)

    def begin(self) -> bool:
        """At a forward after a finished backward: start applying the step if
        one is due; False when none is. In fault-tolerant mode the step's end
        is here: every bucket's averaging is waited for and every rank agrees
        before any of it is applied (RanksLost otherwise, the step applied
        nowhere), so this step forgoes the overlap with the forward."""
        if self.optimizer is not None and not self.applying:
            if fault_tolerant_mode.enabled():
                for b in range(self.reducer.n_buckets):
                    self.reducer.wait_bucket(b)
                fault_tolerant_mode.step_boundary(self.agreement_comm())
            self.applying = True
        return self.applying

    @contextlib.contextmanager
    def own_step(self):
        """Marks what runs inside as DataParallel's own delivering and
        stepping (hooks that guard against the user's direct steps and reads
        let it through); nests."""
        before, self.stepping = self.stepping, True
        try:
            yield
        finally:
            self.stepping = before

    @contextlib.contextmanager
    def reads_unwatched(self):
        """Code that reads no parameter values (zero_grad) runs without
        applying the update."""
        due = self.due
        set_pending(self.watched, False)
        try:
            yield
        finally:
            if due and self.due:
                set_pending(self.watched, True)

    def apply_all(self) -> None:
        if self._together and self.applying:
            self._apply_together()
            return
        self.apply(range(self.reducer.n_buckets))

    def _apply_together(self) -> None:
        """The whole step at once: every bucket's mean delivered, one
        optimizer step over every bucket's parameters (per-parameter state
        ends as bucket by bucket), then every bucket's .grad as the user left
        them; the last ends the pass."""
        reducer = self.reducer
        todo = [b for b in range(reducer.n_buckets) if not reducer.stepped(b)]
        with self.own_step():
            for b in todo:
                reducer.deliver_for_step(b)
            self._step_buckets(todo)
            for b in todo:
                reducer.after_step(b)
        self.applying = False
        self.optimizer = None
        set_pending(self.watched, False)

    def apply(self, buckets) -> None:
        """Applies the step to `buckets` (those not applied yet) while this
        forward applies it; the last bucket ends the step."""
        if not self.applying:
            return
        reducer = self.reducer
        for b in buckets:
            if reducer.stepped(b):
                continue
            with self.own_step():
                reducer.deliver_for_step(b)
                self._step_bucket(b)
                reducer.after_step(b)
            if not reducer.finalized:
                break
        if not reducer.finalized:  # the last bucket's after_step ended the pass
            self.applying = False
            self.optimizer = None
            set_pending(self.watched, False)

    def _step_bucket(self, b: int) -> None:
        self._step_buckets([b])

    def _step_buckets(self, buckets: Sequence[int]) -> None:
        """Steps the optimizer on `buckets`' parameters only, with the
        hyperparameters it had when step() was called. Per-parameter state
        (momentum, Adam moments, step counts) ends exactly as a full step
        leaves it."""
        opt = self.optimizer.torch_optimizer
        groups = opt.param_groups
        sig = tuple(id(g["params"]) for g in groups) + tuple(len(g["params"]) for g in groups)
        if sig != self._subset_sig:
            self._subsets = []
            for members in self.bucket_params:
                wanted = {id(self.params[i]) for i in members}
                self._subsets.append([[p for p in g["params"] if id(p) in wanted] for g in groups])
            self._subset_sig = sig
        saved = [(g["params"], {k: v for k, v in g.items() if k != "params"}) for g in groups]
        try:
            for k, (g, hyper) in enumerate(zip(groups, self._hyper)):
                g.update(hyper)
                g["params"] = [p for b in buckets for p in self._subsets[b][k]]
            with self.own_step():
                opt.step()
        finally:
            for g, (params, current) in zip(groups, saved):
                g["params"] = params
                g.update(current)


def bucket_members(param_bucket: Sequence[int], n_buckets: int) -> List[tuple]:
    """Each bucket's parameter indices, from each parameter's bucket."""
    members: List[list] = [[] for _ in range(n_buckets)]
    for i, b in enumerate(param_bucket):
        members[b].append(i)
    return [tuple(m) for m in members]


