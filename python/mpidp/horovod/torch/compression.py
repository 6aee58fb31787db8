"""Horovod's gradient compression: Compression.none, .fp16, and mpidp's
.bf16. A user-defined Compressor (compress(tensor) -> (tensor, ctx),
decompress(tensor, ctx)) works with the functional allreduce."""

from __future__ import annotations

import torch


class Compressor:
    """Interface: compress(tensor) -> (tensor, ctx); decompress(tensor, ctx)."""

    # The dtype the core packs float32 tensors to on the wire (None: none).
    wire_dtype = None

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor(Compressor):
    dtype = torch.float16

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != cls.dtype:
            return tensor.to(cls.dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Floating tensors travel as float16 (the dtype is restored)."""
    dtype = wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating tensors travel as bfloat16 (mpidp's addition: float32's
    range, no overflow)."""
    dtype = wire_dtype = torch.bfloat16


class Compression:
    """The compressors, by Horovod's names."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
