"""Integer reductions as torch computes them, for tests that give every rank
values whose sums and products leave the dtype's range.

torch (like numpy, gloo and C's unsigned arithmetic) wraps modulo 2^bits;
Open MPI 4.1's MPI_SUM of 8- and 16-bit integers saturates in its AVX code
and wraps in its scalar tail, so a sum that is right for 3 elements can be
wrong for 64. SIZES holds a size of each path the core takes: the small
point-to-point fold (a few hundred bytes and just under its 16 KB limit)
and MPI's own allreduce beyond it."""

import functools

import torch

INTEGERS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
SIZES = [7, 999, 40_000]
OPS = {
    "sum": torch.add,
    "prod": torch.mul,
    "min": torch.minimum,
    "max": torch.maximum,
    "band": torch.bitwise_and,
    "bor": torch.bitwise_or,
    "bxor": torch.bitwise_xor,
}


def overflowing(rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Rank `rank`'s values: spread over the dtype's whole range, different
    on every rank and element, so that sums of two overflow about a quarter
    of the time, either way."""
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(7919 * (rank + 1) + n)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


def reduced(op: str, tensors) -> torch.Tensor:
    """The reduction of `tensors` with torch's own arithmetic in their dtype."""
    return functools.reduce(OPS[op], tensors)
