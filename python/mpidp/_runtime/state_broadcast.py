"""Rank 0's (or `root`'s) parameters, buffers and tensors for every rank, in
one message per device."""

from __future__ import annotations

import torch

from .. import _C
from .flat_buffers import pack_bytes, unpack_bytes

__all__ = ["broadcast_state", "broadcast_tensors", "broadcast_buffers", "give_replacements"]


def broadcast_state(module: torch.nn.Module, comm: "_C.Comm", root: int = 0) -> None:
    """Make every parameter and buffer of `module` equal to rank `root`'s.

    Rank `root`'s values are kept as they are: no re-seeding, no
    reset_parameters(), so a loaded checkpoint and the user's RNG survive."""
    broadcast_tensors(list(module.parameters()) + list(module.buffers()), comm, root)


def broadcast_tensors(tensors, comm: "_C.Comm", root: int = 0) -> None:
    """Make `tensors` (any dtypes and devices) equal to rank `root`'s, in place.

    Everything travels as bytes in one message per device (a model of 500 small
    tensors costs one broadcast, not 500), so integer buffers such as
    BatchNorm's num_batches_tracked come along too. The bytes are packed where
    the tensors live, so device memory crosses to the host once each way."""
    if comm.size == 1 or not tensors:
        return
    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    with torch.no_grad():
        for group in by_device.values():
            flat, offsets = pack_bytes(group)
            host = flat.cpu()
            comm.bcast(host, root)
            if comm.rank == root:
                continue
            flat.copy_(host)
            unpack_bytes(flat, offsets, group)


def give_replacements(tensors, comm: "_C.Comm", replacement: bool) -> None:
    """Fault-tolerant mode, recover(replace=True): rank 0's `tensors` for the
    replacements (replacement=True on theirs: taken in place), while the
    other survivors keep their own (a replica algorithm's replicas differ
    between syncs): theirs receive into copies that are dropped."""
    tensors = list(tensors)
    if not replacement and comm.rank != 0:
        tensors = [t.detach().clone() for t in tensors]
    broadcast_tensors(tensors, comm)


def broadcast_buffers(module: torch.nn.Module, comm: "_C.Comm") -> None:
    """Rank 0's buffers before a training forward (broadcast_buffers=True),
    written through `.data` so that their version counters do not move, as
    torch DDP's: BatchNorm saves its running statistics for backward, and a
    forward run twice before one backward failed that backward with torch's
    in-place error on the ranks that received (rank 0 copies nothing)."""
    if comm.size > 1:  # listing the buffers costs more than one rank's forward of a small model
        broadcast_tensors([b.data for b in module.buffers()], comm)
