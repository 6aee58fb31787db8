"""What the backend hands the C core: host, contiguous tensors of a dtype
the core knows, reduced with an op MPI defines for it; and how results go
back into the caller's tensors.

The C core takes contiguous host tensors of float32/64, bfloat16, float16,
int8/16/32/64, uint8 and bool. Everything else a torch user passes is
staged here: CUDA tensors through host copies (where the device path,
_device.py, does not take the call),
non-contiguous ones through contiguous copies, complex ones as their real
view (sums only), 16-bit floats' min/max/product in float32; the result is
copied back when the operation completes."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .. import _C

RedOpType = dist.ReduceOp.RedOpType

CORE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8,
               torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_COMPLEX = (torch.complex64, torch.complex128)

_CORE_OP = {RedOpType.SUM: _C.OP_SUM, RedOpType.AVG: _C.OP_AVG, RedOpType.PRODUCT: _C.OP_PROD,
            RedOpType.MIN: _C.OP_MIN, RedOpType.MAX: _C.OP_MAX, RedOpType.BAND: _C.OP_BAND,
            RedOpType.BOR: _C.OP_BOR, RedOpType.BXOR: _C.OP_BXOR,
            RedOpType.PREMUL_SUM: _C.OP_SUM}


_SUM, _AVG = RedOpType.SUM.value, RedOpType.AVG.value
_to_dlpack = getattr(torch._C, "_to_dlpack_versioned", None)


def exported(t: torch.Tensor):
    """A host tensor the backend detached or made itself, as the DLPack
    capsule the core takes: made directly, without the per-call checks of
    Tensor.__dlpack__ (which cost more than the core's own post)."""
    return t if _to_dlpack is None else _to_dlpack(t)


# Dtypes the core sums (bool's sum is an "or", below) and averages as they are.
_PLAIN_SUM = frozenset(d for d in CORE_DTYPES if d is not torch.bool)
_CORE_AVG = frozenset((torch.float32, torch.float64))


class Unsupported(TypeError):
    """An op or dtype the backend cannot reduce (named in the message)."""


def op_name(op) -> str:
    return str(op).rsplit(".", 1)[-1]


def premul_factor(op):
    """PREMUL_SUM's factor (a number or a tensor), or None where torch does
    not say: `ReduceOp.factor` is new in torch 2.13; older versions give it
    only through the op's pickled state, (kind, factor)."""
    if not isinstance(op, dist.ReduceOp):
        return None
    if hasattr(op, "factor"):
        return op.factor
    try:
        state = op.__getstate__()
    except Exception:
        return None
    return state[1] if isinstance(state, tuple) and len(state) == 2 else None


def check_dtype(t: torch.Tensor, what: str) -> None:
    if t.layout != torch.strided:
        raise Unsupported(f"mpidp backend: {what} of a {t.layout} tensor: the backend takes "
                          "dense (strided) tensors; pass t.to_dense()")
    if t.dtype not in CORE_DTYPES and t.dtype not in _COMPLEX:
        raise Unsupported(f"mpidp backend: {what} of a {t.dtype} tensor: the backend takes "
                          f"{', '.join(str(d).replace('torch.', '') for d in CORE_DTYPES)} "
                          "and complex64/128")


_STAGING_WARNED = set()   # device types warned of (also by _device.py)


def _warn_staging_once(device: torch.device) -> None:
    """One warning per process and device type: a device tensor goes
    through host memory, and why."""
    if device.type in _STAGING_WARNED:
        return
    _STAGING_WARNED.add(device.type)
    warnings.warn(f"mpidp backend: {device.type} tensors are copied to host memory and back for "
                  "collectives the device communicator does not take (it takes all_reduce, "
                  "broadcast, all_gather_into_tensor and reduce_scatter_tensor of the dtypes "
                  "NCCL reduces)", RuntimeWarning, stacklevel=3)


def staged(t: torch.Tensor, writes: bool, what: str):
    """(a contiguous host tensor of a core dtype holding t's values, and a
    function that copies it back into t -- None when it is t's own memory,
    or nothing is written). Complex tensors travel as their real view."""
    check_dtype(t, what)
    view = (torch.view_as_real(t) if t.is_complex() else t).detach()
    if view.is_cpu and view.is_contiguous():
        return view, None
    if view.is_meta:
        raise ValueError(f"mpidp backend: {what} of a tensor on the meta device, which holds no "
                         "values to communicate")
    if not view.is_cpu:
        _warn_staging_once(view.device)
    work = torch.empty(view.shape, dtype=view.dtype, device="cpu")
    work.copy_(view)
    return work, ((lambda: view.copy_(work)) if writes else None)


def reduction(t: torch.Tensor, op: dist.ReduceOp, size: int, what: str):
    """How to reduce t with `op`: (core op, the tensor to post, prepare, finish)
    -- prepare runs on the posted tensor before posting (PREMUL_SUM's
    factor), finish after completion (the copy back, a 16-bit min/max in
    float32); raises Unsupported naming op and dtype."""
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    dtype = t.dtype
    # The common case (DDP's buckets, FSDP2's float reductions, metrics):
    # the caller's own contiguous host tensor, an op the core does itself.
    # (Enum values compared as ints: pybind's == on enums costs a microsecond.)
    value = kind.value
    if t.is_cpu and ((value == _SUM and dtype in _PLAIN_SUM) or
                     (value == _AVG and dtype in _CORE_AVG)) and t.is_contiguous():
        return (_C.OP_SUM if value == _SUM else _C.OP_AVG), t.detach(), None, None
    name = op_name(kind)
    if kind not in _CORE_OP:
        raise Unsupported(f"mpidp backend: {what} with op {name} is not supported")
    if dtype in _COMPLEX and kind not in (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM):
        raise Unsupported(f"mpidp backend: {what} with op {name} is not defined for {dtype} "
                          "(complex tensors take SUM, AVG and PREMUL_SUM)")
    if kind in (RedOpType.AVG, RedOpType.PREMUL_SUM) and not (dtype.is_floating_point or
                                                              dtype in _COMPLEX):
        raise Unsupported(f"mpidp backend: {what} with op {name} is not defined for {dtype} "
                          "(it needs a floating-point tensor)")
    if kind in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR) and (dtype.is_floating_point or
                                                                   dtype in _COMPLEX):
        raise Unsupported(f"mpidp backend: {what} with op {name} is not defined for {dtype} "
                          "(bitwise ops take integer and bool tensors)")
    core_op = _CORE_OP[kind]
    if dtype is torch.bool and kind == RedOpType.SUM:
        core_op = _C.OP_MAX        # as NCCL: a sum of bools is their "or"
    upcast = dtype in (torch.bfloat16, torch.float16) and kind in (
        RedOpType.MIN, RedOpType.MAX, RedOpType.PRODUCT)
    avg_here = kind == RedOpType.AVG and dtype not in (torch.float32, torch.float64)
    if avg_here:
        core_op = _C.OP_SUM        # the core averages float32/64; the others are scaled here
    work, copy_back = staged(t, True, what)
    if upcast:
        half = work
        work = half.to(torch.float32)
        inner_back = copy_back

        def copy_back():
            half.copy_(work)
            if inner_back is not None:
                inner_back()
    prepare = None
    if kind == RedOpType.PREMUL_SUM:
        factor = premul_factor(op)
        if factor is None:
            raise Unsupported(f"mpidp backend: {what} with PREMUL_SUM needs its factor")

        def prepare(x, f=factor):
            x.mul_(f.to(x.device) if isinstance(f, torch.Tensor) else f)
    finish = copy_back
    if avg_here:
        def finish(back=copy_back):
            work.div_(size)
            if back is not None:
                back()
    return core_op, work, prepare, finish
