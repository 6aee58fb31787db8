"""Helpers shared by the data-parallel wrappers: parameter checks, broadcasting
parameters and buffers from one rank, and gradient bucket views."""

from __future__ import annotations

import torch

from .. import _C
from .dtypes import CODE_OF

FLOAT_DTYPES = tuple(CODE_OF)


def check_module(module, argname: str = "module") -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{argname}: expected a torch.nn.Module, got {type(module).__name__}")
    for name, p in module.named_parameters():
        if p.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{argname}: parameter {name!r} has dtype {p.dtype}; data-parallel "
                             "training averages floating-point parameters only (float32, float64, "
                             "bfloat16, float16)")


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


def broadcast_buffers(module: torch.nn.Module, comm: "_C.Comm") -> None:
    """Rank 0's buffers before a training forward (broadcast_buffers=True),
    written through `.data` so that their version counters do not move, as
    torch DDP's: BatchNorm saves its running statistics for backward, and a
    forward run twice before one backward failed that backward with torch's
    in-place error on the ranks that received (rank 0 copies nothing)."""
    if comm.size > 1:  # listing the buffers costs more than one rank's forward of a small model
        broadcast_tensors([b.data for b in module.buffers()], comm)


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


def flatten(tensors, dtype=None) -> torch.Tensor:
    """The tensors' elements one after another in a new 1-D tensor (of
    `dtype`, else their common one); write_back undoes it."""
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
    autograd view through its view tracking, which cost ~0.4 us per
    parameter per backward on a CPU (benchmarks/bench_step.py's hook figure,
    in one process: 0.85-1.29 us with views, 0.50-0.62 us with aliases); a
    detached alias is a plain tensor to it. Parameters stored densely in a
    non-default layout (channels_last) get the same strides, so autograd's
    layout contract holds and it accumulates into the bucket instead of
    allocating."""
    dense = param.is_contiguous() or any(
        param.dim() == d and param.is_contiguous(memory_format=f)
        for d, f in ((4, torch.channels_last), (5, torch.channels_last_3d)))
    if dense:
        return flat.as_strided(param.shape, param.stride(), offset).detach()
    return flat.narrow(0, offset, param.numel()).view(param.shape).detach()


def remove_handles(handles: list) -> None:
    """Removes hook handles, emptying the list in place (a wrapper's
    weakref.finalize and its explicit detach share one list)."""
    for h in handles:
        h.remove()
    handles.clear()


def name_list(names, most: int = 4) -> str:
    """'a', 'b', 'c', 'd' and 3 more: parameter names for an error message."""
    shown = ", ".join(map(repr, names[:most]))
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


# Counts every parameter and submodule registration of any module (torch's
# global registration hooks), so that a wrapper rescans its model only when
# some model changed: a step costs one integer comparison otherwise.
_registrations = 0


def _count_registration(*_hook_args) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


class TrainableAtSetup:
    """What a wrapper averages is the set of parameters trainable when it was
    set up. A parameter outside that set that requires grad later -- one
    frozen then and unfrozen since (progressive unfreezing), or one added
    since (a new head: model.fc = nn.Linear(...)) -- would train on each
    rank's own gradients and the replicas would drift apart with no error;
    torch DDP lets that happen. The wrapper calls check() once a training
    step and it raises instead: a scan of the parameters outside the set
    (nothing when there are none), and of the whole model only after some
    module registered a parameter or a submodule."""

    def __init__(self, module: torch.nn.Module, what: str, rebuild: str):
        self._module = module
        self._what = what
        self._rebuild = rebuild    # how this wrapper is set up again, one sentence
        # Held, not only their ids: a freed parameter's id could be reused by a new one.
        self._known = {id(p): p for p in module.parameters()}
        self._outside = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self._registrations = _registrations

    def check(self) -> None:
        if self._registrations != _registrations:
            self._registrations = _registrations
            added = [(n, p) for n, p in self._module.named_parameters() if id(p) not in self._known]
            self._known.update((id(p), p) for _, p in added)
            self._outside += added
        if not self._outside or not any(p.requires_grad for _, p in self._outside):
            return
        names = [n for n, p in self._outside if p.requires_grad]
        raise RuntimeError(
            f"{self._what}: parameter(s) {name_list(names)} require grad but were not trainable "
            f"parameters of the model when {self._what} was set up (frozen then, or added "
            "since), so their gradients would not be averaged and every rank would train its own "
            f"copy. {self._rebuild}, or keep such parameters trainable from the start and add "
            "them to the optimizer when they should train")
