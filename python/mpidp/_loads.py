"""Loaded state that the ranks do not share.

A checkpoint loaded on one rank only (Horovod's habit, without its broadcast)
leaves that rank's parameters or optimizer state different from the others',
and data-parallel training then quietly trains different models. DataParallel
counts load_state_dict calls on its module (any submodule) and optimizers, on
each rank; every training forward adds the counts over the ranks (a one-value
allreduce, posted at one forward and read at the next, so it costs no extra
synchronisation; the first one is waited for at once). When the total moved,
some rank loaded something: the ranks compare fingerprints of what must be
shared and raise the same error on every rank, naming the ranks that differ
from rank 0 and the fix.

Optimizers the wrapper was not given (torch DDP's pattern: DataParallel(model)
and a plain torch optimizer stepped directly) join the watch at their first
step that updates a wrapped parameter (torch's global step pre-hook): from
then on their loads count and their state (for the wrapped parameters) is
compared too. Joining counts as a load, so an optimizer state loaded on one
rank before the first step (Horovod's pattern without its broadcast) is found
as well."""

from __future__ import annotations

import functools
import weakref
from typing import Callable, List, Optional, Set

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _C
from ._consistency import ranks_differing

__all__ = ["LoadWatch", "optimizer_fingerprint"]


def optimizer_fingerprint(opt: torch.optim.Optimizer,
                          only: Optional[Set[int]] = None) -> List[torch.Tensor]:
    """What a torch optimizer's state holds, as tensors: each parameter's state
    tensors in parameter order, and one tensor of its numbers (hyperparameters,
    step counts kept as numbers). `only`: ids of the parameters that count
    (the groups holding none of them are left out)."""
    tensors, numbers = [], []
    for group in opt.param_groups:
        if only is not None and not any(id(p) in only for p in group["params"]):
            continue
        numbers += [float(v) for k, v in sorted(group.items())
                    if k != "params" and isinstance(v, (bool, int, float))]
        for p in group["params"]:
            if only is not None and id(p) not in only:
                continue
            for k, v in sorted(opt.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    tensors.append(v)
                elif isinstance(v, (bool, int, float)):
                    numbers.append(float(v))
    return tensors + [torch.tensor(numbers or [0.0], dtype=torch.float64)]


def _count_load(watch_ref, *_args) -> None:
    watch = watch_ref()
    if watch is not None:
        watch._count += 1


# The watches that look for optimizers they were not given (follow_optimizers).
_FOLLOWING: "weakref.WeakSet[LoadWatch]" = weakref.WeakSet()


def _saw_optimizer_step(optimizer, _args, _kwargs) -> None:
    for watch in list(_FOLLOWING):
        watch._saw(optimizer)


register_optimizer_step_pre_hook(_saw_optimizer_step)


class LoadWatch:
    def __init__(self, comm: "_C.Comm", who: str):
        self._comm = comm
        self._who = who
        self._count = 0          # load_state_dict calls seen on this rank
        self._total = 0.0        # the sum over the ranks at the last comparison
        self._work = None
        self._buf = None
        self._params: Set[int] = set()   # ids of the parameters whose optimizers join
        # Optimizers stepped by the user that update those parameters, each
        # with its load hook's handle; and those seen that update none.
        self._followed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._unrelated: "weakref.WeakSet" = weakref.WeakSet()

    def hooks(self, modules, optimizers) -> list:
        """Counts load_state_dict on every module (a submodule's own
        load_state_dict counts too) and optimizer; returns the handles. The
        hooks hold the watch weakly, so that models stay deep-copyable."""
        hook = self._load_hook()
        return ([m.register_load_state_dict_post_hook(hook) for m in modules] +
                [o.register_load_state_dict_post_hook(hook) for o in optimizers])

    def _load_hook(self):
        return functools.partial(_count_load, weakref.ref(self))

    def follow_optimizers(self, params, known) -> "_Following":
        """From now on, an optimizer outside `known` whose step updates one of
        `params` joins the watch (see the module's docstring). Returns the
        handle that ends this (remove())."""
        self._params = {id(p) for p in params}
        self._unrelated.update(known)
        _FOLLOWING.add(self)
        return _Following(self)

    def _saw(self, optimizer) -> None:
        if optimizer in self._followed or optimizer in self._unrelated:
            return
        if not any(id(p) in self._params for g in optimizer.param_groups for p in g["params"]):
            self._unrelated.add(optimizer)
            return
        self._followed[optimizer] = optimizer.register_load_state_dict_post_hook(self._load_hook())
        self._count += 1     # its state joins the comparison: compare once now

    def followed_state(self) -> list:
        """The fingerprints of the joined optimizers' state for the watched parameters."""
        return [t for opt in list(self._followed.keys())
                for t in optimizer_fingerprint(opt, self._params)]

    def check(self, fingerprint: Callable[[], list], fix: str) -> None:
        """At a point every rank reaches (a training forward)."""
        if self._comm.size == 1:
            return
        if self._work is None:           # the first time: compare right away
            self._post()
        self._work.wait()
        total = float(self._buf.item())
        self._post()
        if total == self._total:
            return
        self._total = total
        differ = ranks_differing(self._comm, fingerprint())
        if differ:
            raise RuntimeError(
                f"{self._who}: after load_state_dict the ranks hold different state: rank(s) "
                f"{differ} differ from rank 0, so they would train different models. Load the "
                f"same checkpoint on every rank, or load it on one and call {fix} on every rank "
                "(Horovod's pattern)")

    def _post(self) -> None:
        self._buf = torch.tensor([float(self._count)], dtype=torch.float64)
        self._work = self._comm.allreduce(self._buf, _C.OP_SUM, _C.NO_WIRE, True)


class _Following:
    """The handle of LoadWatch.follow_optimizers: remove() stops joining
    optimizers and takes the joined ones' load hooks off."""

    def __init__(self, watch: LoadWatch):
        self._watch = weakref.ref(watch)

    def remove(self) -> None:
        watch = self._watch()
        if watch is None:
            return
        _FOLLOWING.discard(watch)
        for handle in list(watch._followed.values()):
            handle.remove()
        watch._followed.clear()
