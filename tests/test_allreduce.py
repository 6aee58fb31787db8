"""mpidp.allreduce against values computed independently on every rank."""

import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE
from mpi4py import MPI


def rank_data(rank, n=1000, dtype=torch.float32):
    return torch.arange(n, dtype=dtype) * (rank + 1) + rank


def expected_sum(n=1000, dtype=torch.float64):
    return sum(rank_data(r, n, torch.float64) for r in range(SIZE)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sum_and_avg(dtype):
    t = rank_data(RANK, dtype=dtype)
    mpidp.allreduce(t, "sum")
    assert torch.allclose(t, expected_sum(dtype=dtype))
    t = rank_data(RANK, dtype=dtype)
    mpidp.allreduce(t, op="avg")
    assert torch.allclose(t, expected_sum(dtype=dtype) / SIZE, rtol=1e-6)


def test_async_work():
    t = rank_data(RANK, n=1 << 16)
    work = mpidp.allreduce(t, async_op=True)
    assert isinstance(work, mpidp.Work)
    work.wait()
    assert work.is_completed()
    assert torch.allclose(t, expected_sum(1 << 16, torch.float32), rtol=1e-6)
    work.wait()  # waiting twice is harmless


def test_dropped_work_still_completes():
    t = rank_data(RANK, n=1 << 16)
    mpidp.allreduce(t, async_op=True)  # the Work is dropped at once
    assert mpidp._C.pending() == 0
    assert torch.allclose(t, expected_sum(1 << 16, torch.float32), rtol=1e-6)


def test_shapes_views_and_empty():
    t = rank_data(RANK, n=24).reshape(2, 3, 4)
    mpidp.allreduce(t)
    assert torch.allclose(t, expected_sum(24, torch.float32).reshape(2, 3, 4))
    base = torch.zeros(10)
    base[3:7] = float(RANK + 1)
    mpidp.allreduce(base[3:7])  # a contiguous view with an offset
    assert torch.all(base[3:7] == SIZE * (SIZE + 1) / 2) and torch.all(base[:3] == 0)
    mpidp.allreduce(torch.zeros(0))


def test_sub_communicator():
    sub = MPI.COMM_WORLD.Split(RANK % 2, RANK)
    t = torch.tensor([float(RANK)])
    mpidp.allreduce(t, comm=sub)
    assert t.item() == sum(r for r in range(SIZE) if r % 2 == RANK % 2)
    sub.Free()


def test_heat_style_communicator_wrapper():
    class Wrapper:  # Heat's MPICommunication exposes the mpi4py comm as .handle
        handle = MPI.COMM_WORLD
    t = torch.ones(3)
    mpidp.allreduce(t, comm=Wrapper())
    assert torch.all(t == SIZE)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: mpidp.allreduce([1.0, 2.0]), TypeError, "tensor"),
    (lambda: mpidp.allreduce(torch.ones(3), op="max"), ValueError, "op"),
    (lambda: mpidp.allreduce(torch.ones(3), comm="world"), TypeError, "comm"),
    (lambda: mpidp.allreduce(torch.ones(3, dtype=torch.int32)), TypeError, "float"),
    (lambda: mpidp.allreduce(torch.ones(4, 4).t()), ValueError, "contiguous"),
    (lambda: mpidp.allreduce(torch.ones(3, requires_grad=True)), ValueError, "requires grad"),
    (lambda: mpidp.allreduce(torch.ones(3), wire_dtype=torch.int8), ValueError, "wire_dtype"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
