"""What an optimizer step changes, kept so that the step can be undone.

Fault-tolerant DASO (algorithms/daso.py) applies its local step before the schedule's
syncs, and undoes the whole step when a rank is lost in it. Keeping a copy
per step must cost little next to the step: the parameters and every tensor
of the optimizer's per-parameter state are copied into buffers kept from
step to step, in one fused copy, by a plan made again only when the
parameters or the state's objects change (a deep copy of the state_dict
walks and allocates every tensor each time)."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch


class StepUndo:
    def __init__(self):
        self._buffers: Dict[tuple, torch.Tensor] = {}
        self._key = None                     # what the plan below was made for
        self._params: List[tuple] = []       # (parameter, its copy)
        self._state: Dict[torch.Tensor, dict] = {}
        self._sources: List[torch.Tensor] = []
        self._copies: List[torch.Tensor] = []
        self._groups: List[dict] = []

    def _buffer(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype \
                or buf.device != like.device:
            buf = self._buffers[key] = torch.empty_like(like)
        return buf

    def _plan(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Which tensor goes into which buffer (non-tensor state is kept as it is)."""
        self._params = [(p, self._buffer(("param", i), p)) for i, p in enumerate(params)]
        self._sources = [p for p, _ in self._params]
        self._copies = [buf for _, buf in self._params]
        self._state = {}
        for j, (p, state) in enumerate(optimizer.state.items()):
            kept = {}
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    kept[k] = self._buffer(("state", j, k), v)
                    self._sources.append(v)
                    self._copies.append(kept[k])
                else:
                    kept[k] = v
            self._state[p] = kept

    def save(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Keep the parameters' values and the optimizer's state and
        hyperparameters as they are now."""
        # The plan holds the objects it was made for, so their ids cannot be
        # reused: the same ids mean the same parameters and state objects
        # (and, for numbers in the state, the same values).
        key = (tuple(map(id, params)), tuple(map(id, optimizer.state)),
               tuple(id(v) for state in optimizer.state.values() for v in state.values()))
        if key != self._key:
            self._plan(params, optimizer)
            self._key = key
        if self._sources:
            with torch.no_grad():
                torch._foreach_copy_(self._copies, self._sources)
        self._groups = [{k: v for k, v in g.items() if k != "params"}
                        for g in optimizer.param_groups]

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put back what save() kept: state the step created is dropped."""
        with torch.no_grad():
            for p, buf in self._params:
                p.copy_(buf)
        for p in [p for p in optimizer.state if p not in self._state]:
            del optimizer.state[p]
        for p, kept in self._state.items():
            state = optimizer.state[p]
            for k in [k for k in state if k not in kept]:
                del state[k]
            for k, v in kept.items():
                if not isinstance(v, torch.Tensor):
                    state[k] = v
                elif isinstance(state.get(k), torch.Tensor) and state[k].shape == v.shape:
                    state[k].copy_(v)
                else:
                    state[k] = v.clone()
        for group, hyper in zip(optimizer.param_groups, self._groups):
            group.update(hyper)
