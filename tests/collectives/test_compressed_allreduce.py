"""bf16/fp16 allreduce: the native half sum op and fp32 tensors compressed on the wire.

Rank-agnostic (1, 2, 3 and 4 ranks; every test is also marked `ranks3`): each
rank reduces its own data, drawn from a seed that depends on the rank, and
every rank regenerates every other rank's data to compute the reference
itself, in float64, independently of MPI. What is checked:
  - the native op on bf16/fp16 tensors: at 1 rank the tensor is untouched; at
    2 ranks the result is exactly the correctly rounded sum (one fp32 addition,
    one rounding); at any size within `size` ulps of the exact sum (below);
    every rank gets the same bits;
  - inf and NaN: a NaN anywhere -> NaN (canonical at > 1 rank); +inf alone ->
    +inf; +inf and -inf -> NaN; finite values whose sum overflows -> inf;
  - "avg" exactly as mpidp defines it: every rank's values are scaled by
    fp32(1/size) and rounded (to the tensor's 16-bit dtype, or to the wire
    dtype in the same pass as packing for fp32 tensors) before the sum;
  - sizes that are not multiples of any vector width, and fp32 tensors crossing
    the 2^22-element wire chunks (more chunks than the 2 kept in flight);
  - async Work;
  - DataParallel with wire_dtype against a single-process fp32 reference.

The error bound. A reduction over `size` ranks adds `size` 16-bit numbers
with size - 1 additions, each done in fp32 and rounded once to the 16-bit
format: an error of at most half an ulp of that partial sum. Every partial sum
is at most S = sum_r |x_r| in magnitude (plus rounding, which can only carry it
into the next binade), so the total error is at most
(size - 1) * 1/2 * 2 ulp(S) < size * ulp(S), where ulp(S) is the spacing of
the 16-bit format at S's binade (its subnormal spacing below the normal range).
With inputs of one sign S is the exact sum itself.
"""

from __future__ import annotations

import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import mpidp
from mpi_jobs import clean_env
from dp_reference import (RANK, SIZE, assert_same_on_all_ranks, data_parallel_and_reference,
                          on_device, rank_slice, seeded)
from dp_reference import MLP

pytestmark = pytest.mark.ranks3

COMM = MPI.COMM_WORLD
HALVES = [torch.bfloat16, torch.float16]
HALF_IDS = ["bf16", "fp16"]
# (mantissa bits, smallest normal exponent) of the 16-bit formats.
FORMAT = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}
CANON_NAN16 = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
SIZES = [1, 7, 15, 17, 1023, (1 << 22) + 3]
WIRE_CHUNK = 1 << 22  # csrc/py/collectives.c: elements per compressed MPI call


# --- data every rank can regenerate ----------------------------------------------------


def rank_values(rank: int, n: int, seed: int, positive: bool = False) -> torch.Tensor:
    """Rank `rank`'s fp32 values: random sign (unless `positive`) times 1..2 times
    2^k, k in -12..11. No sum of 4 of them overflows fp16, and dividing any of
    them, or any (rounded) sum of them, by 2 or 4 is exact in both formats:
    results are either normal or multiples of the smallest fp16 subnormal,
    because every such sum is a multiple of 2^-22. So with a power-of-two size,
    prescaling by 1/size commutes with the summation exactly."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = (1 + torch.rand(n, generator=g)) * torch.exp2(torch.randint(-12, 12, (n,), generator=g).float())
    if not positive:
        x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
    return x


def rank_data(rank: int, n: int, dtype, seed: int, positive: bool = False) -> torch.Tensor:
    """Rank `rank`'s input as `dtype` (rounded to nearest even)."""
    return rank_values(rank, n, seed, positive).to(dtype)


def all_rank_data(n, dtype, seed, positive=False):
    return [rank_data(r, n, dtype, seed, positive) for r in range(SIZE)]


def bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


def ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of `dtype` numbers at |x| (float64 in, float64 out)."""
    mant, emin = FORMAT[dtype]
    _, e = torch.frexp(x.abs())          # |x| = m * 2^e, 0.5 <= m < 1
    e = torch.where(x == 0, emin, torch.clamp(e - 1, min=emin))
    return torch.ldexp(torch.ones_like(x), e - mant)


def assert_same_bits_on_all_ranks(t: torch.Tensor, what: str) -> None:
    mine = t.contiguous().view(torch.uint8).numpy().copy()
    theirs = mine.copy()
    COMM.Bcast(theirs, root=0)
    assert np.array_equal(mine, theirs), f"{what}: rank {RANK}'s result differs from rank 0's"


def assert_reduced_sum(result: torch.Tensor, inputs: list, dtype, what: str) -> None:
    """`result` (dtype, or fp32 holding dtype values) is a correct reduction of
    `inputs` (one dtype tensor per rank), as the module docstring defines."""
    xs = [x.double() for x in inputs]      # exact: every 16-bit value is a float64
    exact = sum(xs)
    res = result.double()
    nan = torch.isnan(exact)
    assert torch.equal(torch.isnan(res), nan), (
        f"{what}: NaN at {torch.nonzero(torch.isnan(res) != nan).flatten()[:5].tolist()} "
        f"differs from the exact sum")
    rounded = exact.to(dtype).double()      # overflows to inf where the format does
    inf = torch.isinf(rounded) & ~nan
    assert torch.equal(res[inf], rounded[inf]), f"{what}: infinities differ from the exact sum"
    fin = ~nan & ~inf
    err = (res[fin] - exact[fin]).abs()
    bound = SIZE * ulp(sum(x.abs() for x in xs)[fin], dtype)
    bad = torch.nonzero(err > bound).flatten()
    if len(bad):
        i = int(bad[0])
        raise AssertionError(f"{what}: {len(bad)} elements further than {SIZE} ulps from the "
                             f"exact sum, e.g. got {res[fin][i].item()!r}, exact "
                             f"{exact[fin][i].item()!r}, bound {bound[i].item()!r}")
    if SIZE == 1:
        # One rank: nothing is added, the values come back untouched.
        assert torch.equal(result.to(dtype).view(torch.int16), inputs[0].view(torch.int16)), what
    elif SIZE == 2:
        # One addition, done in fp32 and rounded once: the correctly rounded sum.
        want = (inputs[1].float() + inputs[0].float()).to(dtype)
        assert torch.equal(bits16(result.to(dtype))[fin], bits16(want)[fin]), (
            f"{what}: at 2 ranks the result is not the correctly rounded sum")


# --- the native op on 16-bit tensors ---------------------------------------------------------


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
@pytest.mark.parametrize("n", SIZES)
def test_native_sum(dtype, n):
    inputs = all_rank_data(n, dtype, seed=n)
    t = inputs[RANK].clone()
    mpidp.allreduce(t)
    assert t.dtype == dtype and t.shape == (n,)
    assert_reduced_sum(t, inputs, dtype, f"{dtype} sum of {n}")
    assert_same_bits_on_all_ranks(t, f"{dtype} sum of {n}")


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_native_sum_of_positive_values_within_size_ulps_of_exact(dtype):
    # One sign: the bound is `size` ulps of the exact sum itself.
    inputs = all_rank_data(4099, dtype, seed=7, positive=True)
    t = inputs[RANK].clone()
    mpidp.allreduce(t)
    exact = sum(x.double() for x in inputs)
    assert torch.all((t.double() - exact).abs() <= SIZE * ulp(exact, dtype))


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_native_sum_keeps_subnormals(dtype):
    # Tiny values: sums of subnormals are exact, and nothing is flushed to zero.
    mant, emin = FORMAT[dtype]
    tiny = 2.0 ** (emin - mant)  # the smallest subnormal
    x = torch.tensor([tiny * (RANK + 1), -tiny, tiny * 3 * (RANK % 2)], dtype=torch.float64).to(dtype)
    t = x.clone()
    mpidp.allreduce(t)
    want = [tiny * SIZE * (SIZE + 1) / 2, -tiny * SIZE, tiny * 3 * (SIZE // 2)]
    assert t.double().tolist() == want


def special_inputs(rank: int, dtype) -> torch.Tensor:
    """Finite background values with specials planted at fixed indices."""
    inf, nan = float("inf"), float("nan")
    big = 2e38 if dtype == torch.bfloat16 else 40000.0
    x = rank_values(rank, 16, seed=99).double()
    last = SIZE - 1
    x[0] = nan if rank == 0 else x[0]                       # NaN on the first rank
    x[1] = nan if rank == last else x[1]                    # NaN on the last rank
    x[2] = inf if rank == 0 else x[2]                       # +inf alone
    x[3] = -inf if rank == last else x[3]                   # -inf alone
    x[4] = inf if rank == 0 else (-inf if rank == last else x[4])  # +inf and -inf (> 1 rank)
    x[5] = inf                                               # +inf everywhere
    x[6] = nan                                               # NaN everywhere
    x[7] = big                                               # overflows from 2 ranks on
    x[8] = nan if rank == 0 else -inf                        # NaN and -inf
    x[9] = -big
    out = x.to(dtype)
    if rank == 0:
        # A non-canonical NaN (negative, with payload) at index 10.
        out.view(torch.int16)[10] = (0xFFC1 if dtype == torch.bfloat16 else 0xFE01) - (1 << 16)
    return out


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_native_sum_inf_and_nan(dtype):
    inputs = [special_inputs(r, dtype) for r in range(SIZE)]
    t = inputs[RANK].clone()
    mpidp.allreduce(t)
    assert_reduced_sum(t, inputs, dtype, f"{dtype} specials")
    v = t.double()
    inf = float("inf")
    assert torch.isnan(v[[0, 1, 6, 8, 10]]).all()
    assert v[2] == inf and v[3] == -inf and v[5] == inf
    if SIZE == 1:
        assert v[4] == inf and torch.isfinite(v[[7, 9]]).all()
        # One rank: nothing is summed, so even the NaN payload is kept.
        assert torch.equal(t.view(torch.int16), inputs[0].view(torch.int16))
    else:
        assert torch.isnan(v[4]), "+inf + -inf must be NaN"
        assert v[7] == inf and v[9] == -inf, "an overflowing sum must become an infinity"
        # Every NaN the op writes is the canonical quiet NaN.
        nan_bits = bits16(t)[torch.isnan(v)]
        assert torch.all(nan_bits == CANON_NAN16[dtype]), [hex(b) for b in nan_bits.tolist()]
    assert_same_bits_on_all_ranks(t, f"{dtype} specials")


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
@pytest.mark.parametrize("n", [1, 17, 1023, 100003])
def test_native_avg(dtype, n):
    """avg of a 16-bit tensor: each rank's values are scaled by fp32(1/size) and
    rounded to the dtype, then summed with the native op."""
    inputs = all_rank_data(n, dtype, seed=n + 1)
    s = torch.tensor(1.0 / SIZE, dtype=torch.float32)
    avg = inputs[RANK].clone()
    mpidp.allreduce(avg, op="avg")
    prescaled = (inputs[RANK].float() * s).to(dtype)
    summed = prescaled.clone()
    mpidp.allreduce(summed, op="sum")
    assert torch.equal(avg.view(torch.int16), summed.view(torch.int16)), (
        "avg differs from the sum of the prescaled values")
    assert_reduced_sum(avg, [(x.float() * s).to(dtype) for x in inputs], dtype, f"{dtype} avg")
    if SIZE & (SIZE - 1) == 0:
        # A power of two scales exactly (no value here gets near the subnormals),
        # so avg is exactly the sum divided by size.
        total = inputs[RANK].clone()
        mpidp.allreduce(total)
        assert torch.equal(avg.view(torch.int16), (total.float() / SIZE).to(dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_native_sum_async_work(dtype):
    n = 70001
    a_in = all_rank_data(n, dtype, seed=11)
    b_in = all_rank_data(n, dtype, seed=12)
    a, b = a_in[RANK].clone(), b_in[RANK].clone()
    wa = mpidp.allreduce(a, async_op=True)
    wb = mpidp.allreduce(b, op="sum", async_op=True)
    assert isinstance(wa, mpidp.Work) and isinstance(wb, mpidp.Work)
    wb.wait()  # completing in the other order is fine
    wa.wait()
    assert wa.is_completed() and wb.is_completed()
    assert_reduced_sum(a, a_in, dtype, "async a")
    assert_reduced_sum(b, b_in, dtype, "async b")
    wa.wait()  # waiting twice is harmless


# --- fp32 tensors compressed on the wire --------------------------------------------------


def rank_f32(rank: int, n: int, seed: int) -> torch.Tensor:
    return rank_values(rank, n, seed)


@pytest.mark.parametrize("wire", HALVES, ids=HALF_IDS)
@pytest.mark.parametrize("n", SIZES + [2 * WIRE_CHUNK + 5])
def test_compressed_fp32_sum(wire, n):
    """Each rank's fp32 values are rounded to the wire dtype (as torch rounds them:
    nearest even), summed by the native op and widened back exactly."""
    x = rank_f32(RANK, n, seed=n + 2)
    t = x.clone()
    mpidp.allreduce(t, wire_dtype=wire)
    assert t.dtype == torch.float32 and t.shape == (n,)
    assert torch.equal(t.to(wire).float(), t), "the result must be exactly a wire-dtype value"
    rounded = [rank_f32(r, n, seed=n + 2).to(wire) for r in range(SIZE)]
    assert_reduced_sum(t, rounded, wire, f"fp32 via {wire}, {n} elements")
    assert_same_bits_on_all_ranks(t, f"fp32 via {wire}")


@pytest.mark.parametrize("wire", HALVES, ids=HALF_IDS)
@pytest.mark.parametrize("n", [7, 1023, WIRE_CHUNK + 3])
def test_compressed_fp32_avg(wire, n):
    """avg with a wire dtype: pack computes fp32(x * fp32(1/size)) and rounds
    that, in one pass; so avg is exactly the compressed sum of the prescaled
    fp32 values."""
    x = rank_f32(RANK, n, seed=n + 3)
    s = torch.tensor(1.0 / SIZE, dtype=torch.float32)
    avg = x.clone()
    mpidp.allreduce(avg, op="avg", wire_dtype=wire)
    summed = x * s
    mpidp.allreduce(summed, op="sum", wire_dtype=wire)
    assert torch.equal(avg, summed), "avg differs from the compressed sum of x * fp32(1/size)"
    assert_reduced_sum(avg, [(rank_f32(r, n, seed=n + 3) * s).to(wire) for r in range(SIZE)],
                       wire, f"fp32 avg via {wire}")
    if SIZE & (SIZE - 1) == 0:
        total = x.clone()
        mpidp.allreduce(total, wire_dtype=wire)
        assert torch.equal(avg, total / SIZE)


def test_compressed_fp32_inf_and_nan():
    x = rank_f32(RANK, 8, seed=5)
    x[0] = float("nan") if RANK == 0 else x[0]
    x[1] = float("inf") if RANK == SIZE - 1 else x[1]
    x[2] = float("inf") if RANK == 0 else (float("-inf") if RANK == SIZE - 1 else x[2])
    x[3] = 3e38 if SIZE > 1 else x[3]  # fits fp32, not a sum of two in bf16
    mpidp.allreduce(x, wire_dtype=torch.bfloat16)
    assert torch.isnan(x[0]) and x[1] == float("inf")
    if SIZE > 1:
        assert torch.isnan(x[2]) and x[3] == float("inf")
        assert x.view(torch.int32)[0].item() == 0x7FC00000  # canonical fp32 NaN after unpack
    assert torch.isfinite(x[4:]).all()


@pytest.mark.parametrize("wire", HALVES, ids=HALF_IDS)
def test_compressed_fp32_async_work(wire):
    n = WIRE_CHUNK * 2 + 11  # three chunks, two in flight: completing one posts the next
    x = rank_f32(RANK, n, seed=21)
    work = mpidp.allreduce(x, wire_dtype=wire, async_op=True)
    # Poll (each poll progresses MPI and posts the next chunk) for a while, then
    # wait: wait() has mpidp's deadline, a polling loop would not.
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        pass
    work.wait()
    assert work.is_completed()
    rounded = [rank_f32(r, n, seed=21).to(wire) for r in range(SIZE)]
    assert_reduced_sum(x, rounded, wire, f"async fp32 via {wire}")


def test_wire_dtype_of_a_half_tensor_is_its_own():
    # A bf16 tensor with wire_dtype=bf16 is simply reduced natively.
    inputs = all_rank_data(33, torch.bfloat16, seed=31)
    t = inputs[RANK].clone()
    mpidp.allreduce(t, wire_dtype=torch.bfloat16)
    assert_reduced_sum(t, inputs, torch.bfloat16, "bf16 with wire bf16")
    with pytest.raises(TypeError, match="cannot travel as"):
        mpidp.allreduce(torch.ones(3, dtype=torch.bfloat16), wire_dtype=torch.float16)


# --- DataParallel with a compressed wire -----------------------------------------------------


# Unit roundoff of the wire formats (relative error of one rounding), and half
# their smallest subnormal (absolute error of one rounding near zero).
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
ABS_FLOOR = {torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}


@pytest.mark.parametrize("wire", HALVES, ids=HALF_IDS)
def test_data_parallel_with_wire_dtype_tracks_fp32_reference(wire):
    """Tolerance. With wire compression rank r sends w_r = round(g_r * 1/size)
    and the op adds the w_r with size - 1 more roundings, each of relative size
    at most u (2^-8 bf16, 2^-11 fp16) of a partial sum bounded by
    A = sum_r |g_r| / size. So each averaged gradient element is within
        B = size * u * A * (1 + 2u) + size * floor
    of the exact average (floor: half the subnormal spacing, for fp16
    underflow), plus fp32 noise between the two ways of computing the same
    gradient (1e-6 * A). Step 0 checks exactly this, element by element. For
    the parameters, SGD with momentum mu and learning rate lr carries a
    gradient error into the momentum buffer (m_t <= mu * m_(t-1) + B_t) and the
    parameters (E_t <= E_(t-1) + lr * m_t); the two models also drift apart, so
    later gradients differ by more than B: with lr = 0.05 over 4 steps that
    feedback is a fraction of E (~ lr * steps * |Hessian| ~ 0.2 E for this
    model), and the parameters are asserted within 2 E + 1e-6. A reduction that
    were wrong by more than the wire rounding (no averaging, a truncating
    rounding, a lost bucket) would be outside these bounds."""
    lr, mu, steps, per_rank = 0.05, 0.9, 4, 6
    model, net, dp_opt, reference, ref_opt = data_parallel_and_reference(
        MLP, lambda params: torch.optim.SGD(params, lr=lr, momentum=mu), 200, True, wire_dtype=wire)
    params = list(reference.parameters())
    u, floor = UNIT_ROUNDOFF[wire], ABS_FLOOR[wire]
    m_bound = [torch.zeros_like(p) for p in params]
    e_bound = [torch.zeros_like(p) for p in params]
    g = seeded(17)
    n = per_rank * SIZE
    for step in range(steps):
        X, Y = on_device(torch.randn(n, 10, generator=g), torch.randint(0, 4, (n,), generator=g))
        dp_opt.zero_grad()
        F.cross_entropy(net(rank_slice(X)), rank_slice(Y)).backward()
        # The reference: every rank's gradient on its own slice, averaged exactly.
        ref_opt.zero_grad()
        per_rank_grads = [torch.autograd.grad(
            F.cross_entropy(reference(rank_slice(X, r, SIZE)), rank_slice(Y, r, SIZE)), params)
            for r in range(SIZE)]
        bounds = []
        for k, p in enumerate(params):
            gs = [gr[k].double() for gr in per_rank_grads]
            p.grad = (sum(gs) / SIZE).float()
            A = sum(x.abs() for x in gs) / SIZE
            bounds.append((SIZE * u * (1 + 2 * u) + 1e-6) * A + SIZE * floor)
        if step == 0:
            for (name, q), p, b in zip(model.named_parameters(), params, bounds):
                err = (q.grad.double() - p.grad.double()).abs()
                assert torch.all(err <= b + 1e-9), (
                    f"{name}.grad: error {err.max().item():.3g} above its bound "
                    f"(largest ratio {(err / (b + 1e-9)).max().item():.3g})")
        dp_opt.step()
        ref_opt.step()
        for k, b in enumerate(bounds):
            m_bound[k] = mu * m_bound[k] + b.float()
            e_bound[k] = e_bound[k] + lr * m_bound[k]
    for (name, q), p, e in zip(model.named_parameters(), params, e_bound):
        err = (q.detach() - p.detach()).abs()
        tol = 2 * e + 1e-6
        assert torch.all(err <= tol), (
            f"{name}: differs from the fp32 reference by {err.max().item():.3g}, "
            f"tolerance there {tol.flatten()[torch.argmax((err / tol).flatten())].item():.3g}")
    assert_same_on_all_ranks(model)
    # Compression did happen (at 1 rank too): the parameters are not bit-identical
    # to those of fp32 training.
    assert any(not torch.equal(q, p) for q, p in zip(model.parameters(), params))


def test_values_beyond_float16_range_are_counted_and_warned_about():
    """float16 on the wire turns finite values beyond +-65504 into inf: the
    engines count them (every rank sends one here) and the first one warns,
    once per process (a fresh process shows the warning)."""
    before = mpidp.fp16_overflows()
    t = torch.ones(64)
    t[RANK] = 1e6  # beyond 65504 even after the 1/size pre-scaling of op="avg"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mpidp.allreduce(t, op="avg", wire_dtype=torch.float16)
    assert mpidp.fp16_overflows() - before == 1   # this rank packed one such value
    assert torch.isinf(t[RANK])
    if RANK == 0 and SIZE == 1:
        code = ("import torch, warnings, mpidp\n"
                "warnings.simplefilter('always')\n"
                "with warnings.catch_warnings(record=True) as w:\n"
                "    warnings.simplefilter('always')\n"
                "    for _ in range(3): mpidp.allreduce(torch.full((4,), 1e5), wire_dtype=torch.float16)\n"
                "print(sum(\"beyond float16's range\" in str(x.message) for x in w))\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env=clean_env())
        assert out.stdout.strip().endswith("1"), out.stdout + out.stderr


def test_two_async_compressed_allreduces_waited_in_opposite_orders():
    """More chunks than a blocking call keeps in flight: an async call posts
    them all at once, so two in flight, waited in different orders on odd and
    even ranks, can neither hang nor have their chunks matched with each
    other's (MPI matches collectives by the order they start)."""
    n = 2 * WIRE_CHUNK + 5
    # Values that tell the two apart, should their chunks meet.
    a = torch.full((n,), float(RANK + 1))
    b = torch.full((n,), 64.0 * (RANK + 1))
    wa = mpidp.allreduce(a, wire_dtype=torch.bfloat16, async_op=True)
    wb = mpidp.allreduce(b, op="avg", wire_dtype=torch.bfloat16, async_op=True)
    if RANK % 2:
        time.sleep(0.3)    # the even ranks start waiting (and progressing) first
    for w in ((wa, wb) if RANK % 2 else (wb, wa)):
        w.wait()
    total = SIZE * (SIZE + 1) / 2
    assert torch.all(a == total)
    assert torch.allclose(b, torch.full((n,), 64.0 * total / SIZE), rtol=2 ** -7)
