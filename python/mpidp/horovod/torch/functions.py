"""Horovod's state broadcasts: broadcast_parameters, broadcast_optimizer_state,
broadcast_object, allgather_object."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

try:   # Horovod's serializer (lambdas, local classes); the standard one otherwise
    import cloudpickle as _pickle
except ImportError:
    import pickle as _pickle

from .. import _basics
from .._basics import global_process_set
from . import mpi_ops

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


def broadcast_parameters(params, root_rank, process_set=global_process_set) -> None:
    """Make every rank's tensors root_rank's, in place: `params` is a dict
    (model.state_dict(); sorted by key) or a list of tensors or of
    (name, tensor) pairs (model.named_parameters()). A generator is refused,
    as Horovod does: its order cannot be trusted to match."""
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError("invalid params of type: %s (expected a dict or a list, e.g. "
                         "model.state_dict() or list(model.named_parameters()))" % type(params))
    tensors = []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params: entry {name!r} is a {type(p).__name__}, not a tensor")
        tensors.append(p.data if isinstance(p, torch.nn.Parameter) else p)
    handles = [mpi_ops.broadcast_async_(t, root_rank, name=None if name is None else
                                        f"broadcast_parameters.{name}", process_set=process_set)
               for (name, _), t in zip(items, tensors)]
    for h in handles:
        mpi_ops.synchronize(h)


def broadcast_object(obj: Any, root_rank: int = 0, name=None,
                     process_set=global_process_set) -> Any:
    """root_rank's `obj` (serialized with cloudpickle where installed, else
    pickle) on every rank."""
    name = name or type(obj).__name__
    if _basics.rank() == root_rank:
        payload = torch.frombuffer(bytearray(_pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        payload, size = None, torch.zeros(1, dtype=torch.int64)
    mpi_ops.broadcast_(size, root_rank, name=f"{name}.sz", process_set=process_set)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    mpi_ops.broadcast_(payload, root_rank, name=f"{name}.t", process_set=process_set)
    if _basics.rank() == root_rank:
        return obj
    return _pickle.loads(payload.numpy().tobytes())


def allgather_object(obj: Any, name=None, process_set=global_process_set) -> list:
    """Every rank's `obj`, in rank order."""
    name = name or type(obj).__name__
    payload = torch.frombuffer(bytearray(_pickle.dumps(obj)), dtype=torch.uint8)
    sizes = mpi_ops.allgather(torch.tensor([payload.numel()]), name=f"{name}.sz",
                              process_set=process_set)
    data = mpi_ops.allgather(payload, name=f"{name}.t", process_set=process_set)
    out, at = [], 0
    raw = data.numpy().tobytes()
    for n in sizes.tolist():
        out.append(_pickle.loads(raw[at:at + n]))
        at += n
    return out


def broadcast_optimizer_state(optimizer, root_rank, model=None,
                              process_set=global_process_set) -> None:
    """Make every rank's optimizer state and hyperparameters root_rank's:
    root's whole state_dict travels as one object and is loaded elsewhere.

    Unlike Horovod, no zero-gradient step first creates the state of an
    optimizer that has none (that step moves parameters by weight decay and
    leaves momentum behind): a root without state gives every rank none.
    What that step leaves that programs read is kept: every parameter that
    requires a gradient and has none gets a zero one, as Horovod's. `model`
    is accepted for Horovod's signature. LBFGS is refused."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch optimizer, got {type(optimizer).__name__}")
    state = broadcast_object(optimizer.state_dict() if _basics.rank() == root_rank else None,
                             root_rank, name="broadcast_optimizer_state",
                             process_set=process_set)
    if _basics.rank() != root_rank:
        optimizer.load_state_dict(state)
    if not state["state"]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
