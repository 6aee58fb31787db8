"""mpidp.allreduce against values computed independently on every rank."""

import gc

import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE
from int_reference import INTEGERS, SIZES, overflowing, reduced
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


def test_a_tensor_changed_in_flight_raises_at_every_wait():
    """Changing a tensor in place before its async allreduce or broadcast
    completes leaves undefined values (what was sent mixes old and new, and
    MPI overwrites the change): the wait that completes it raises, and so do
    every later wait, result() and is_completed(), instead of handing out
    the tensor as reduced. Reading it in flight, and writing to it once the
    Work completed, are fine."""
    expected = expected_sum(1 << 16, torch.float32)
    t = rank_data(RANK, n=1 << 16)
    work = mpidp.allreduce(t, async_op=True)
    t.mul_(0.5)  # e.g. a gradient clipped before the wait
    for call in (work.wait, work.result, work.is_completed, work.wait):
        with pytest.raises(RuntimeError, match="changed in place while the operation was in flight"):
            call()
    b = torch.arange(8, dtype=torch.float64) * (RANK + 1)
    work = mpidp.broadcast(b, root=0, async_op=True)
    b.view(2, 4)[0].zero_()  # through a view: the version counter is shared
    with pytest.raises(RuntimeError, match="changed in place"):
        work.result()
    # The habit itself: a gradient averaged asynchronously, clipped before the wait.
    layer = torch.nn.Linear(64, 64)
    layer(rank_data(RANK, n=64 * 8).view(8, 64)).square().sum().backward()
    work = mpidp.allreduce(layer.weight.grad, op="avg", async_op=True)
    torch.nn.utils.clip_grad_norm_(layer.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="changed in place"):
        work.wait()
    g = torch.full((2, 3), float(RANK))  # an allgather's input changed before it was sent
    work = mpidp.allgather(g, async_op=True)
    g.add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place"):
        work.result()
    t = rank_data(RANK, n=1 << 16)
    work = mpidp.allreduce(t.view(256, 256), async_op=True)  # the user's tensor is a view
    float(t.sum())  # reading in flight changes nothing
    work.wait()
    t.add_(1.0)  # completed: the tensor is the user's again
    work.wait()
    assert work.is_completed()
    assert torch.allclose(t, expected + 1.0, rtol=1e-6)


def test_dropped_work_still_completes():
    # Earlier tests' wrappers may wait in reference cycles with a request in
    # flight (DataParallel's settings check is posted at one forward and
    # waited at the next); collecting them lands those first.
    gc.collect()
    assert mpidp._C.process_state()["pending"] == 0, mpidp._C.process_state()["in_flight"]
    t = rank_data(RANK, n=1 << 16)
    mpidp.allreduce(t, async_op=True)  # the Work is dropped at once
    assert mpidp._C.process_state()["pending"] == 0, mpidp._C.process_state()["in_flight"]
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


def test_a_sub_communicator_is_duplicated_once_and_a_reused_handle_is_not_mistaken():
    """mpidp duplicates a user's communicator once (MPI_Comm_dup is a
    collective: once per call would synchronise every call), and a handle
    MPI hands out again after a Free gets a duplicate of the new one."""
    from mpidp._runtime.mpi import resolve_comm
    sub = MPI.COMM_WORLD.Split(RANK % 2, RANK)
    first = resolve_comm(sub)
    assert resolve_comm(sub) is first
    sub.Free()
    everyone = MPI.COMM_WORLD.Split(0, RANK)   # may take the freed handle
    assert resolve_comm(everyone) is not first
    t = torch.tensor([float(RANK)])
    mpidp.allreduce(t, comm=everyone)
    assert t.item() == sum(range(SIZE))
    everyone.Free()


