"""Mapping between torch dtypes and the C core's dtype codes (mpidp/tensor.h)."""

from __future__ import annotations

import torch

from .. import _C
from .args import check_dtype

CODE_OF = {torch.float32: _C.DTYPE_F32, torch.float64: _C.DTYPE_F64,
           torch.bfloat16: _C.DTYPE_BF16, torch.float16: _C.DTYPE_F16}


def code_of(dtype: torch.dtype, argname: str) -> int:
    try:
        return CODE_OF[dtype]
    except KeyError:
        raise TypeError(f"{argname}: expected a floating-point dtype (float32, float64, bfloat16 "
                        f"or float16), got {dtype}") from None


def wire_code(wire_dtype, argname: str = "wire_dtype", quantized: bool = False) -> int:
    """_C.NO_WIRE for None (no compression), else the code of bfloat16/float16/float32,
    and of uint8 (8-bit block quantization) where the caller has the `quantized` engine."""
    allowed = (torch.bfloat16, torch.float16) + ((torch.uint8,) if quantized else ()) + \
        (torch.float32,)
    if check_dtype(argname, wire_dtype, allowed, none_ok=True) is None:
        return _C.NO_WIRE
    return _C.DTYPE_U8 if wire_dtype is torch.uint8 else CODE_OF[wire_dtype]
