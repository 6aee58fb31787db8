"""The bf16/fp16 conversion kernels (mpidp.kernels.pack / unpack / sum16) on the CPU.

Single-process tests (marked `serial`: they run once, in the 1-rank pass):
  - the reference path ("ref") against torch: the casts of Tensor.to(bfloat16 /
    float16) and the widening of .to(float32), bit for bit except that a NaN
    only has to stay a NaN (torch keeps or invents payloads: its vectorised
    bf16 cast writes 0xFFFF), and every NaN mpidp writes is the canonical one;
  - the fused forms (scale, ref, a/b/c) against the same torch operations in
    the fp32 order that mpidp/pack.h documents, and sum16 against "widen, add
    in fp32, round once";
  - every SIMD path this CPU runs against "ref", bit for bit (NaNs included),
    on random bit patterns, odd lengths and unaligned views, with nothing
    written outside the destination view and, for a == 0, nothing read from it;
  - MPIDP_SIMD forcing a path at import, in fresh processes;
  - bad arguments give a TypeError/ValueError that names the argument, and the
    CUDA dispatch of the glue, exercised with fake CUDA DLPack producers where
    no GPU can run anything (tests/engines/test_cuda_kernels.py runs the real thing).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest
import torch

import mpidp
from mpidp import _C, kernels
from mpi_jobs import ROOT, clean_env

pytestmark = pytest.mark.serial

HALVES = [torch.bfloat16, torch.float16]
HALF_IDS = ["bf16", "fp16"]
CANON_NAN16 = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
CANON_NAN32 = 0x7FC00000


# --- bit helpers ----------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a 16- or 32-bit tensor as non-negative int64."""
    if t.element_size() == 2:
        return t.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    return t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def from_bits32(u) -> torch.Tensor:
    """fp32 tensor from a list/tensor of 32-bit patterns."""
    u = torch.as_tensor(u, dtype=torch.int64)
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def from_bits16(u, dtype) -> torch.Tensor:
    u = torch.as_tensor(u, dtype=torch.int64)
    return torch.where(u >= 2**15, u - 2**16, u).to(torch.int16).view(dtype)


def random_f32_bits(n: int, seed: int) -> torch.Tensor:
    """Uniform random 32-bit patterns as fp32: every exponent, ~0.4% NaNs, infinities
    and subnormals are rare but present at this size."""
    return torch.randint(-2**31, 2**31, (n,), generator=gen(seed), dtype=torch.int64) \
        .to(torch.int32).view(torch.float32)


def random_16_bits(n: int, seed: int, dtype) -> torch.Tensor:
    return torch.randint(-2**15, 2**15, (n,), generator=gen(seed), dtype=torch.int64) \
        .to(torch.int16).view(dtype)


def all_16_bits(dtype) -> torch.Tensor:
    """Every one of the 65536 bit patterns."""
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def realistic_f32(n: int, seed: int) -> torch.Tensor:
    """Gaussian values over many magnitudes (1e-40 .. 1e6), both signs."""
    g = gen(seed)
    mag = torch.pow(10.0, torch.randint(-40, 7, (n,), generator=g).double())
    return (torch.randn(n, generator=g, dtype=torch.float64) * mag).float()