def test_heat_style_communicator_wrapper():
    class Wrapper:  # Heat's MPICommunication exposes the mpi4py comm as .handle
        handle = MPI.COMM_WORLD
    t = torch.ones(3)
    mpidp.allreduce(t, comm=Wrapper())
    assert torch.all(t == SIZE)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: mpidp.allreduce([1.0, 2.0]), TypeError, "tensor"),
    (lambda: mpidp.allreduce(torch.ones(3), op="mean"), ValueError, "op: expected one of"),
    (lambda: mpidp.allreduce(torch.ones(3), comm="world"), TypeError, "comm"),
    (lambda: mpidp.allreduce(torch.ones(3, dtype=torch.int32), op="avg"), ValueError,
     "'avg' needs a floating-point tensor"),
    (lambda: mpidp.allreduce(torch.ones(3, dtype=torch.bool)), ValueError, "bool"),
    (lambda: mpidp.allreduce(torch.ones(3, dtype=torch.bfloat16), op="max"), ValueError, "float32"),
    (lambda: mpidp.allreduce(torch.ones(3), op="max", wire_dtype=torch.bfloat16), ValueError,
     "only 'sum' and 'avg' can be compressed"),
    (lambda: mpidp.allreduce(torch.ones(3, dtype=torch.complex64)), TypeError, "not supported"),
    (lambda: mpidp.allreduce(torch.ones(4, 4).t()), ValueError, "contiguous"),
    (lambda: mpidp.allreduce(torch.ones(3, requires_grad=True)), ValueError, "requires grad"),
    (lambda: mpidp.allreduce(torch.ones(3), wire_dtype=torch.int8), ValueError, "wire_dtype"),
    (lambda: mpidp.broadcast(torch.ones(3), root=SIZE), ValueError, r"root: expected a rank in 0 \.\. "),
    (lambda: mpidp.broadcast(torch.ones(3), root=0.0), TypeError, "root: expected an int"),
    (lambda: mpidp.allreduce_scalar("1"), TypeError, "value: expected a number"),
    (lambda: mpidp.allreduce_scalar(torch.ones(2)), ValueError, "one-element"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


def everyone(t):
    """Every rank's copy of `t`, in rank order (mpi4py, independent of mpidp)."""
    return [torch.as_tensor(x) for x in MPI.COMM_WORLD.allgather(t.numpy())]


def small_values(rank, dtype, n=37):
    """Distinct per rank, never 0, and small enough that a product over 4 ranks
    fits every integer dtype."""
    v = (torch.arange(n) + rank) % 5 - 2
    v = torch.where(v == 0, torch.ones_like(v), v)
    return (v.abs() if dtype == torch.uint8 else v).to(dtype)


@pytest.mark.parametrize("dtype", INTEGERS + [torch.float32, torch.float64])
@pytest.mark.parametrize("op", ["sum", "min", "max", "prod"])
def test_every_op_of_integers_and_floats(dtype, op):
    mine = small_values(RANK, dtype)
    inputs = everyone(mine)
    want = {"sum": lambda xs: torch.stack(xs).sum(0),
            "min": lambda xs: torch.stack(xs).amin(0),
            "max": lambda xs: torch.stack(xs).amax(0),
            "prod": lambda xs: torch.stack(xs).prod(0)}[op](inputs).to(dtype)
    t = mine.clone()
    mpidp.allreduce(t, op)
    assert t.dtype == dtype and torch.equal(t, want), (t, want)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", INTEGERS)
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_integers_wrap_as_torch_at_every_size(op, dtype, n):
    t = overflowing(RANK, dtype, n)
    mpidp.allreduce(t, op)
    want = reduced(op, [overflowing(r, dtype, n) for r in range(SIZE)])
    assert torch.equal(t, want), (t[:8], want[:8], int((t != want).sum()))


def test_bool_min_is_all_and_max_is_any():
    mine = torch.tensor([True, False, RANK % 2 == 0, RANK == 0])
    inputs = torch.stack(everyone(mine))
    t = mine.clone()
    mpidp.allreduce(t, "min")
    assert torch.equal(t, inputs.all(0))
    t = mine.clone()
    mpidp.allreduce(t, "max")
    assert torch.equal(t, inputs.any(0))


def test_integer_allreduce_can_be_asynchronous():
    t = torch.full((1 << 12,), RANK + 1, dtype=torch.int64)
    work = mpidp.allreduce(t, async_op=True)
    work.wait()
    assert torch.all(t == SIZE * (SIZE + 1) // 2)


def test_allreduce_scalar_for_metrics():
    assert mpidp.allreduce_scalar(float(RANK)) == pytest.approx((SIZE - 1) / 2)
    assert mpidp.allreduce_scalar(RANK + 1, op="sum") == SIZE * (SIZE + 1) // 2
    assert isinstance(mpidp.allreduce_scalar(RANK, op="max"), int)
    assert mpidp.allreduce_scalar(RANK, op="max") == SIZE - 1
    assert mpidp.allreduce_scalar(torch.tensor(2.0 * RANK), op="min") == 0.0
    assert mpidp.allreduce_scalar(RANK == 0, op="max") is True
    assert mpidp.allreduce_scalar(RANK == 0, op="min") is (SIZE == 1)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float32, torch.bfloat16])
def test_broadcast_from_every_root(dtype):
    for root in range(SIZE):
        t = (torch.arange(7) * (RANK + 3)).to(dtype)
        out = mpidp.broadcast(t, root=root)
        assert out is t
        assert torch.equal(t, (torch.arange(7) * (root + 3)).to(dtype))


def test_allgather_concatenates_uneven_first_dimensions():
    mine = torch.arange(3 * (RANK + 1), dtype=torch.int32).view(RANK + 1, 3) + 100 * RANK
    got = mpidp.allgather(mine)
    assert torch.equal(got, torch.cat(everyone(mine)))
    scalar = mpidp.allgather(torch.tensor(float(RANK)))
    assert torch.equal(scalar, torch.arange(SIZE, dtype=torch.float32))


@pytest.mark.skipif(SIZE == 1, reason="one rank always agrees with itself")
def test_rank_size_local_rank_barrier():
    assert (mpidp.rank(), mpidp.size()) == (RANK, SIZE)
    assert mpidp.local_rank() == mpidp.topology().local_rank
    mpidp.barrier()


