"""mpidp.allreduce(t, wire_dtype=torch.uint8): the 8-bit quantized allreduce.

Rank-agnostic (1-4 ranks; also marked `ranks3`): every rank reduces its own
data from a rank-dependent seed and regenerates every other rank's to compute
the expected result with a single-process replica of the algorithm written
here on mpidp.kernels' reference path (quantize each rank's chunk, decode and
sum in rank order, scale, requantize, decode). The result must equal the
replica bit for bit on every rank, and be within the quantization bound of
the exact float64 sum.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp import _C
from quant_reference import replica_of

pytestmark = pytest.mark.ranks3

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
B = _C.Q8_BLOCK


def data_of(rank: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(n, generator=g) * (rank + 1) + torch.linspace(-3, 3, n)


def replica(n: int, seed: int, average: bool) -> torch.Tensor:
    """The algorithm of mpidp/qallreduce.h for one segment (n <= 2^22)."""
    return replica_of([data_of(r, n, seed) for r in range(SIZE)], average)


@pytest.mark.parametrize("n", [1, 300, 5000, 70001])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_equals_the_replica_bitwise_and_stays_within_the_bound(n, op):
    x = data_of(RANK, n, seed=n)
    mpidp.allreduce(x, op=op, wire_dtype=torch.uint8)
    want = replica(n, seed=n, average=op == "avg")
    assert torch.equal(x.view(torch.int32), want.view(torch.int32))
    gathered = COMM.allgather(x.view(torch.int32).sum().item())
    assert len(set(gathered)) == 1
    exact = sum(data_of(r, n, seed=n).double() for r in range(SIZE)) / (SIZE if op == "avg" else 1)
    # Half a step per rank's block plus half a step of the summed block.
    bound = torch.zeros(n, dtype=torch.float64)
    for a in range(0, n, B):
        blocks = [data_of(r, n, seed=n)[a:a + B].double() for r in range(SIZE)]
        first = sum((b.max() - b.min()) / 510 for b in blocks) / (SIZE if op == "avg" else 1)
        span = exact[a:a + B].max() - exact[a:a + B].min()
        bound[a:a + B] = first + (span + 2 * first) / 510 + 1e-5
    assert ((x.double() - exact).abs() <= bound).all()


def test_async_work_and_wire_bytes():
    x = data_of(RANK, 4096, seed=7)
    work = mpidp.allreduce(x, op="avg", wire_dtype=torch.uint8, async_op=True)
    work.wait()
    assert torch.equal(x, replica(4096, seed=7, average=True))


def test_refused_with_a_named_argument():
    with pytest.raises(TypeError, match="wire_dtype: torch.uint8 quantizes float32 tensors"):
        mpidp.allreduce(torch.zeros(4, dtype=torch.float64), wire_dtype=torch.uint8)
    with pytest.raises(ValueError, match="wire_dtype: only 'sum' and 'avg' can be compressed"):
        mpidp.allreduce(torch.zeros(4), op="max", wire_dtype=torch.uint8)
    with pytest.raises(ValueError, match="wire_dtype: expected one of None, torch.bfloat16"):
        mpidp.allreduce(torch.zeros(4), wire_dtype=torch.int8)


def test_two_in_flight_waited_in_opposite_orders_on_odd_and_even_ranks():
    """Each exchange's second stage starts when its first has arrived, on
    whichever rank; a rank waiting on one operation still advances the other,
    so waiting in different orders neither hangs nor mixes them up."""
    n = (1 << 22) + 1000          # two segments: the second starts as the first completes
    a, b = data_of(RANK, n, seed=21), data_of(RANK, 5000, seed=22)
    wa = mpidp.allreduce(a, wire_dtype=torch.uint8, async_op=True)
    wb = mpidp.allreduce(b, op="avg", wire_dtype=torch.uint8, async_op=True)
    for w in ((wa, wb) if RANK % 2 else (wb, wa)):
        w.wait()
    assert torch.equal(b, replica(5000, seed=22, average=True))
    assert len(set(COMM.allgather(a.view(torch.int32)[::997].sum().item()))) == 1


def test_data_parallel_with_uint8_wire_reduces_each_bucket_as_the_replica():
    """DataParallel(wire_dtype=torch.uint8): each float32 bucket's data, scaled
    by 1/size, go through the quantized allreduce; one bucket here (large
    caps), laid out by the core's plan. The averaged .grad equals the replica
    applied to every rank's bucket bit for bit; a parameter no rank used
    keeps .grad None (the flags travel exactly)."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused = (torch.nn.Linear(20, 30), torch.nn.Linear(30, 5),
                                           torch.nn.Linear(3, 3))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    model = Net()
    net = mpidp.DataParallel(model, wire_dtype=torch.uint8, bucket_cap_mb=100.0,
                             first_bucket_cap_mb=100.0)
    reference = Net()
    reference.load_state_dict(model.state_dict())
    params = [p for p in reference.parameters()]
    used = [p for n, p in reference.named_parameters() if not n.startswith("unused")]
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4 * SIZE, 20, generator=g), torch.randn(4 * SIZE, 5, generator=g)
    torch.nn.functional.mse_loss(net(x[4 * RANK:4 * RANK + 4]), y[4 * RANK:4 * RANK + 4]).backward()
    bucket_of, offset, infos = _C.plan_buckets([p.numel() for p in params],
                                               [_C.DTYPE_F32] * len(params), 100 << 20, 100 << 20)
    assert len(infos) == 1
    flats = []
    for r in range(SIZE):
        grads = torch.autograd.grad(torch.nn.functional.mse_loss(
            reference(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]), used)
        flat = torch.zeros(infos[0][0])
        for p, gr in zip(used, grads):
            i = next(k for k, q in enumerate(params) if q is p)
            flat[offset[i]:offset[i] + p.numel()] = gr.reshape(-1)
        flats.append(flat * torch.tensor(1.0 / SIZE, dtype=torch.float32))
    want = replica_of(flats, average=False)
    for i, (name, p) in enumerate(model.named_parameters()):
        if name.startswith("unused"):
            assert p.grad is None
            continue
        got = p.grad.reshape(-1)
        assert torch.equal(got.view(torch.int32),
                           want[offset[i]:offset[i] + p.numel()].view(torch.int32)), name
