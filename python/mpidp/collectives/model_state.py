"""Horovod's broadcasts: make every rank's parameters or optimizer state rank
`root`'s, for a checkpoint loaded on one rank (or any state that must start
equal). Every rank of `comm` calls them; waits have MPIDP_TIMEOUT deadlines."""

from __future__ import annotations

import io
from collections.abc import Mapping

import torch

from .._runtime.argument_agreement import agree, crc_of
from .tensors import check_root
from .._runtime.mpi import resolve_comm
from .._runtime.state_broadcast import broadcast_tensors
__all__ = ["broadcast_parameters", "broadcast_optimizer_state"]


def broadcast_parameters(params, root: int = 0, comm=None) -> None:
    """Copy rank `root`'s values into every rank's tensors, in place.

    params: a torch.nn.Module (its parameters and buffers), a state_dict
    (name -> tensor), or an iterable of tensors or of (name, tensor) pairs
    (Horovod's `model.named_parameters()`). Tensors of any dtype and device
    travel in one message per device.

    comm: the ranks taking part (an mpi4py communicator or MPICommunication;
    None: every rank)."""
    c_comm = resolve_comm(comm)
    root = check_root(root, c_comm)
    if isinstance(params, torch.nn.Module):
        tensors = list(params.parameters()) + list(params.buffers())
    elif isinstance(params, Mapping):
        tensors = list(params.values())
    else:
        try:
            items = list(params)
        except TypeError:
            raise TypeError("params: expected a torch.nn.Module, a state_dict or an iterable of "
                            f"tensors, got {type(params).__name__}") from None
        tensors = [t[1] if isinstance(t, tuple) and len(t) == 2 else t for t in items]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"params: entry {i} is a {type(t).__name__}, not a tensor")
    # The tensors travel packed: every rank must pack the same layout.
    layout = crc_of((t.dtype, tuple(t.shape)) for t in tensors)
    agree(c_comm, "broadcast_parameters", torch.empty(len(tensors)), root=root, layout=layout)
    with torch.no_grad():
        broadcast_tensors(tensors, c_comm, root)


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """A torch optimizer, or DASO's local one."""
    inner = getattr(optimizer, "local_optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TypeError("optimizer: expected a torch optimizer, a mpidp.DataParallelOptimizer or a "
                    f"mpidp.DASO, got {type(optimizer).__name__}")


def broadcast_optimizer_state(optimizer, root: int = 0, comm=None) -> None:
    """Make every rank's optimizer state (moments, step counts, and the
    hyperparameters of its param_groups) rank `root`'s: root's state_dict()
    is serialised, broadcast and loaded with load_state_dict() on the others
    (which moves it to the parameters' devices).

    comm: the ranks taking part (an mpi4py communicator or MPICommunication;
    None: every rank)."""
    c_comm = resolve_comm(comm)
    root = check_root(root, c_comm)
    # A DataParallelOptimizer's own state_dict/load_state_dict finish a pending update first
    # (known by its wrapped .torch_optimizer: this layer sits below the algorithms).
    wraps = isinstance(getattr(optimizer, "torch_optimizer", None), torch.optim.Optimizer)
    target = optimizer if wraps else _torch_optimizer(optimizer)
    if c_comm.size == 1:
        return
    size = torch.zeros(1, dtype=torch.int64)
    payload = None
    if c_comm.rank == root:
        buf = io.BytesIO()
        torch.save(target.state_dict(), buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size[0] = payload.numel()
    c_comm.bcast(size, root)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    c_comm.bcast(payload, root)
    if c_comm.rank != root:
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu",
                           weights_only=True)
        target.load_state_dict(state)
