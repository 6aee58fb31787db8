"""Finding parameters that non-blocking DataParallel would hand out stale.

Non-blocking mode applies the pending update of a bucket just before the
first layer that owns one of its parameters runs (forward pre-hooks). A
parameter read elsewhere first -- weight tying through a functional call
(`F.linear(x, self.emb.weight)`), a parameter used by a module that is not its
owner -- would be read one step stale. The first forward that applies an
update watches every torch call (a TorchFunctionMode, that forward only): a
parameter whose bucket is not applied yet makes it apply the whole update on
the spot, and DataParallel applies the whole update at the start of every
later forward (correct, with less overlap), saying so once."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class StaleReadDetector(TorchFunctionMode):
    """Within `with StaleReadDetector(deferred, bucket_of, names) as d:` the
    first read of a parameter whose bucket is still pending applies every
    bucket of `deferred` (the wrapper's DeferredStep); d.found is then that
    parameter's name."""

    def __init__(self, deferred, bucket_of: dict, names: dict):
        super().__init__()
        self._deferred = deferred
        self._bucket_of = bucket_of    # id(parameter) -> bucket
        self._names = names            # id(parameter) -> name
        self.found = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # DataParallel's own delivery and step (from a layer's pre-hook) read
        # parameters too, and attribute access (p.grad) is no use of the values.
        if (self.found is None and not self._deferred.stepping
                and getattr(func, "__name__", "") not in ("__get__", "__set__")):
            reducer = self._deferred.reducer
            for arg in _tensors(args, kwargs):
                b = self._bucket_of.get(id(arg))
                if b is not None and reducer.finalized and not reducer.stepped(b):
                    self.found = self._names[id(arg)]
                    # The mode is off inside this handler: the optimizer's ops run plainly.
                    self._deferred.apply_all()
                    break
        return func(*args, **kwargs)


def _tensors(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))
