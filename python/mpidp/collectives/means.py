"""Means of tensors over the ranks of a communicator, as the averaging
algorithms take them (model averaging, SlowMo, DiLoCo, SparseLoCo): one
flat host buffer (mixed dtypes upcast), divided by the size, summed."""

from __future__ import annotations

from typing import List

import torch

from .. import _C
from .._runtime import fault_tolerant_groups, fault_tolerant_mode
from .._runtime.flat_buffers import flatten, write_back
__all__ = ["average_tensors", "mean_over_ranks"]


def average_tensors(tensors: List[torch.Tensor], comm: _C.Comm, agreement=None) -> None:
    """Every tensor becomes its mean over the ranks of `comm`, in place: one
    flat buffer (mixed dtypes upcast), divided by the size, summed.

    In fault-tolerant mode the mean is taken by every rank or by none (it
    may hold a rank that died): the ranks of `agreement` (the mpi4py
    communicator the averaging runs for; None: the job's world) agree first
    that every rank lived through it, where that is the job's world or a
    group's (mpidp/_runtime/fault_tolerant_groups.py)."""
    if not tensors:
        return
    mean = mean_over_ranks(tensors, comm)
    if fault_tolerant_mode.enabled() and fault_tolerant_groups.is_domain(agreement):
        fault_tolerant_mode.agree_all_alive("model averaging", "no rank took the average",
                                            agreement)
    write_back(mean, tensors)


def mean_over_ranks(tensors: List[torch.Tensor], comm: _C.Comm) -> torch.Tensor:
    """The tensors' means over the ranks of `comm`, flattened into one host
    buffer (for write_back); the tensors are left as they are."""
    flat = flatten(tensors)
    flat /= comm.size
    host = flat.cpu()
    comm.allreduce(host, _C.OP_SUM, _C.NO_WIRE, False)
    return host
