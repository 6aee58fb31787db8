"""Optimizer settings and loaded state that the ranks do not share.

Under averaged gradients the ranks' models stay equal only while their
optimizers hold the same settings and state. Two habits break that with no
error under torch DDP:

- A checkpoint loaded on one rank only (Horovod's habit, without its
  broadcast) leaves that rank's parameters or optimizer state different.
  load_state_dict calls on the wrapped module (any submodule) and the
  optimizers are counted on each rank; every training forward adds the counts
  over the ranks (a small allreduce, posted at one forward and read at the
  next, so it costs no extra synchronisation; the first one is waited for at
  once). When the total moved, some rank loaded something: the ranks compare
  fingerprints of what must be shared and raise the same error on every rank,
  naming the ranks that differ from rank 0 and the fix.
- Optimizer settings that differ: an LR scheduler stepped on some ranks only,
  ReduceLROnPlateau given each rank's own validation loss, an lr scaled by
  the rank. The same allreduce carries a 20-bit hash h of the numbers in the
  optimizers' param groups, as h and h squared: the ranks' hashes are all
  equal exactly when n * sum(h^2) == sum(h)^2, which every rank reads alike;
  only then are the settings exchanged to name the first difference.

Optimizers the wrapper was not given (torch DDP's pattern: DataParallel(model)
and a plain torch optimizer stepped directly) join the watch at their first
step that updates a wrapped parameter (torch's global step pre-hook). Joining
counts as a load, so an optimizer state loaded on one rank before the first
step is found as well. Only the state and settings of the param groups that
hold wrapped parameters are compared: an optimizer of a local model may
differ."""

from __future__ import annotations

import functools
import weakref
from typing import Callable, List, Set

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _C
from . import module_hooks
from .._runtime.model_consistency import (numbers_of, ranks_differing, refuse_different_settings,
                                    settings_hash)
from .._runtime.hook_handles import remove_handles
__all__ = ["LoadWatch"]


def _count_load(watch_ref, *_args) -> None:
    watch = watch_ref()
    if watch is not None:
        watch._count += 1


# The watches that look for optimizers they were not given.
_FOLLOWING: "weakref.WeakSet[LoadWatch]" = weakref.WeakSet()


def _saw_optimizer_step(optimizer, _args, _kwargs) -> None:
    for watch in list(_FOLLOWING):
        watch._saw(optimizer)


register_optimizer_step_pre_hook(_saw_optimizer_step)


class LoadWatch:
    def __init__(self, comm: "_C.Comm", who: str, params):
        self._comm = comm
        self._who = who
        self._params: Set[int] = {id(p) for p in params}  # the wrapped parameters
        self._count = 0          # loads (and optimizers joining) seen on this rank
        self._total = 0.0        # the sum over the ranks at the last comparison
        self._work = None
        self._buf = None
        # The optimizers watched, in the order they joined (the same on every
        # rank), each with the handle of its load hook; and those seen that
        # update no wrapped parameter.
        self._optimizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._unrelated: "weakref.WeakSet" = weakref.WeakSet()
        self._hash_mask = (1 << max(8, min(20, (52 - comm.size.bit_length()) // 2))) - 1
        # Called with each watched optimizer before its step (the wrapper's
        # checks of what the step will update); None: nothing.
        self.on_step: Callable | None = None

    def install(self, modules, optimizers) -> list:
        """Counts load_state_dict on every module (a submodule's own
        load_state_dict counts too) and on `optimizers`, and from now on on
        the optimizers that join; returns the handles. The hooks hold the
        watch weakly, so that models stay deep-copyable."""
        handles = [module_hooks.register(m, "register_load_state_dict_post_hook",
                                         self._load_hook()) for m in modules]
        for opt in optimizers:
            self._join(opt)
        _FOLLOWING.add(self)
        return handles + [_Watching(self)]

    def _load_hook(self):
        return functools.partial(_count_load, weakref.ref(self))

    def _join(self, optimizer) -> None:
        self._optimizers[optimizer] = optimizer.register_load_state_dict_post_hook(
            self._load_hook())
        self._count += 1     # its state joins the comparison: compare once now

    def _saw(self, optimizer) -> None:
        if optimizer in self._unrelated:
            return
        if optimizer not in self._optimizers:
            if not any(id(p) in self._params for g in optimizer.param_groups for p in g["params"]):
                self._unrelated.add(optimizer)
                return
            self._join(optimizer)
        if self.on_step is not None:
            self.on_step(optimizer)

    def _groups(self):
        """(optimizer index, group index, optimizer, group) of the param
        groups that hold wrapped parameters."""
        for i, opt in enumerate(list(self._optimizers.keys())):
            for j, group in enumerate(opt.param_groups):
                if any(id(p) in self._params for p in group["params"]):
                    yield i, j, opt, group

    def optimizer_state(self) -> List[torch.Tensor]:
        """The watched optimizers' state for the wrapped parameters, as
        tensors: each parameter's state tensors in order, and one tensor of
        the numbers (settings, step counts kept as numbers)."""
        tensors, numbers = [], []
        for _, _, opt, group in self._groups():
            numbers += [v for _, v in numbers_of(group)]
            for p in group["params"]:
                if id(p) in self._params:
                    state = opt.state.get(p, {})
                    tensors += [v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
                    numbers += [v for _, v in numbers_of(state)]
        return tensors + [torch.tensor(numbers or [0.0], dtype=torch.float64)]

    def _settings(self) -> list:
        """(name, number) of the watched param groups' settings (for messages:
        the per-forward hash takes the numbers alone, unnamed)."""
        return [(f"optimizer {i}, param group {j}: {k}", v)
                for i, j, _, group in self._groups() for k, v in numbers_of(group)]

    def check(self, shared: Callable[[], list], fix: str) -> None:
        """At a point every rank reaches (a training forward). `shared`: the
        wrapper's own tensors that every rank must hold alike."""
        if self._comm.size == 1:
            return
        if self._work is None:           # the first time: compare right away
            self._post()
        self._work.wait()
        total, s1, s2 = (int(v) for v in self._buf.tolist())
        if self._comm.size * s2 != s1 * s1:
            refuse_different_settings(self._comm, self._who, self._settings())
        self._post()
        if total == self._total:
            return
        self._total = total
        differ = ranks_differing(self._comm, shared() + self.optimizer_state())
        if differ:
            # The likelier cause, named when it is the one.
            refuse_different_settings(self._comm, self._who, self._settings())
            raise RuntimeError(
                f"{self._who}: after load_state_dict the ranks hold different state: rank(s) "
                f"{differ} differ from rank 0, so they would train different models. Load the "
                f"same checkpoint on every rank, or load it on one and call {fix} on every rank "
                "(Horovod's pattern)")

    def _post(self) -> None:
        values = [v for _, _, _, group in self._groups() for _, v in numbers_of(group)]
        h = settings_hash(values) & self._hash_mask
        self._buf = torch.tensor([float(self._count), float(h), float(h * h)], dtype=torch.float64)
        self._work = self._comm.allreduce(self._buf, _C.OP_SUM, _C.NO_WIRE, True)


class _Watching:
    """The handle of LoadWatch.install: remove() stops joining optimizers and
    takes the optimizers' load hooks off."""

    def __init__(self, watch: LoadWatch):
        self._watch = weakref.ref(watch)

    def remove(self) -> None:
        watch = self._watch()
        if watch is None:
            return
        _FOLLOWING.discard(watch)
        remove_handles(list(watch._optimizers.values()))
        watch._optimizers.clear()
