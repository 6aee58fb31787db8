"""The 8-bit block quantizer through mpidp.kernels (quantize8 / dequantize8).

Against a float64 model written here from the format's definition (min-max
per block of _C.Q8_BLOCK elements, codes counted from the block's minimum):
the decoded values, the error bound of half a step, the non-finite rule; every
SIMD path this CPU runs bit for bit against path="ref"; and the argument
checks. The C tests (tests/c/test_quant8.c) cover the kernels exhaustively;
these cover the binding and the rules a Python user relies on.
"""

from __future__ import annotations

import pytest
import torch

from mpidp import _C, kernels

B = _C.Q8_BLOCK


def roundtrip(x: torch.Tensor, scale: float = 1.0, path=None) -> torch.Tensor:
    q = torch.empty(kernels.quant8_bytes(x.numel()), dtype=torch.uint8)
    kernels.quantize8(q, x, scale, path=path)
    y = torch.empty_like(x)
    kernels.dequantize8(y, q, path=path)
    return y


def model(x: torch.Tensor) -> torch.Tensor:
    """Per block, in float64: lo + rint((x - lo) / step) * step."""
    out = torch.empty(x.numel(), dtype=torch.float64)
    for at in range(0, x.numel(), B):
        blk = x[at:at + B].double()
        lo, hi = blk.min(), blk.max()
        step = (hi - lo) / 255
        q = torch.zeros_like(blk) if step == 0 else torch.round((blk - lo) / step).clamp(0, 255)
        out[at:at + B] = lo + q * step
    return out


def test_sizes_and_layout():
    assert kernels.quant8_bytes(0) == 0
    assert kernels.quant8_bytes(1) == _C.Q8_RECORD == B + 8
    assert kernels.quant8_bytes(B + 1) == 2 * _C.Q8_RECORD
    x = torch.arange(B + 3, dtype=torch.float32)
    q = torch.empty(kernels.quant8_bytes(x.numel()), dtype=torch.uint8)
    kernels.quantize8(q, x)
    # Each record starts with the block's {lo, hi} as float32.
    headers = torch.stack([q[r * _C.Q8_RECORD:r * _C.Q8_RECORD + 8] for r in range(2)])
    lohi = headers.view(torch.float32)
    assert lohi.tolist() == [[0.0, float(B - 1)], [float(B), float(B + 2)]]


@pytest.mark.parametrize("spread", [1.0, 1e-3, 1e4, 1e-30, 1e30])
def test_decoded_values_within_half_a_step_of_the_input_and_near_the_model(spread):
    g = torch.Generator().manual_seed(3)
    x = ((torch.rand(5 * B + 17, generator=g, dtype=torch.float64) * 2 - 1) * spread
         + 3 * spread).float()
    y = roundtrip(x)
    for at in range(0, x.numel(), B):
        blk, dec = x[at:at + B].double(), y[at:at + B].double()
        half_step = (blk.max() - blk.min()) / 510
        ulp = blk.abs().max() * 2.0 ** -22
        assert ((dec - blk).abs() <= half_step * (1 + 2 ** -20) + ulp).all()
    # Against the float64 model: equal up to a step where fp32 rounding sits on a tie.
    steps = torch.cat([((x[a:a + B].double().max() - x[a:a + B].double().min()) / 255).repeat(
        len(x[a:a + B])) for a in range(0, x.numel(), B)])
    assert ((y.double() - model(x)).abs() <= steps * 1.0001 + x.double().abs() * 2.0 ** -22).all()
    assert ((y.double() - model(x)).abs() <= steps * 1e-3 + x.double().abs() * 2.0 ** -22).float().mean() > 0.99