def test_allgather_with_a_rank_that_has_no_rows():
    mine = torch.full((0 if RANK == SIZE - 1 else 2, 2), float(RANK))
    got = mpidp.allgather(mine)
    assert torch.equal(got, torch.cat(everyone(mine)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter_gives_each_rank_its_rows_of_the_reduction(dtype, op):
    rows = 2 * SIZE + 1                              # uneven: the first rank gets one more
    mine = (torch.arange(rows * 3, dtype=dtype).view(rows, 3) + 1) * (RANK + 1) / 4
    whole = torch.stack(everyone(mine)).sum(0)
    if op == "avg":
        whole = whole * (1.0 / SIZE)
    counts = [rows // SIZE + (1 if r < rows % SIZE else 0) for r in range(SIZE)]
    start = sum(counts[:RANK])
    got = mpidp.reduce_scatter(mine, op=op)
    assert got.shape == (counts[RANK], 3)
    torch.testing.assert_close(got, whole[start:start + counts[RANK]], rtol=1e-6, atol=0)
    # Explicit counts, a zero among them.
    counts = [0] + [rows // (SIZE - 1) + (1 if r < rows % (SIZE - 1) else 0)
                    for r in range(SIZE - 1)] if SIZE > 1 else [rows]
    start = sum(counts[:RANK])
    got = mpidp.reduce_scatter(mine, op=op, counts=counts)
    torch.testing.assert_close(got, whole[start:start + counts[RANK]], rtol=1e-6, atol=0)


def test_every_collective_can_run_asynchronously_several_at_once():
    """broadcast, allgather, reduce_scatter and barrier with async_op=True:
    all started before any is waited for, each rank with its own data, then
    completed in the other order; each result is what the blocking call
    gives, computed here from every rank's data (mpi4py)."""
    root = SIZE - 1
    b = (torch.arange(5, dtype=torch.float64) + 1) * (RANK + 2)
    g = torch.arange(2 * (RANK + 1), dtype=torch.int64).view(RANK + 1, 2) + 10 * RANK
    rows = 2 * SIZE + 1
    s = (torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + 1) * (RANK + 1)
    counts = [rows // SIZE + (1 if r < rows % SIZE else 0) for r in range(SIZE)]
    start = sum(counts[:RANK])
    mean = (torch.stack(everyone(s)).sum(0) * (1.0 / SIZE))[start:start + counts[RANK]]
    gathered = torch.cat(everyone(g))
    works = [mpidp.broadcast(b, root=root, async_op=True), mpidp.allgather(g, async_op=True),
             mpidp.reduce_scatter(s, op="avg", async_op=True), mpidp.barrier(async_op=True)]
    assert all(isinstance(w, mpidp.Work) for w in works)
    for w in reversed(works):
        w.wait()
    assert all(w.is_completed() for w in works)
    assert torch.equal(b, (torch.arange(5, dtype=torch.float64) + 1) * (root + 2))
    assert works[0].result().data_ptr() == b.data_ptr()
    assert torch.equal(works[1].result(), gathered)
    torch.testing.assert_close(works[2].result(), mean, rtol=1e-6, atol=0)  # scaled once
    assert works[3].result() is None
    # result() waits by itself; a dropped Work completes before it goes.
    assert torch.equal(mpidp.allgather(g, async_op=True).result(), gathered)
    mpidp.broadcast(torch.zeros(1 << 16), root=0, async_op=True)


def test_ranks_that_disagree_on_async_op_get_the_same_results():
    """async_op is each rank's own choice: odd ranks wait at once, even ranks
    take a Work and wait later; the values are the blocking reference's."""
    async_op = RANK % 2 == 0
    b = torch.arange(6, dtype=torch.float32) * (RANK + 1)
    g = torch.full((RANK + 1, 2), float(RANK))
    s = torch.arange(4 * SIZE, dtype=torch.float64) * (RANK + 1)
    got = [mpidp.broadcast(b, root=0, async_op=async_op), mpidp.allgather(g, async_op=async_op),
           mpidp.reduce_scatter(s, async_op=async_op), mpidp.barrier(async_op=async_op)]
    if async_op:
        got = [w.result() for w in got]
    assert torch.equal(b, torch.arange(6, dtype=torch.float32))
    assert torch.equal(got[1], torch.cat(everyone(g)))
    whole = torch.stack(everyone(s)).sum(0)
    assert torch.equal(got[2], whole[4 * RANK:4 * RANK + 4])
    assert got[3] is None


def test_reduce_scatter_refuses_bad_arguments():
    with pytest.raises(ValueError, match="counts: expected"):
        mpidp.reduce_scatter(torch.zeros(3), counts=[3] + [1] * (SIZE - 1) if SIZE > 1 else [2])
    with pytest.raises(TypeError, match="tensor: expected float32 or float64"):
        mpidp.reduce_scatter(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="op: expected one of 'sum', 'avg'"):
        mpidp.reduce_scatter(torch.zeros(3), op="max")
