"""Means of tensors over the ranks of a communicator, as the averaging
algorithms take them (model averaging, SlowMo, DiLoCo, SparseLoCo): one
flat host buffer (mixed dtypes upcast), divided by the size, summed."""

from __future__ import annotations

from typing import List

import torch

from .. import _C
from .._runtime import fault_tolerant_mode
from .._runtime.mpi import world
from .._runtime.flat_buffers import flatten, write_back
__all__ = ["average_tensors", "mean_over_ranks"]


def average_tensors(tensors: List[torch.Tensor], comm: _C.Comm) -> None:
    """Every tensor becomes its mean over the ranks of `comm`, in place: one
    flat buffer (mixed dtypes upcast), divided by the size, summed."""
    if not tensors:
        return
    mean = mean_over_ranks(tensors, comm)
    if fault_tolerant_mode.enabled() and comm is world():
        # Taken by every rank or by none (the mean may hold a rank that died).
        fault_tolerant_mode.agree_all_alive("model averaging", "no rank took the average")
    write_back(mean, tensors)


def mean_over_ranks(tensors: List[torch.Tensor], comm: _C.Comm) -> torch.Tensor:
    """The tensors' means over the ranks of `comm`, flattened into one host
    buffer (for write_back); the tensors are left as they are."""
    flat = flatten(tensors)
    flat /= comm.size
    host = flat.cpu()
    comm.allreduce(host, _C.OP_SUM, _C.NO_WIRE, False)
    return host