def test_bagua_failing_inputs_are_handled():
    wide = torch.tensor([-1e30, 1e30, 0.0, 5e29], dtype=torch.float32)
    y = roundtrip(wide)
    assert y[0] == -1e30 and y[1] == 1e30 and torch.isfinite(y).all()
    assert ((y - wide).abs() <= 2e30 / 510 * 1.0001).all()
    # 256 values one ulp apart near 5e4 decode exactly (Bagua's rounding
    # relative to 0 gave a constant).
    narrow = (torch.tensor([5e4], dtype=torch.float32).view(torch.int32)
              + torch.arange(B, dtype=torch.int32)).view(torch.float32)
    assert torch.equal(roundtrip(narrow), narrow)


def test_non_finite_block_decodes_to_nan_and_accumulates_to_nan():
    x = torch.linspace(-1, 1, 3 * B)
    x[B + 5] = float("inf")
    x[2 * B] = float("nan")
    y = roundtrip(x)
    assert torch.isfinite(y[:B]).all() and torch.isnan(y[B:]).all()
    q = torch.empty(kernels.quant8_bytes(x.numel()), dtype=torch.uint8)
    kernels.quantize8(q, x)
    acc = torch.ones(3 * B)
    kernels.dequantize8(acc, q, accumulate=True)
    assert torch.isnan(acc[B:]).all()
    assert torch.allclose(acc[:B], 1 + x[:B], atol=2 / 510 * 1.001)


def test_scale_and_accumulate():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1000, generator=g)
    q = torch.empty(kernels.quant8_bytes(1000), dtype=torch.uint8)
    kernels.quantize8(q, x, scale=0.25)
    assert torch.equal(roundtrip(x * 0.25), roundtrip(x, scale=0.25))
    base = torch.randn(1000, generator=g)
    acc = base.clone()
    kernels.dequantize8(acc, q, accumulate=True)
    dec = torch.empty(1000)
    kernels.dequantize8(dec, q)
    assert torch.equal(acc, base + dec)


@pytest.mark.parametrize("path", [p for p in _C.simd_paths() if p != "ref"])
def test_simd_paths_bit_identical_to_ref(path):
    g = torch.Generator().manual_seed(11)
    for n in (1, 7, 16, 255, 256, 257, 4099):
        x = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(
            torch.int32).view(torch.float32)
        x[::3] = torch.randn(len(x[::3]), generator=g)   # ordinary numbers too
        for scale in (1.0, -0.5):
            qg = torch.empty(kernels.quant8_bytes(n), dtype=torch.uint8)
            qw = torch.empty_like(qg)
            kernels.quantize8(qg, x, scale, path=path)
            kernels.quantize8(qw, x, scale, path="ref")
            assert torch.equal(qg, qw), (path, n, scale)
            for acc in (False, True):
                yg, yw = x.clone(), x.clone()
                kernels.dequantize8(yg, qw, accumulate=acc, path=path)
                kernels.dequantize8(yw, qw, accumulate=acc, path="ref")
                assert torch.equal(yg.view(torch.int32), yw.view(torch.int32)), (path, n, acc)


def test_bad_arguments_are_named():
    x = torch.zeros(300)
    with pytest.raises(ValueError, match=r"quantize8: dst holds 10 bytes, but 300 elements take 528"):
        kernels.quantize8(torch.empty(10, dtype=torch.uint8), x)
    with pytest.raises(TypeError, match="dst: unexpected dtype float32"):
        kernels.quantize8(torch.empty(528), x)
    with pytest.raises(TypeError, match="src: unexpected dtype float32"):
        kernels.dequantize8(x, torch.empty(528))
    with pytest.raises(ValueError, match=r"dequantize8: src holds 264 bytes, but 300 elements take 528"):
        kernels.dequantize8(x, torch.empty(264, dtype=torch.uint8))
    with pytest.raises(TypeError, match="accumulate: expected a bool"):
        kernels.dequantize8(x, torch.empty(528, dtype=torch.uint8), accumulate=1)
    with pytest.raises(ValueError, match="n: expected an int >= 0"):
        kernels.quant8_bytes(-1)
