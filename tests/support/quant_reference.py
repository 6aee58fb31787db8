"""A single-process replica of mpidp's 8-bit quantized allreduce
(mpidp/qallreduce.h) on mpidp.kernels' reference path, for the tests that
compare the engine, DataParallel's uint8 wire and QAdam with it bit for bit."""

from __future__ import annotations

import torch

from mpidp import _C, kernels

B = _C.Q8_BLOCK


def q(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(kernels.quant8_bytes(x.numel()), dtype=torch.uint8)
    kernels.quantize8(out, x, path="ref")
    return out


def replica_of(inputs, average: bool) -> torch.Tensor:
    """The reduction of every rank's input (one segment, at most 2^22
    elements): quantize each rank's chunk, decode and sum in rank order, scale,
    requantize, decode."""
    n = inputs[0].numel()
    chunk = -(-(-(-n // len(inputs))) // B) * B
    out = torch.empty(n)
    for c in range(len(inputs)):
        lo, hi = c * chunk, min(n, (c + 1) * chunk)
        if lo >= hi:
            continue
        acc = torch.empty(hi - lo)
        for r in range(len(inputs)):
            kernels.dequantize8(acc, q(inputs[r][lo:hi]), accumulate=r > 0, path="ref")
        scaled = torch.empty(kernels.quant8_bytes(hi - lo), dtype=torch.uint8)
        kernels.quantize8(scaled, acc, 1.0 / len(inputs) if average else 1.0, path="ref")
        kernels.dequantize8(out[lo:hi], scaled, path="ref")
    return out
