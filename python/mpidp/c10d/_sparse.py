"""all_reduce of sparse COO tensors on the "mpidp" backend, as gloo offers
it (sparse gradients of nn.Embedding(sparse=True) under DDP, torch's own
test_sparse_all_reduce_sum): a sum only.

Every rank's indices and values are gathered (one allgather of the counts,
then one of each), concatenated in rank order and coalesced, so every rank
holds the same bits; the tensor passed becomes the sum (it is replaced
in place, as gloo does, and its number of stored elements changes). The
ranks first agree on its shape, dtype and sparse/dense dimensions. The
traffic is every rank's nonzeros, as gloo's: a sum whose result is dense
costs more than all_reduce(t.to_dense())."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .._runtime.argument_agreement import crc_of
from ._tensors import Unsupported, check_dtype


def all_reduce_sparse(group, t: torch.Tensor, reduce_op):
    """The sum of the sparse COO tensor t over `group` (a ProcessGroupMPIDP),
    written into t; returns the group's completed Work."""
    if reduce_op != dist.ReduceOp.SUM:
        raise Unsupported(f"mpidp backend: all_reduce of a sparse tensor takes ReduceOp.SUM "
                          f"only (as gloo), got {reduce_op}; pass t.to_dense() for another op")
    check_dtype(torch.empty(0, dtype=t.dtype), "all_reduce of a sparse tensor")
    group._agree("all_reduce (sparse)", t, layout=crc_of([t.sparse_dim(), t.dense_dim()]))
    comm, size = group.core_comm, group.core_comm.size
    indices = t._indices().t().contiguous().cpu()                # nnz x sparse_dim
    values = t._values().detach().contiguous().cpu()            # nnz x dense shape
    wire = torch.view_as_real(values) if values.is_complex() else values
    per_row = math.prod(wire.shape[1:])                          # elements of one value
    counts = torch.empty(size, dtype=torch.int64)
    comm.allgather(torch.tensor([t._nnz()], dtype=torch.int64), counts)
    nnz = counts.tolist()
    all_indices = torch.empty(sum(nnz), t.sparse_dim(), dtype=torch.int64)
    comm.allgatherv(indices.reshape(-1), all_indices.reshape(-1),
                    tuple(n * t.sparse_dim() for n in nnz))
    all_wire = torch.empty((sum(nnz),) + tuple(wire.shape[1:]), dtype=wire.dtype)
    comm.allgatherv(wire.reshape(-1), all_wire.reshape(-1), tuple(n * per_row for n in nnz))
    all_values = torch.view_as_complex(all_wire) if values.is_complex() else all_wire
    total = torch.sparse_coo_tensor(all_indices.t(), all_values, t.shape).coalesce()
    with torch.no_grad():
        t.copy_(total.to(t.device))
    return group._work([], [t], None, "all_reduce")
