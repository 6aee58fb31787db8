"""The CUDA conversion kernels against the CPU reference path, bit for bit.

mpidp/cuda.h promises the same bits as the CPU reference (csrc/core/pack_ref.c)
for every input, NaNs included (both write canonical NaNs), so a GPU rank and
a CPU rank put identical data on the wire. Each test runs a kernel through
mpidp.kernels.pack / unpack / sum16 on CUDA tensors and the same call with
path="ref" on CPU copies of the same inputs, and compares whole buffers:
special values, random bit patterns, odd lengths, views at element offsets
1..3 (which also turns the kernels' vector accesses off) with guard elements
around them that must stay untouched, a non-default stream, and tensors on a
device other than the current one. Nothing is timed here (benchmarks/ times).

Skipped, with the reason, where torch sees no CUDA device; and, apart from the
test of the failure itself, where mpidp's CUDA kernels cannot run (mpidp built
without CUDA, or a driver too old for the CUDA runtime mpidp was built with).
"""

from __future__ import annotations

import pytest
import torch

from mpidp import _C, kernels
from test_kernels import (ABC, HALF_IDS, HALVES, LENGTHS, OFFSETS, all_16_bits, bits,
                          random_16_bits, random_f32_bits, realistic_f32, special_16,
                          special_f32)

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: torch.cuda.is_available() is False", allow_module_level=True)

pytestmark = pytest.mark.serial

kernels_run = pytest.mark.skipif(
    not _C.cuda_available(),
    reason="mpidp's CUDA kernels cannot run here (built without CUDA, or no device usable by "
           "the CUDA runtime mpidp was built with)")

GUARD = 8
DEV = "cuda"


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = torch.nonzero(bits(got) != bits(want)).flatten()
    if len(diff):
        i = int(diff[0])
        raise AssertionError(f"{what}: {len(diff)} elements differ from the CPU reference, first "
                             f"at {i}: cuda {int(bits(got[i:i + 1])[0]):#x}, ref "
                             f"{int(bits(want[i:i + 1])[0]):#x}")


# --- whole-range comparisons ---------------------------------------------------------


def pack_both(src, ref, scale, dtype):
    want = torch.empty(src.shape, dtype=dtype)
    kernels.pack(want, src, ref, scale, path="ref")
    got = torch.empty(src.shape, dtype=dtype, device=DEV)
    kernels.pack(got, src.to(DEV), None if ref is None else ref.to(DEV), scale)
    return got, want


@kernels_run
@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
@pytest.mark.parametrize("with_ref", [False, True], ids=["src", "src-ref"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3, -7.25, 1e-30, 3e37])
def test_pack(dtype, with_ref, scale):
    src = torch.cat([special_f32(), random_f32_bits((1 << 20) + 3, 1), realistic_f32(1 << 16, 2)])
    ref = torch.cat([special_f32().flip(0), realistic_f32(len(src) - len(special_f32()), 3)]) \
        if with_ref else None
    got, want = pack_both(src, ref, scale, dtype)
    assert_bitwise(got, want, f"pack to {dtype}, scale {scale}, ref {with_ref}")


@kernels_run
@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_pack_specials_one_by_one(dtype):
    # Each special value alone: n = 1 takes the scalar code path of the kernel.
    sp = special_f32()
    for i in range(len(sp)):
        got, want = pack_both(sp[i:i + 1].clone(), None, 1.0, dtype)
        assert_bitwise(got, want, f"pack of special #{i} to {dtype}")


def unpack_inputs(src_dtype, seed):
    if src_dtype == torch.float32:
        return torch.cat([special_f32(), random_f32_bits((1 << 18) + 1, seed)])
    return torch.cat([special_16(src_dtype), all_16_bits(src_dtype),
                      random_16_bits((1 << 18) + 1, seed, src_dtype)])


@kernels_run
@pytest.mark.parametrize("src_dtype", HALVES + [torch.float32], ids=HALF_IDS + ["fp32"])
@pytest.mark.parametrize("with_ref", [False, True], ids=["noref", "ref"])
@pytest.mark.parametrize("a,b,c", ABC)
def test_unpack(src_dtype, with_ref, a, b, c):
    src = unpack_inputs(src_dtype, 4)
    n = len(src)
    dst0 = torch.cat([special_f32(), random_f32_bits(n, 5)])[:n].flip(0).contiguous()
    ref = torch.cat([random_f32_bits(n - len(special_f32()), 6), special_f32()]) if with_ref else None
    want = dst0.clone()
    kernels.unpack(want, src, ref, a, b, c, path="ref")
    got = dst0.to(DEV)
    kernels.unpack(got, src.to(DEV), None if ref is None else ref.to(DEV), a, b, c)
    assert_bitwise(got, want, f"unpack from {src_dtype}, a={a} b={b} c={c}, ref {with_ref}")