# Special fp32 inputs, as bit patterns, with what makes each one interesting.
SPECIAL_F32 = [
    0x00000000, 0x80000000,              # +-0
    0x00000001, 0x80000001,              # smallest subnormals
    0x007FFFFF, 0x00400000, 0x00008000,  # subnormals (largest, mid, bf16 tie)
    0x00018000, 0x00028000,              # subnormal ties: round up to odd->even / stay
    0x00800000, 0x80800000,              # smallest normals
    0x3F800000, 0xBF800000,              # +-1
    0x3F808000, 0x3F818000,              # bf16 ties: to even (down), to even (up)
    0x3F807FFF, 0x3F808001,              # just below / above a bf16 tie
    0x3F801000, 0x3F803000,              # fp16 ties (bit 13): down to even, up to even
    0x7F7FFFFF, 0xFF7FFFFF,              # +-FLT_MAX: bf16 rounds to +-inf
    0x7F7F7FFF, 0x7F7F8000,              # largest value staying finite in bf16 / tie -> inf
    0x7F800000, 0xFF800000,              # +-inf
    0x7FC00000, 0xFFC00000,              # quiet NaNs
    0x7F800001, 0xFF800001,              # signalling NaNs with low payload (must not become inf)
    0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF,  # more NaN payloads
    0x7FFF8000, 0x7F80FFFF,              # NaNs whose plain bf16 rounding would carry
    0x477FE000, 0xC77FE000,              # +-65504, the largest finite fp16
    0x477FEFFF, 0x477FF000, 0x477FF001,  # just below the fp16 overflow tie, the tie, above
    0x47800000, 0x4F000000,              # 65536, 2^31: fp16 overflow
    0x38800000, 0x387FFFFF, 0x387FF000,  # 2^-14 (smallest normal fp16) and just below
    0x33800000, 0x33000000, 0x33000001,  # 2^-24 (smallest fp16 subnormal), 2^-25 (tie -> 0), above
    0x32FFFFFF, 0xB3000000,              # below the tie -> +0, -2^-25 -> -0
    0x33C00000, 0x34200000,              # 1.5 and 2.5 * 2^-24: subnormal ties to even
    0x3A800800, 0x3A801800,              # fp16 subnormal ties in the upper range
    0x40490FDB, 0xC2F6E979,              # pi, -123.456
]


def special_f32() -> torch.Tensor:
    return from_bits32(SPECIAL_F32)


def special_16(dtype) -> torch.Tensor:
    common = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x3F80, 0xBF80,
              0x7BFF, 0xFBFF, 0x7F7F, 0xFF7F]
    if dtype == torch.bfloat16:
        specials = [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7FFF, 0x0080, 0x007F]
    else:
        specials = [0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0xFFFF, 0x7FFF, 0x0200, 0x3555]
    return from_bits16(common + specials, dtype)


def fmt(x: torch.Tensor, i: int) -> str:
    return f"0x{int(bits(x[i:i + 1])[0]):0{x.element_size() * 2}x} ({x[i].item()!r})"


