"""The base of mpidp.algorithms (Bagua's API): an algorithm is its settings;
`attach(module, optimizers, comm)` builds the driver (mpidp/algorithms/driver.py) that
runs it on the module from then on. mpidp.with_bagua drives it: compare the
settings across ranks, attach, and on a switch detach the old driver (which
drains it first), set up the next from rank 0's state.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch


__all__ = ["Algorithm", "plain_setting"]

_SKIP = object()


def plain_setting(value):
    """A setting as the ranks can compare it: numbers, strings, dtypes and
    their tuples as they are, a dict item by item, anything else (optimizers,
    modules, graphs) by its type's name or not at all."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(plain_setting(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, plain_setting(v)) for k, v in sorted(value.items()))
    if isinstance(value, torch.optim.Optimizer):
        return _SKIP                 # its state may differ: rank 0's is broadcast
    return type(value).__name__


class Algorithm:
    """Base class of mpidp's Bagua algorithms."""

    def attach(self, module: torch.nn.Module, optimizers: List[torch.optim.Optimizer], comm):
        """The driver that runs this algorithm on `module` from now on
        (with_bagua calls it, after comparing shared_settings() across ranks)."""
        raise NotImplementedError

    def shared_settings(self) -> Dict[str, Any]:
        """What every rank must agree on (with_bagua compares it across
        ranks): the public attributes that are plain values."""
        return {k: plain_setting(v) for k, v in vars(self).items() if not k.startswith("_")
                and plain_setting(v) is not _SKIP}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"

