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
from rank 0 and the fix."""

from __future__ import annotations

import functools
import weakref
from typing import Callable, List

import torch

from . import _C
from ._consistency import ranks_differing

__all__ = ["LoadWatch", "optimizer_fingerprint"]


def optimizer_fingerprint(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    """What a torch optimizer's state holds, as tensors: each parameter's state
    tensors in parameter order, and one tensor of its numbers (hyperparameters,
    step counts kept as numbers)."""
    tensors, numbers = [], []
    for group in opt.param_groups:
        numbers += [float(v) for k, v in sorted(group.items())
                    if k != "params" and isinstance(v, (bool, int, float))]
        for p in group["params"]:
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


class LoadWatch:
    def __init__(self, comm: "_C.Comm", who: str):
        self._comm = comm
        self._who = who
        self._count = 0          # load_state_dict calls seen on this rank
        self._total = 0.0        # the sum over the ranks at the last comparison
        self._work = None
        self._buf = None

    def hooks(self, modules, optimizers) -> list:
        """Counts load_state_dict on every module (a submodule's own
        load_state_dict counts too) and optimizer; returns the handles. The
        hooks hold the watch weakly, so that models stay deep-copyable."""
        hook = functools.partial(_count_load, weakref.ref(self))
        return ([m.register_load_state_dict_post_hook(hook) for m in modules] +
                [o.register_load_state_dict_post_hook(hook) for o in optimizers])

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