def assert_matches_torch(got, want, inputs, what):
    """Bitwise equality except where `want` is NaN, where `got` must be NaN too
    (and canonical: mpidp's kernels write only canonical NaNs)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got_nan, want_nan = torch.isnan(got.float()), torch.isnan(want.float())
    bad = torch.nonzero(got_nan != want_nan).flatten()
    if len(bad):
        i = int(bad[0])
        raise AssertionError(f"{what}: NaN-ness differs at {i} of {len(bad)} places: inputs "
                             f"{[fmt(x, i) for x in inputs]}, got {fmt(got, i)}, torch {fmt(want, i)}")
    bad = torch.nonzero((bits(got) != bits(want)) & ~want_nan).flatten()
    if len(bad):
        i = int(bad[0])
        raise AssertionError(f"{what}: {len(bad)} results differ from torch, first at {i}: "
                             f"inputs {[fmt(x, i) for x in inputs]}, got {fmt(got, i)}, "
                             f"torch {fmt(want, i)}")
    canon = CANON_NAN32 if got.element_size() == 4 else CANON_NAN16[got.dtype]
    nan_bits = bits(got)[got_nan]
    assert torch.all(nan_bits == canon), f"{what}: non-canonical NaN {int(nan_bits[nan_bits != canon][0]):#x}"


def f32(x: float) -> torch.Tensor:
    """x rounded to fp32, as a 0-dim tensor (what the C glue passes to the kernels)."""
    return torch.tensor(x, dtype=torch.float32)


# --- the reference path against torch ---------------------------------------------


def pack_inputs(seed: int) -> torch.Tensor:
    return torch.cat([special_f32(), random_f32_bits(1 << 20, seed), realistic_f32(1 << 16, seed + 1)])


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_pack_ref_matches_torch_cast(dtype):
    src = pack_inputs(1)
    dst = torch.empty(src.shape, dtype=dtype)
    kernels.pack(dst, src, path="ref")
    assert_matches_torch(dst, src.to(dtype), [src], f"pack to {dtype}")
    # torch's scalar (non-vectorised) cast too: element by element for the specials.
    sp = special_f32()
    one = torch.empty(1, dtype=dtype)
    for i in range(len(sp)):
        kernels.pack(one, sp[i:i + 1], path="ref")
        assert_matches_torch(one, sp[i:i + 1].to(dtype), [sp[i:i + 1]], f"pack to {dtype}, scalar")


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_unpack_ref_matches_torch_widening(dtype):
    src = all_16_bits(dtype)
    dst = torch.full(src.shape, 12345.0)
    kernels.unpack(dst, src, path="ref")
    assert_matches_torch(dst, src.to(torch.float32), [src], f"unpack from {dtype}")


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_sum16_ref_matches_widen_add_round(dtype):
    # Every 16-bit pattern against random partners and against itself reversed,
    # random pairs, and every pair of specials.
    every = all_16_bits(dtype)
    sp = special_16(dtype)
    x = torch.cat([every, every, random_16_bits(1 << 20, 2, dtype), sp.repeat_interleave(len(sp))])
    y = torch.cat([random_16_bits(1 << 16, 3, dtype), every.flip(0), random_16_bits(1 << 20, 4, dtype),
                   sp.repeat(len(sp))])
    want = (y.float() + x.float()).to(dtype)
    inout = y.clone()
    kernels.sum16(inout, x, path="ref")
    assert_matches_torch(inout, want, [y, x], f"sum16 {dtype}")


SCALES = [1.0, 0.5, 1 / 3, -7.25, 1e-30, 3e37, float("inf")]


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
@pytest.mark.parametrize("with_ref", [False, True], ids=["src", "src-ref"])
@pytest.mark.parametrize("scale", SCALES)
def test_fused_pack_matches_torch_order(dtype, with_ref, scale):
    """pack: t = src; t = t - ref (if ref); t = t * scale (if scale != 1); round."""
    n = 1 << 16
    src = torch.cat([special_f32(), realistic_f32(n, 5), random_f32_bits(4096, 6)])
    ref = torch.cat([special_f32().flip(0), realistic_f32(n, 7), realistic_f32(4096, 8)]) \
        if with_ref else None
    t = src.clone()
    if ref is not None:
        t = t - ref
    if float(f32(scale)) != 1.0:
        t = t * f32(scale)
    want = t.to(dtype)
    dst = torch.empty(src.shape, dtype=dtype)
    kernels.pack(dst, src, ref, scale, path="ref")
    assert_matches_torch(dst, want, [src] + ([ref] if with_ref else []),
                         f"pack to {dtype}, scale {scale}, ref {with_ref}")


ABC = [(0.0, 1.0, 0.0), (0.9, 0.1, 0.0), (0.5, 2.0, -1.0), (0.0, 1.0, 1.0), (1.0, 1.0, 0.0),
       (-0.25, 3.0, 0.125), (0.0, -0.5, 0.0), (2.0, 0.0, 1.0)]


@pytest.mark.parametrize("src_dtype", HALVES + [torch.float32], ids=HALF_IDS + ["fp32"])
@pytest.mark.parametrize("with_ref", [False, True], ids=["noref", "ref"])
@pytest.mark.parametrize("a,b,c", ABC)
def test_fused_unpack_matches_torch_order(src_dtype, with_ref, a, b, c):
    """unpack: t = b*w; t = (a*dst) + t (if a != 0); t = t + (c*ref) (if ref)."""
    n = 1 << 15
    if src_dtype == torch.float32:
        src = torch.cat([special_f32(), realistic_f32(n, 9)])
    else:
        src = torch.cat([special_16(src_dtype), all_16_bits(src_dtype)[::2],
                         realistic_f32(4096, 9).to(src_dtype)])
    m = len(src)
    dst0 = torch.cat([special_f32(), realistic_f32(m, 10)])[:m].flip(0).contiguous()
    ref = torch.cat([realistic_f32(m - 40, 11), special_f32()])[:m] if with_ref else None
    w = src.float()
    t = w * f32(b)
    if a != 0.0:
        t = (dst0 * f32(a)) + t
    if ref is not None:
        t = t + (ref * f32(c))
    dst = dst0.clone()
    kernels.unpack(dst, src, ref, a, b, c, path="ref")
    assert_matches_torch(dst, t, [src, dst0] + ([ref] if with_ref else []),
                         f"unpack from {src_dtype}, a={a} b={b} c={c}, ref {with_ref}")


def test_unpack_with_a_zero_ignores_dst():
    src = realistic_f32(1000, 12).to(torch.bfloat16)
    want = torch.empty(1000)
    kernels.unpack(want, src, path="ref")
    dst = torch.full((1000,), float("nan"))
    kernels.unpack(dst, src, path="ref")
    assert torch.equal(bits(dst), bits(want))


# --- every SIMD path against the reference -------------------------------------------

LENGTHS = [0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 65, 127, 129, 1023, 1025, 4099]
OFFSETS = [0, 1, 2, 3]
GUARD = 8


def other_paths():
    return [p for p in _C.simd_paths() if p != "ref"]


def kernel_cases():
    """(name, function(tensors..., path), argument kinds) of every kernel variant."""
    cases = []
    for dt, dn in zip(HALVES, HALF_IDS):
        for with_ref in (False, True):
            for s in (1.0, 0.5, -1 / 3, 1e-30, 3e37):
                cases.append((f"pack-{dn}-ref{int(with_ref)}-s{s:g}", "pack", dt, with_ref, (s,)))
    for dt, dn in zip(HALVES + [torch.float32], HALF_IDS + ["fp32"]):
        for a, b, c in ABC:
            for with_ref in ((False, True) if (a, b) != (2.0, 0.0) else (True,)):
                cases.append((f"unpack-{dn}-a{a:g}-b{b:g}-c{c:g}-ref{int(with_ref)}", "unpack",
                              dt, with_ref, (a, b, c)))
    for dt, dn in zip(HALVES, HALF_IDS):
        cases.append((f"sum16-{dn}", "sum16", dt, False, ()))
    return cases


def run_case(kind, dt, with_ref, params, n, off, seed, path, dst_seed):
    """Runs one kernel on views at element offsets into guarded buffers; returns
    every buffer (guards included) after the call."""
    offs = [off, (3 * off + 1) % 4, (off + 2) % 4]  # independent alignments per argument

    def buf(make, k):
        b = make(n + 2 * GUARD)
        return b, b[GUARD - offs[k] + 0: GUARD - offs[k] + n] if n else b[:0]

    rnd32 = lambda m, s: random_f32_bits(m, s)  # noqa: E731
    rnd16 = lambda m, s: random_16_bits(m, s, dt)  # noqa: E731
    if kind == "pack":
        dbuf, d = buf(lambda m: random_16_bits(m, dst_seed, dt), 0)
        sbuf, s_ = buf(lambda m: rnd32(m, seed), 1)
        rbuf, r = buf(lambda m: rnd32(m, seed + 1), 2) if with_ref else (None, None)
        kernels.pack(d, s_, r, params[0], path=path)
        return [dbuf, sbuf] + ([rbuf] if with_ref else [])
    if kind == "unpack":
        dbuf, d = buf(lambda m: rnd32(m, dst_seed), 0)
        sbuf, s_ = buf(lambda m: (rnd32(m, seed) if dt == torch.float32 else rnd16(m, seed)), 1)
        rbuf, r = buf(lambda m: rnd32(m, seed + 1), 2) if with_ref else (None, None)
        a, b, c = params
        kernels.unpack(d, s_, r, a, b, c, path=path)
        return [dbuf, sbuf] + ([rbuf] if with_ref else [])
    ibuf, io = buf(lambda m: rnd16(m, dst_seed), 0)
    sbuf, s_ = buf(lambda m: rnd16(m, seed), 1)
    kernels.sum16(io, s_, path=path)
    return [ibuf, sbuf]


@pytest.mark.skipif(not other_paths(), reason="this CPU runs only the reference path")
@pytest.mark.parametrize("path", other_paths() or ["none"])
@pytest.mark.parametrize("case", kernel_cases(), ids=[c[0] for c in kernel_cases()])
def test_path_bit_identical_to_ref(path, case):
    name, kind, dt, with_ref, params = case
    for n in LENGTHS:
        for off in OFFSETS:
            seed = 1000 * n + off
            want = run_case(kind, dt, with_ref, params, n, off, seed, "ref", 7)
            # With a == 0 unpack must not read dst: give the SIMD path other garbage there.
            reads_dst = kind != "unpack" or params[0] != 0.0
            got = run_case(kind, dt, with_ref, params, n, off, seed, path, 7 if reads_dst else 8)
            for k, (g, w) in enumerate(zip(got, want)):
                if not reads_dst and k == 0:
                    # Only the view is defined; the guards must be the path's own garbage.
                    o = GUARD - off
                    g_view, w_view = g[o:o + n], w[o:o + n]
                    assert torch.equal(bits(g_view), bits(w_view)), _first_diff(
                        name, path, n, off, g_view, w_view)
                    before = run_case_initial(kind, dt, n, 8)
                    assert torch.equal(bits(torch.cat([g[:o], g[o + n:]])),
                                       bits(torch.cat([before[:o], before[o + n:]]))), (
                        f"{name} on {path}, n={n}, offset {off}: wrote outside the view")
                else:
                    assert torch.equal(bits(g), bits(w)), _first_diff(name, path, n, off, g, w)
    # One length above the GIL-releasing threshold (2^16 elements).
    n = (1 << 16) + 3
    want = run_case(kind, dt, with_ref, params, n, 1, 99, "ref", 7)
    got = run_case(kind, dt, with_ref, params, n, 1, 99, path, 7)
    assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want)), name


def run_case_initial(kind, dt, n, dst_seed):
    """The destination buffer of run_case before the call."""
    return random_f32_bits(n + 2 * GUARD, dst_seed)


def _first_diff(name, path, n, off, g, w):
    i = int(torch.nonzero(bits(g) != bits(w)).flatten()[0])
    return (f"{name}: path {path} differs from ref at n={n}, offset {off}, buffer index {i} "
            f"(view index {i - GUARD + off}): got {fmt(g, i)}, ref {fmt(w, i)}")


def test_simd_paths_and_current_path():
    paths = _C.simd_paths()
    assert paths[0] == "ref"
    assert mpidp.simd_path() in paths
    assert mpidp.simd_path() == _C.simd_path()
    assert _C.simd_fallback_reason() == ""


# --- MPIDP_SIMD ---------------------------------------------------------------------


def import_with_simd(value: str):
    code = "import mpidp; print('PATH=' + mpidp.simd_path())"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(MPIDP_SIMD=value),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)


def cpu_has(path: str) -> bool:
    return path in _C.simd_paths()


@pytest.mark.parametrize("value", ["ref", "avx2", "avx512"])
def test_mpidp_simd_forces_a_path(value):
    proc = import_with_simd(value)
    family = {"ref": ("ref",), "avx2": ("avx2",), "avx512": ("avx512", "avx512_bf16")}[value]
    if value == "ref" or cpu_has(value):
        assert proc.returncode == 0, proc.stdout
        got = proc.stdout.split("PATH=")[-1].split()[0]
        assert got in family, proc.stdout
        if value == "avx512":
            # The AVX512_BF16 variant exactly when the CPU has it.
            assert (got == "avx512_bf16") == cpu_has("avx512_bf16"), proc.stdout
    else:
        assert proc.returncode != 0, proc.stdout
        assert "ImportError" in proc.stdout, proc.stdout
        assert f"MPIDP_SIMD={value}" in proc.stdout, proc.stdout
        lacks = "AVX-512" if value == "avx512" else "AVX"
        assert lacks in proc.stdout, proc.stdout


def test_mpidp_simd_unknown_value():
    proc = import_with_simd("sse9")
    assert proc.returncode != 0 and "ImportError" in proc.stdout, proc.stdout
    assert "MPIDP_SIMD=sse9" in proc.stdout and "ref, avx2" in proc.stdout, proc.stdout


# --- bad arguments ---------------------------------------------------------------------


def bf(n=4):
    return torch.zeros(n, dtype=torch.bfloat16)


def fp(n=4):
    return torch.zeros(n, dtype=torch.float16)


def f(n=4):
    return torch.zeros(n)


def read_only_f32():
    a = np.zeros(4, np.float32)
    a.setflags(write=False)
    return a


BAD_CALLS = [
    ("pack dst fp32", lambda: kernels.pack(f(), f()), TypeError, r"dst: unexpected dtype float32"),
    ("pack src bf16", lambda: kernels.pack(bf(), bf()), TypeError, r"src: unexpected dtype bfloat16"),
    ("pack ref fp16", lambda: kernels.pack(bf(), f(), fp()), TypeError, r"ref: unexpected dtype float16"),
    ("pack int dst", lambda: kernels.pack(torch.zeros(4, dtype=torch.int16), f()), TypeError, r"dst: .*int16"),
    ("pack list", lambda: kernels.pack([0.0], f()), TypeError, r"dst: expected a tensor"),
    ("pack sizes", lambda: kernels.pack(bf(3), f(4)), ValueError, r"pack: tensors differ in size"),
    ("pack ref size", lambda: kernels.pack(bf(4), f(4), f(5)), ValueError, r"pack: tensors differ in size"),
    ("pack strided src", lambda: kernels.pack(bf(4), f(8)[::2]), ValueError, r"src: .*contiguous"),
    ("pack requires grad", lambda: kernels.pack(bf(), torch.zeros(4, requires_grad=True)), ValueError,
     r"src: .*gradient"),
    ("pack scale str", lambda: kernels.pack(bf(), f(), scale="2"), TypeError, r"scale: expected a real number"),
    ("pack path int", lambda: kernels.pack(bf(), f(), path=2), TypeError, r"path: expected a str"),
    ("pack path unknown", lambda: kernels.pack(bf(), f(), path="sse9"), ValueError, r"path: .*sse9"),
    ("pack stream on cpu", lambda: kernels.pack(bf(), f(), stream=0), ValueError, r"stream: only CUDA"),
    ("pack unknown kw", lambda: kernels.pack(bf(), f(), scal=2.0), TypeError, r"scal"),
    ("unpack dst bf16", lambda: kernels.unpack(bf(), bf()), TypeError, r"dst: unexpected dtype bfloat16"),
    ("unpack src f64", lambda: kernels.unpack(f(), torch.zeros(4, dtype=torch.float64)), TypeError,
     r"src: unexpected dtype float64"),
    ("unpack read-only dst", lambda: kernels.unpack(read_only_f32(), bf()), ValueError, r"dst: .*writable"),
    ("unpack a str", lambda: kernels.unpack(f(), bf(), a="x"), TypeError, r"a: expected a real number"),
    ("unpack b None", lambda: kernels.unpack(f(), bf(), b=None), TypeError, r"b: expected a real number"),
    ("unpack c list", lambda: kernels.unpack(f(), bf(), f(), c=[1]), TypeError, r"c: expected a real number"),
    ("unpack sizes", lambda: kernels.unpack(f(5), bf(4)), ValueError, r"unpack: tensors differ in size"),
    ("unpack stream on cpu", lambda: kernels.unpack(f(), bf(), stream=1), ValueError, r"stream: only CUDA"),
    ("sum16 mixed dtypes", lambda: kernels.sum16(bf(), fp()), TypeError,
     r"sum16: inout and src must have the same dtype"),
    ("sum16 fp32", lambda: kernels.sum16(f(), f()), TypeError, r"inout: unexpected dtype float32"),
    ("sum16 sizes", lambda: kernels.sum16(bf(4), bf(3)), ValueError, r"sum16: tensors differ in size"),
    ("sum16 path unknown", lambda: kernels.sum16(bf(), bf(), path="x86"), ValueError, r"path: "),
    ("sum16 missing arg", lambda: kernels.sum16(bf()), TypeError, r"src"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_path_the_cpu_lacks_names_the_instruction_set():
    for path in ("avx2", "avx512", "avx512_bf16"):
        if not cpu_has(path):
            with pytest.raises(ValueError, match=r"path: .*(lacks|no).*"):
                kernels.pack(bf(), f(), path=path)


def test_numpy_arrays_are_accepted():
    src = np.linspace(-3, 3, 11, dtype=np.float32)
    dst = np.zeros(11, np.float32)
    kernels.unpack(dst, src, None, 0.0, 2.0)
    assert np.array_equal(dst, 2 * src)


# --- the CUDA dispatch of the glue, without a GPU ------------------------------------------
# A fake producer exports host memory labelled as CUDA memory through DLPack. Where
# mpidp can run no CUDA kernel (built without CUDA, or no usable device), every call
# that passes the argument checks must reach mpidp_cuda_* and fail there, cleanly,
# before anything could touch the memory.


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeCudaTensor:
    """A legacy DLPack producer that claims `host`'s memory is on cuda:device_id.
    The capsule has no destructor and the struct lives as long as this object."""

    CODES = {torch.float32: (2, 32), torch.bfloat16: (4, 16), torch.float16: (2, 16)}

    def __init__(self, host: torch.Tensor, device_id: int = 0):
        self.host = host
        self.device_id = device_id
        self._shape = (ctypes.c_int64 * 1)(host.numel())
        code, nbits = self.CODES[host.dtype]
        self._m = _DLManagedTensor()
        self._m.dl_tensor = _DLTensor(host.data_ptr(), _DLDevice(2, device_id), 1,
                                      _DLDataType(code, nbits, 1), self._shape, None, 0)
        self._m.deleter = ctypes.cast(None, _DELETER)

    def __dlpack_device__(self):
        return (2, self.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return _capsule_new(ctypes.addressof(self._m), b"dltensor", None)


def cuda(t, device_id=0):
    return FakeCudaTensor(t, device_id)


no_cuda_kernels = pytest.mark.skipif(
    _C.cuda_available(), reason="a CUDA device is usable here: fake device pointers could be "
                                "launched on (tests/engines/test_cuda_kernels.py covers CUDA)")


@no_cuda_kernels
@pytest.mark.parametrize("stream", [None, 0])
@pytest.mark.parametrize("call,kernel", [
    (lambda s: kernels.pack(cuda(bf()), cuda(f()), stream=s), "pack_bf16"),
    (lambda s: kernels.pack(cuda(fp()), cuda(f()), cuda(f()), 0.5, stream=s), "pack_fp16"),
    (lambda s: kernels.unpack(cuda(f()), cuda(bf()), stream=s), "unpack_bf16"),
    (lambda s: kernels.unpack(cuda(f()), cuda(fp()), None, 1.0, stream=s), "unpack_fp16"),
    (lambda s: kernels.unpack(cuda(f()), cuda(f()), cuda(f()), 0.5, 0.5, 1.0, stream=s), "merge_f32"),
    (lambda s: kernels.sum16(cuda(bf()), cuda(bf()), stream=s), "sum_bf16"),
    (lambda s: kernels.sum16(cuda(fp()), cuda(fp()), stream=s), "sum_fp16"),
], ids=["pack_bf16", "pack_fp16", "unpack_bf16", "unpack_fp16", "merge_f32", "sum_bf16", "sum_fp16"])
def test_cuda_tensors_reach_the_cuda_kernels(call, kernel, stream):
    with pytest.raises((NotImplementedError, RuntimeError)) as info:
        call(stream)
    msg = str(info.value)
    if info.type is NotImplementedError:
        assert "built without CUDA" in msg
    else:
        # Built with CUDA, but no usable device: the launch itself fails.
        assert f"mpidp_cuda_{kernel}" in msg and "launch failed" in msg, msg


FAKE_BAD_CALLS = [
    ("cuda dst, cpu src", lambda: kernels.pack(cuda(bf()), f()), ValueError,
     r"pack: dst is on cuda:0 but src is on cpu"),
    ("cpu dst, cuda src", lambda: kernels.unpack(f(), cuda(bf())), ValueError,
     r"unpack: dst is on cpu but src is on cuda:0"),
    ("cuda ref on cpu call", lambda: kernels.pack(bf(), f(), cuda(f())), ValueError,
     r"pack: dst is on cpu but ref is on cuda:0"),
    ("two cuda devices", lambda: kernels.sum16(cuda(bf(), 0), cuda(bf(), 1)), ValueError,
     r"sum16: inout is on cuda:0 but src is on cuda:1"),
    ("path with cuda", lambda: kernels.pack(cuda(bf()), cuda(f()), path="ref"), ValueError,
     r"path: selects a CPU kernel path"),
    ("stream str", lambda: kernels.pack(cuda(bf()), cuda(f()), stream="0"), TypeError,
     r"stream: expected an int"),
    ("stream bool", lambda: kernels.sum16(cuda(bf()), cuda(bf()), stream=True), TypeError,
     r"stream: expected an int"),
    ("stream negative", lambda: kernels.unpack(cuda(f()), cuda(bf()), stream=-1), ValueError,
     r"stream: expected a cudaStream_t"),
    ("cuda dtype", lambda: kernels.pack(cuda(f()), cuda(f())), TypeError, r"dst: unexpected dtype float32"),
    ("cuda sizes", lambda: kernels.pack(cuda(bf(3)), cuda(f(4))), ValueError, r"tensors differ in size"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in FAKE_BAD_CALLS],
                         ids=[c[0] for c in FAKE_BAD_CALLS])
def test_cuda_argument_checks(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
