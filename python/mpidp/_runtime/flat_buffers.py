"""Tensors as one flat buffer and back: bytes of any dtypes packed for one
message (pack_bytes / unpack_bytes), elements one after another (flatten /
write_back), and a parameter's gradient as a view of a bucket (grad_view)."""

from __future__ import annotations

import itertools

import torch

__all__ = ["pack_bytes", "unpack_bytes", "flatten", "write_back", "grad_view"]


def pack_bytes(group, fill: bool = True):
    """The bytes of `group` (tensors on one device) in one uint8 tensor on
    their device, each tensor at a multiple of 8 bytes so that its slice can
    be viewed as its dtype again, with each tensor's offset; `fill=False`
    leaves the buffer zeros (a rank that only receives)."""
    chunks = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in group]
    offsets, nbytes = [], 0
    for c in chunks:
        offsets.append(nbytes)
        nbytes += (c.numel() + 7) // 8 * 8
    flat = torch.zeros(max(nbytes, 8), dtype=torch.uint8, device=group[0].device)
    if fill:
        torch._foreach_copy_([flat[o:o + c.numel()] for o, c in zip(offsets, chunks)], chunks)
    return flat, offsets


def unpack_bytes(flat: torch.Tensor, offsets, group) -> None:
    """pack_bytes' inverse: each tensor of `group` <- its slice of `flat`."""
    views = [flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
             for o, t in zip(offsets, group)]
    torch._foreach_copy_(list(group), views)


def flatten(tensors, dtype=None, out=None) -> torch.Tensor:
    """The tensors' elements one after another in a new 1-D tensor (of
    `dtype`, else their common one), or written into `out` (a 1-D tensor
    of their total length: a buffer kept across steps, cast to its dtype);
    write_back undoes it."""
    if out is not None:
        offsets = itertools.accumulate((t.numel() for t in tensors), initial=0)
        torch._foreach_copy_([out[o:o + t.numel()] for o, t in zip(offsets, tensors)],
                             [t.detach().reshape(-1) for t in tensors])
        return out
    return torch.cat([t.detach().reshape(-1) if dtype is None else
                      t.detach().reshape(-1).to(dtype) for t in tensors])


def write_back(flat: torch.Tensor, tensors) -> None:
    """Copies consecutive pieces of `flat` into `tensors`, in place (each cast
    to its tensor's dtype and device): flatten's inverse."""
    with torch.no_grad():
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def grad_view(flat: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """An alias of `flat`'s memory from `offset` on, shaped like `param`'s
    gradient, sharing `flat`'s version counter (an in-place change of the
    gradient moves the bucket's `_version`, which the reducer reads).

    Detached from the view it is made from: autograd accumulates into an
    autograd view through its view tracking, which costs time per parameter
    per backward (docs/design-notes.md, "Gradient views"); a detached alias
    is a plain tensor to it. Parameters stored densely in a
    non-default layout (channels_last) get the same strides, so autograd's
    layout contract holds and it accumulates into the bucket instead of
    allocating."""
    dense = param.is_contiguous() or any(
        param.dim() == d and param.is_contiguous(memory_format=f)
        for d, f in ((4, torch.channels_last), (5, torch.channels_last_3d)))
    if dense:
        return flat.as_strided(param.shape, param.stride(), offset).detach()
    return flat.narrow(0, offset, param.numel()).view(param.shape).detach()