@kernels_run
@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_sum16(dtype):
    every, sp = all_16_bits(dtype), special_16(dtype)
    x = torch.cat([every, every, random_16_bits(1 << 20, 7, dtype), sp.repeat_interleave(len(sp))])
    y = torch.cat([random_16_bits(1 << 16, 8, dtype), every.flip(0),
                   random_16_bits(1 << 20, 9, dtype), sp.repeat(len(sp))])
    want = y.clone()
    kernels.sum16(want, x, path="ref")
    got = y.to(DEV)
    kernels.sum16(got, x.to(DEV))
    assert_bitwise(got, want, f"sum16 {dtype}")


@kernels_run
def test_empty_tensors_launch_nothing():
    kernels.pack(torch.empty(0, dtype=torch.bfloat16, device=DEV), torch.empty(0, device=DEV))
    kernels.unpack(torch.empty(0, device=DEV), torch.empty(0, dtype=torch.float16, device=DEV))
    kernels.sum16(torch.empty(0, dtype=torch.bfloat16, device=DEV),
             torch.empty(0, dtype=torch.bfloat16, device=DEV))
    torch.cuda.synchronize()


# --- odd lengths and misaligned views ------------------------------------------------------


def guarded(make, n, off):
    """A buffer with GUARD elements around a view of n elements that starts `off`
    elements before the aligned position."""
    buf = make(n + 2 * GUARD)
    start = GUARD - off
    return buf, start


def run_views(kind, dt, params, n, off, device, path):
    """The kernel on views at element offsets into guarded buffers; every buffer
    is built from seeds, so the CPU and the CUDA run start from equal data."""
    offs = [off, (3 * off + 1) % 4, (off + 2) % 4]
    seed = 100 * n + off

    def view(make, k):
        buf, start = guarded(make, n, offs[k])
        buf = buf.to(device)
        return buf, buf[start:start + n]

    r32 = lambda m, s: random_f32_bits(m, s)  # noqa: E731
    r16 = lambda m, s: random_16_bits(m, s, dt)  # noqa: E731
    kw = {"path": path} if device == "cpu" else {}
    if kind == "pack":
        scale, with_ref = params
        dbuf, d = view(lambda m: r16(m, seed), 0)
        sbuf, s = view(lambda m: r32(m, seed + 1), 1)
        r = view(lambda m: r32(m, seed + 2), 2)[1] if with_ref else None
        kernels.pack(d, s, r, scale, **kw)
        return [dbuf, sbuf]
    if kind == "unpack":
        a, b, c, with_ref = params
        dbuf, d = view(lambda m: r32(m, seed), 0)
        sbuf, s = view(lambda m: r32(m, seed + 1) if dt == torch.float32 else r16(m, seed + 1), 1)
        r = view(lambda m: r32(m, seed + 2), 2)[1] if with_ref else None
        kernels.unpack(d, s, r, a, b, c, **kw)
        return [dbuf, sbuf]
    ibuf, io = view(lambda m: r16(m, seed), 0)
    sbuf, s = view(lambda m: r16(m, seed + 1), 1)
    kernels.sum16(io, s, **kw)
    return [ibuf, sbuf]


VIEW_CASES = (
    [("pack", dt, (s, r)) for dt in HALVES for s in (1.0, -1 / 3) for r in (False, True)]
    + [("unpack", dt, (a, b, c, r)) for dt in HALVES + [torch.float32]
       for (a, b, c) in ((0.0, 1.0, 0.0), (0.5, 2.0, -1.0)) for r in (False, True)]
    + [("sum16", dt, ()) for dt in HALVES]
)


@kernels_run
@pytest.mark.parametrize("kind,dt,params", VIEW_CASES,
                         ids=[f"{k}-{d}-{p}".replace(" ", "") for k, d, p in VIEW_CASES])
def test_odd_lengths_and_misaligned_views(kind, dt, params):
    for n in LENGTHS + [(1 << 16) + 5]:
        for off in OFFSETS:
            want = run_views(kind, dt, params, n, off, "cpu", "ref")
            got = run_views(kind, dt, params, n, off, DEV, None)
            for g, w in zip(got, want):
                # Whole buffers: the view must match and the guards stay as they were.
                assert_bitwise(g, w, f"{kind} {dt} {params}, n={n}, offset {off}")


# --- streams and devices -----------------------------------------------------------------------


@kernels_run
@pytest.mark.parametrize("how", ["current-stream", "explicit-handle"])
def test_non_default_stream(how):
    """The kernel must run on the given stream, after the work queued there
    before it: a GPU sleep, then the copy that fills the input. Run on any
    other stream (torch's streams do not synchronise with the legacy default
    stream), it would read the zeros the input held before the copy."""
    n = (1 << 20) + 7
    values = random_f32_bits(n, 11)
    want = torch.empty(n, dtype=torch.bfloat16)
    kernels.pack(want, values, path="ref")
    values_dev = values.to(DEV)
    src = torch.zeros(n, device=DEV)
    dst = torch.zeros(n, dtype=torch.bfloat16, device=DEV)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    assert s.cuda_stream != torch.cuda.current_stream().cuda_stream
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # on the order of 0.1 s of GPU time
        src.copy_(values_dev)
        if how == "current-stream":
            kernels.pack(dst, src)  # stream=None: torch's current stream, s
    if how == "explicit-handle":
        kernels.pack(dst, src, stream=s.cuda_stream)  # the current stream is the default one here
    s.synchronize()
    assert_bitwise(dst, want, f"pack on a side stream ({how})")
    # And the merge back on that stream, ordered after the pack.
    out = torch.full((n,), float("nan"), device=DEV)
    torch.cuda.synchronize()  # the fill ran on the default stream
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        kernels.unpack(out, dst, stream=s.cuda_stream)
    s.synchronize()
    want_out = torch.empty(n)
    kernels.unpack(want_out, want, path="ref")
    assert_bitwise(out, want_out, "unpack on a side stream")


