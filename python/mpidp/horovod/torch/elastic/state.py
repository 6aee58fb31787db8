"""Horovod's elastic state: what is rolled back to the last commit and
synced from rank 0 after a rank was lost."""

from __future__ import annotations

import copy

import torch

from ..functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                         broadcast_parameters)
from .sampler import ElasticSampler

__all__ = ["State", "ObjectState", "TorchState"]


class State:
    """Base: commit() = save() + check_host_updates(); restore(); sync();
    register_reset_callbacks()."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called (no arguments) after each reset, before sync():
        e.g. to scale the learning rate by the new hvd.size()."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state: a lost rank rolls every survivor back to here."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod checks for added hosts here; mpidp's elastic mode only
        loses ranks (ULFM reports those as errors), so nothing to check."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain values as attributes (state.epoch), broadcast from rank 0."""

    def __init__(self, **kwargs):
        super().__init__()
        self._values = dict(kwargs)
        self._saved = copy.deepcopy(self._values)

    def __getattr__(self, name):
        values = self.__dict__.get("_values")
        if values is not None and name in values:
            return values[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name.startswith("_") or "_values" not in self.__dict__ or name not in self._values:
            object.__setattr__(self, name, value)
        else:
            self._values[name] = value

    def save(self) -> None:
        self._saved = copy.deepcopy(self._values)

    def restore(self) -> None:
        self._values.update(copy.deepcopy(self._saved))

    def sync(self) -> None:
        if self._values:
            self._values.update(broadcast_object(self._values, 0, name="ObjectState"))
        self.save()


class TorchState(ObjectState):
    """The model's parameters and buffers, the optimizer's state, every
    ElasticSampler given (their processed samples: the union over the
    ranks) and plain values."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        plain = {k: v for k, v in kwargs.items() if k not in samplers}
        super().__init__(**plain)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "_samplers", samplers)
        for k, v in samplers.items():
            object.__setattr__(self, k, v)
        self._save_torch()

    def _save_torch(self) -> None:
        self._saved_model = (None if self.model is None else
                             copy.deepcopy(self.model.state_dict()))
        self._saved_optimizer = (None if self.optimizer is None else
                                 copy.deepcopy(self.optimizer.state_dict()))
        self._saved_samplers = {k: s.state_dict() for k, s in self._samplers.items()}

    def save(self) -> None:
        super().save()
        self._save_torch()

    def restore(self) -> None:
        super().restore()
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        for k, s in self._samplers.items():
            s.load_state_dict(self._saved_samplers[k])

    def sync(self) -> None:
        if self.model is not None:
            with torch.no_grad():
                broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for k, s in self._samplers.items():
            mine = s.state_dict()
            everyone = allgather_object(mine["processed_indices"], name=f"sampler.{k}")
            epoch = broadcast_object(mine["epoch"], 0, name=f"sampler.{k}.epoch")
            s.load_state_dict({"epoch": epoch,
                               "processed_indices": sorted(set().union(*map(set, everyone)))})
        super().sync()
