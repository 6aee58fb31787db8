"""Tensor collectives on MPI communicators: `mpidp.allreduce`."""

from __future__ import annotations

import torch

from . import _C
from ._dtypes import wire_code
from ._mpi import resolve_comm

__all__ = ["allreduce", "Work"]

Work = _C.Work

_OPS = {"sum": _C.OP_SUM, "avg": _C.OP_AVG}


def allreduce(tensor: torch.Tensor, op: str = "sum", comm=None, wire_dtype=None,
              async_op: bool = False):
    """Reduce `tensor` in place over every rank of `comm` (default COMM_WORLD).

    op: "sum" or "avg". wire_dtype: None (send the tensor's own dtype) or
    torch.bfloat16 / torch.float16 to send compressed. With async_op=True a
    `Work` is returned: `wait()` completes it, `is_completed()` polls it; the
    tensor must not be used until then. Every wait has a deadline
    (MPIDP_TIMEOUT seconds)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    if op not in _OPS:
        raise ValueError(f"op: expected 'sum' or 'avg', got {op!r}")
    if not tensor.is_contiguous():
        raise ValueError("tensor: expected a contiguous tensor (call .contiguous() and reduce that)")
    if tensor.requires_grad and tensor.is_leaf:
        raise ValueError("tensor: a leaf tensor that requires grad cannot be reduced in place; "
                         "pass tensor.detach() or tensor.data")
    return resolve_comm(comm).allreduce(tensor.detach(), _OPS[op], wire_code(wire_dtype),
                                        bool(async_op))