@kernels_run
def test_mixing_devices_is_a_value_error():
    with pytest.raises(ValueError, match=r"pack: dst is on cuda:\d+ but src is on cpu"):
        kernels.pack(torch.empty(4, dtype=torch.bfloat16, device=DEV), torch.zeros(4))
    with pytest.raises(ValueError, match=r"unpack: dst is on cpu but src is on cuda:\d+"):
        kernels.unpack(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match=r"pack: dst is on cuda:\d+ but ref is on cpu"):
        kernels.pack(torch.empty(4, dtype=torch.bfloat16, device=DEV), torch.zeros(4, device=DEV),
                torch.zeros(4))
    with pytest.raises(ValueError, match=r"path: selects a CPU kernel path"):
        kernels.sum16(torch.zeros(4, dtype=torch.bfloat16, device=DEV),
                 torch.zeros(4, dtype=torch.bfloat16, device=DEV), path="ref")
    with pytest.raises(TypeError, match=r"stream: expected an int"):
        kernels.sum16(torch.zeros(4, dtype=torch.bfloat16, device=DEV),
                 torch.zeros(4, dtype=torch.bfloat16, device=DEV), stream=torch.cuda.current_stream())
    with pytest.raises(ValueError, match=r"contiguous"):
        kernels.pack(torch.empty(4, dtype=torch.bfloat16, device=DEV), torch.zeros(8, device=DEV)[::2])


@kernels_run
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_another_device_than_the_current_one():
    values = random_f32_bits(10007, 12)
    want = torch.empty(10007, dtype=torch.float16)
    kernels.pack(want, values, path="ref")
    with torch.cuda.device(0):
        dst = torch.empty(10007, dtype=torch.float16, device="cuda:1")
        kernels.pack(dst, values.to("cuda:1"))
        assert torch.cuda.current_device() == 0, "the call must restore the current device"
        torch.cuda.synchronize(1)
        assert_bitwise(dst, want, "pack on cuda:1 with cuda:0 current")
        with pytest.raises(ValueError, match=r"sum16: inout is on cuda:0 but src is on cuda:1"):
            kernels.sum16(torch.zeros(4, dtype=torch.bfloat16, device="cuda:0"),
                     torch.zeros(4, dtype=torch.bfloat16, device="cuda:1"))


@pytest.mark.skipif(_C.cuda_available(), reason="mpidp's CUDA kernels run here")
def test_without_usable_cuda_kernels_calls_fail_cleanly():
    with pytest.raises((NotImplementedError, RuntimeError), match=r"pack: .*(without CUDA|CUDA|cuda)"):
        kernels.pack(torch.empty(4, dtype=torch.bfloat16, device=DEV), torch.zeros(4, device=DEV))


# --- the 8-bit block quantizer ---------------------------------------------------------


@kernels_run
@pytest.mark.parametrize("n", [1, 255, 256, 257, 4099, 1 << 20])
@pytest.mark.parametrize("scale", [1.0, -0.375])
def test_quant8_bit_identical_to_cpu_ref(n, scale):
    """Records from quantize8 and values from dequantize8 (plain and
    accumulating) equal the CPU reference's, over random bit patterns (NaN and
    infinity blocks included) mixed with ordinary numbers."""
    x = random_f32_bits(n, seed=n)
    x[::2] = realistic_f32(len(x[::2]), seed=n + 1)
    want_q = torch.empty(kernels.quant8_bytes(n), dtype=torch.uint8)
    kernels.quantize8(want_q, x, scale, path="ref")
    got_q = torch.empty(kernels.quant8_bytes(n), dtype=torch.uint8, device=DEV)
    kernels.quantize8(got_q, x.to(DEV), scale)
    torch.cuda.synchronize()
    assert torch.equal(got_q.cpu(), want_q), "quantize8: records differ from the CPU reference"
    for accumulate in (False, True):
        base = realistic_f32(n, seed=n + 2)
        want = base.clone()
        kernels.dequantize8(want, want_q, accumulate=accumulate, path="ref")
        got = base.to(DEV)
        kernels.dequantize8(got, want_q.to(DEV), accumulate=accumulate)
        assert_bitwise(got, want, f"dequantize8(accumulate={accumulate})")
