"""The wire conversion kernels on tensors: the bf16/fp16 casts DataParallel and
DASO put on the wire and the 8-bit block quantizer, callable directly (the tests
compare every path with the reference and with torch; the benchmarks time them).

    pack(dst, src, ref=None, scale=1.0, path=None, stream=None)
        dst (bf16/fp16) = half(scale * (src - ref))
    unpack(dst, src, ref=None, a=0, b=1, c=0, path=None, stream=None)
        dst (fp32) = a*dst + b*widen(src) + c*ref, in that fp32 order (dst is
        not read when a == 0); src is bf16, fp16 or fp32
    sum16(inout, src, path=None, stream=None)
        inout = half(widen(inout) + widen(src)): the native MPI op's sum
    quantize8(dst, src, scale=1.0, path=None, stream=None)
        dst (uint8, quant8_bytes(src.numel()) bytes) = 8-bit min-max records
        of scale * src (fp32), one per block of _C.Q8_BLOCK elements
    dequantize8(dst, src, accumulate=False, path=None, stream=None)
        dst (fp32) = the values the records in src (uint8) decode to, or
        dst + them; a block that held a NaN or an infinity decodes to NaN
    quant8_bytes(n) -> the bytes n quantized elements take

Tensors are anything that exports DLPack (torch tensors, NumPy arrays, CuPy
arrays), contiguous, all on one device. Host tensors run the SIMD path chosen at
import, or the one named by `path` (one of mpidp._C.simd_paths()). CUDA tensors
run mpidp's CUDA kernels with the tensors' device current, on `stream` (an int
cudaStream_t) or, by default, on torch's current stream of that device, so they
are ordered after the torch work that produced their inputs; the call only
enqueues the work. On a stream other than the one the tensors were allocated
on, keep them alive until that stream has run the kernel (or
tensor.record_stream(s)), as for any torch work on a side stream.

This module owns where a call runs (device, stream, device guard); the core's
mpidp_convert (csrc/core/convert.c) checks the operands and runs the kernels.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from .. import _C
from .._runtime.args import check_int

__all__ = ["pack", "unpack", "sum16", "quantize8", "dequantize8", "quant8_bytes"]

# DLPack device types (DLDeviceType), as __dlpack_device__() reports them.
_DL_HOST = (1, 3)       # kDLCPU, kDLCUDAHost (pinned)
_DL_CUDA = (2, 13)      # kDLCUDA, kDLCUDAManaged


def pack(dst: Any, src: Any, ref: Any = None, scale: float = 1.0, path: Optional[str] = None,
         stream: Optional[int] = None) -> None:
    _run(_C.CONVERT_PACK, "pack", (("dst", dst), ("src", src), ("ref", ref)),
         (_real("scale", scale), 0.0, 0.0), path, stream)


def unpack(dst: Any, src: Any, ref: Any = None, a: float = 0.0, b: float = 1.0, c: float = 0.0,
           path: Optional[str] = None, stream: Optional[int] = None) -> None:
    _run(_C.CONVERT_UNPACK, "unpack", (("dst", dst), ("src", src), ("ref", ref)),
         (_real("a", a), _real("b", b), _real("c", c)), path, stream)


def sum16(inout: Any, src: Any, path: Optional[str] = None, stream: Optional[int] = None) -> None:
    _run(_C.CONVERT_SUM16, "sum16", (("inout", inout), ("src", src)), (0.0, 0.0, 0.0), path,
         stream)


def quantize8(dst: Any, src: Any, scale: float = 1.0, path: Optional[str] = None,
              stream: Optional[int] = None) -> None:
    _run(_C.CONVERT_Q8_ENCODE, "quantize8", (("dst", dst), ("src", src)),
         (_real("scale", scale), 0.0, 0.0), path, stream)


def dequantize8(dst: Any, src: Any, accumulate: bool = False, path: Optional[str] = None,
                stream: Optional[int] = None) -> None:
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate: expected a bool, got {type(accumulate).__name__}")
    _run(_C.CONVERT_Q8_DECODE, "dequantize8", (("dst", dst), ("src", src)),
         (1.0 if accumulate else 0.0, 0.0, 0.0), path, stream)


def quant8_bytes(n: int) -> int:
    """Bytes that n elements take quantized: one record per started block."""
    n = check_int("n", n, 0)
    return -(-n // _C.Q8_BLOCK) * _C.Q8_RECORD


def _real(name: str, value: Any) -> float:
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}") from None


def _device_of(obj: Any) -> Optional[str]:
    """'cpu' or 'cuda:N' for what mpidp can run on, None when that cannot be told
    before exporting (the core's borrowing then says what is wrong)."""
    if isinstance(obj, torch.Tensor):
        return f"cuda:{obj.get_device()}" if obj.is_cuda else "cpu"
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None:
        return None
    kind, index = dev()
    if kind in _DL_HOST:
        return "cpu"
    if kind in _DL_CUDA:
        return f"cuda:{index}"
    return None


def _common_device(fname: str, named) -> str:
    first = None
    for name, obj in named:
        if obj is None:
            continue
        where = _device_of(obj)
        if where is None:
            continue
        if first is None:
            first = (name, where)
        elif where != first[1]:
            raise ValueError(f"{fname}: {first[0]} is on {first[1]} but {name} is on {where}; all "
                             f"tensors of one call must be on one device")
    return "cpu" if first is None else first[1]


def _stream_handle(stream: Any) -> Optional[int]:
    if stream is None:
        return None
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError(f"stream: expected an int (a cudaStream_t, e.g. "
                        f"torch.cuda.current_stream().cuda_stream) or None, got "
                        f"{type(stream).__name__}")
    if stream < 0:
        raise ValueError(f"stream: expected a cudaStream_t handle (>= 0; 0 is the legacy default "
                         f"stream), got {stream}")
    return stream


@contextlib.contextmanager
def _on_cuda_device(index: int, stream: Optional[int]):
    """Makes cuda:index current (mpidp's kernels launch on the current device) and
    yields the stream to launch on: `stream`, else torch's current stream there.
    Without a usable torch.cuda (another producer's arrays on a CPU-only torch)
    nothing is switched and the default is the legacy default stream (0)."""
    if not torch.cuda.is_available():
        yield 0 if stream is None else stream
        return
    with torch.cuda.device(index):
        yield torch.cuda.current_stream(index).cuda_stream if stream is None else stream


def _run(op: int, fname: str, named, coefficients, path, stream) -> None:
    device = _common_device(fname, named)
    if path is not None and not isinstance(path, str):
        raise TypeError(f"path: expected a str (one of mpidp._C.simd_paths()) or None, got "
                        f"{type(path).__name__}")
    tensors = tuple(obj for _, obj in named) + (None,) * (3 - len(named))
    if device == "cpu":
        if stream is not None:
            raise ValueError("stream: only CUDA tensors run on a stream, and these tensors are in "
                             "host memory; pass stream=None")
        _C.convert(op, *tensors, *coefficients, path, None)
        return
    if path is not None:
        raise ValueError(f"path: selects a CPU kernel path, but the tensors are on {device} (CUDA "
                         f"tensors always run the CUDA kernels); pass path=None")
    stream = _stream_handle(stream)
    with _on_cuda_device(int(device.split(":")[1]), stream) as handle:
        _C.convert(op, *tensors, *coefficients, None, handle)
