"""torch.distributed's collectives on the "mpidp" backend, against the
same reduction computed here from every rank's data (each rank's data is
a function of its rank, so every rank can simulate the others).

Every dtype the core takes, complex tensors, non-contiguous tensors, every
ReduceOp, uneven all_gather and all_to_all splits, rooted collectives with
every root, point-to-point with tags and any source, object collectives,
async Works and futures, subgroups and their errors."""

import datetime
import math
import textwrap

import pytest
import torch
import torch.distributed as dist

import mpidp

from c10d_world import mpidp_world  # noqa: F401  (the "mpidp" default group)
from dp_reference import RANK, SIZE
from int_reference import INTEGERS, SIZES, overflowing, reduced

pytestmark = pytest.mark.ranks3
OP = dist.ReduceOp


def data(rank, dtype=torch.float32, n=5):
    """Rank `rank`'s values: distinct per rank and element, small enough for
    products and exact in 16-bit floats."""
    base = torch.arange(n, dtype=torch.float64) % 3 + 1 + rank
    if dtype is torch.bool:
        return (torch.arange(n) + rank) % 2 == 0
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    return base.to(dtype)


def everyone(dtype=torch.float32, n=5):
    return torch.stack([data(r, dtype, n) for r in range(SIZE)])


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX"])
def test_all_reduce_every_dtype_and_op(dtype, op):
    t = data(RANK, dtype)
    dist.all_reduce(t, op=getattr(OP, op))
    all_ = everyone(torch.float64)
    want = {"SUM": all_.sum(0), "PRODUCT": all_.prod(0), "MIN": all_.min(0).values,
            "MAX": all_.max(0).values}[op]
    assert t.dtype is dtype
    assert torch.equal(t, want.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16,
                                   torch.complex64])
def test_all_reduce_avg_and_premul_sum(dtype):
    t = data(RANK, dtype)
    dist.all_reduce(t, op=OP.AVG)
    mean = everyone(dtype).to(torch.complex128 if dtype.is_complex else torch.float64).mean(0)
    torch.testing.assert_close(t, mean.to(dtype))
    t = data(RANK, dtype)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    torch.testing.assert_close(t, (everyone(dtype).to(mean.dtype).sum(0) * 0.5).to(dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR"])
def test_all_reduce_bitwise(dtype, op):
    t = data(RANK, dtype)
    dist.all_reduce(t, op=getattr(OP, op))
    want = everyone(dtype)[0].clone()
    for r in range(1, SIZE):
        other = everyone(dtype)[r]
        want = {"BAND": want & other, "BOR": want | other, "BXOR": want ^ other}[op]
    assert torch.equal(t, want)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", INTEGERS)
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"])
def test_integer_all_reduce_wraps_as_torch(op, dtype, n):
    """Sums and products that leave the dtype's range wrap as in torch, on
    the small fold path and MPI's alike (Open MPI's AVX op saturates 8- and
    16-bit sums)."""
    t = overflowing(RANK, dtype, n)
    dist.all_reduce(t, op=getattr(OP, op))
    want = reduced({"PRODUCT": "prod"}.get(op, op.lower()),
                   [overflowing(r, dtype, n) for r in range(SIZE)])
    assert torch.equal(t, want), (t[:8], want[:8], int((t != want).sum()))


def sparse_of(rank, dtype=torch.float32, dense=()):
    """Rank `rank`'s sparse tensor: 2 sparse dimensions of 5 x 4, a few
    nonzeros that overlap other ranks' (rank 1 has none), `dense` trailing
    dimensions."""
    if rank == 1:
        return torch.sparse_coo_tensor(torch.empty(2, 0, dtype=torch.int64),
                                       torch.empty((0,) + dense, dtype=dtype), (5, 4) + dense)
    idx = torch.tensor([[rank % 5, 0, (rank * 3) % 5], [1, rank % 4, 2]])
    values = (torch.arange(3 * math.prod(dense), dtype=torch.float64).reshape((3,) + dense)
              + 10 * rank + 1)
    return torch.sparse_coo_tensor(idx, values.to(dtype), (5, 4) + dense)


@pytest.mark.parametrize("dtype, dense", [(torch.float32, ()), (torch.float64, (3,)),
                                          (torch.int64, ()), (torch.bfloat16, (2,))])
def test_sparse_all_reduce_sums_every_ranks_nonzeros(dtype, dense):
    """As gloo: the tensor becomes the sum, coalesced, its number of stored
    elements that of the union; asynchronous too. (torch's all_reduce hands
    a backend a complex tensor's real view, which for a sparse tensor is a
    copy: the sum never reaches it, on any backend.)"""
    t = sparse_of(RANK, dtype, dense)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    want = sum(sparse_of(r, dtype, dense).to_dense() for r in range(SIZE))
    assert t.is_sparse and t.dtype is dtype and t.shape == want.shape
    assert torch.equal(t.to_dense(), want)
    assert t.is_coalesced() and t._nnz() == int((want.reshape(5, 4, -1) != 0).any(-1).sum())


def test_all_reduce_bool_sum_is_or_as_nccl():
    t = data(RANK, torch.bool)
    dist.all_reduce(t)
    assert torch.equal(t, everyone(torch.bool).any(0))


def test_all_reduce_complex_and_non_contiguous():
    t = data(RANK, torch.complex128)
    dist.all_reduce(t)
    assert torch.equal(t, everyone(torch.complex128).sum(0))
    m = torch.stack([data(RANK), data(RANK) * 10]).t()    # columns: not contiguous
    assert not m.is_contiguous()
    dist.all_reduce(m)
    assert torch.equal(m, torch.stack([everyone().sum(0), everyone().sum(0) * 10]).t())


@pytest.mark.parametrize("what", ["int avg", "float band", "uint16", "bf16 bxor", "sparse max"])
def test_unsupported_op_or_dtype_names_both(what):
    t, op, words = {
        "int avg": (torch.ones(2, dtype=torch.int64), OP.AVG, ["AVG", "int64"]),
        "float band": (torch.ones(2), OP.BAND, ["BAND", "float32"]),
        "uint16": (torch.ones(2, dtype=torch.uint16), OP.SUM, ["uint16"]),
        "bf16 bxor": (torch.ones(2, dtype=torch.bfloat16), OP.BXOR, ["BXOR", "bfloat16"]),
        "sparse max": (torch.eye(2).to_sparse(), OP.MAX, ["sparse", "SUM only", "to_dense"]),
    }[what]
    with pytest.raises(TypeError) as info:
        dist.all_reduce(t, op=op)
    for w in words:
        assert w in str(info.value)


@pytest.mark.skipif(SIZE == 1, reason="one rank always agrees with itself")
def test_tensors_of_different_sizes_are_refused_on_every_rank():
    odd = RANK == SIZE - 1
    with pytest.raises(ValueError, match=r"rank\(s\) \[%d\]" % (SIZE - 1)):
        dist.all_reduce(torch.ones(4 if odd else 3))
    with pytest.raises(ValueError, match="broadcast"):
        dist.broadcast(torch.ones(2, dtype=torch.float64 if odd else torch.float32), src=0)
    t = data(RANK)
    dist.all_reduce(t)                       # the group still works
    assert torch.equal(t, everyone().sum(0))


@pytest.mark.skipif(SIZE < 3, reason="needs a subgroup that leaves a rank out")
def test_a_difference_in_a_subgroup_names_global_ranks():
    """A group of ranks 1.. numbers them from 0; its messages name the
    ranks as the job does, and the group's own numbers beside them."""
    members = list(range(1, SIZE))
    group = dist.new_group(members)
    if RANK in members:
        odd = RANK == SIZE - 1
        with pytest.raises(ValueError) as raised:
            dist.all_reduce(torch.ones(4 if odd else 3), group=group)
        assert (f"global rank(s) [{SIZE - 1}] (group rank(s) [{SIZE - 2}])"
                in str(raised.value)), raised.value
        assert (f"global rank(s) {members[:-1]} (group rank(s) {list(range(SIZE - 2))})"
                in str(raised.value)), raised.value
    dist.destroy_process_group(group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool,
                                   torch.complex64])
def test_broadcast_from_every_root(dtype):
    for root in range(SIZE):
        t = data(RANK, dtype)
        dist.broadcast(t, src=root)
        assert torch.equal(t, data(root, dtype))


def test_reduce_to_every_root():
    for root in range(SIZE):
        t = data(RANK)
        dist.reduce(t, dst=root, op=OP.MAX)
        assert torch.equal(t, everyone().max(0).values if RANK == root else data(RANK))
        t = data(RANK, torch.bfloat16)
        dist.reduce(t, dst=root, op=OP.AVG)
        if RANK == root:
            torch.testing.assert_close(t, everyone(torch.float64).mean(0).to(torch.bfloat16))


def test_all_gather_even_uneven_and_into_tensor():
    outs = [torch.empty(5, dtype=torch.int16) for _ in range(SIZE)]
    dist.all_gather(outs, data(RANK, torch.int16))
    assert all(torch.equal(o, data(r, torch.int16)) for r, o in enumerate(outs))
    uneven = [torch.empty(r + 1) for r in range(SIZE)]
    dist.all_gather(uneven, data(RANK, n=RANK + 1))
    assert all(torch.equal(o, data(r, n=r + 1)) for r, o in enumerate(uneven))
    flat = torch.empty(SIZE, 5, dtype=torch.float16)
    dist.all_gather_into_tensor(flat, data(RANK, torch.float16))
    assert torch.equal(flat, everyone(torch.float16))
    # in place: the input is this rank's block of the output (FSDP's unshard)
    flat = torch.zeros(SIZE * 5)
    flat[RANK * 5:(RANK + 1) * 5] = data(RANK)
    dist.all_gather_into_tensor(flat, flat[RANK * 5:(RANK + 1) * 5])
    assert torch.equal(flat, everyone().reshape(-1))


def test_all_gather_coalesced_fills_one_list_per_rank():
    """torch's layout: outputs[r][k] receives input k of rank r (tensors of
    different shapes in one call)."""
    inputs = [data(RANK, n=3), data(RANK, n=4).reshape(2, 2)]
    outputs = [[torch.empty(3), torch.empty(2, 2)] for _ in range(SIZE)]
    dist.all_gather_coalesced(outputs, inputs)
    for r in range(SIZE):
        assert torch.equal(outputs[r][0], data(r, n=3))
        assert torch.equal(outputs[r][1], data(r, n=4).reshape(2, 2))


@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX"])
def test_reduce_scatter_list_and_tensor(op):
    rop = getattr(OP, op)
    full = torch.stack([data(RANK, n=4) * (b + 1) for b in range(SIZE)])   # block b for rank b

    def want(b):
        blocks = torch.stack([data(r, n=4) * (b + 1) for r in range(SIZE)])
        return {"SUM": blocks.sum(0), "AVG": blocks.mean(0), "MAX": blocks.max(0).values}[op]
    out = torch.empty(4)
    dist.reduce_scatter(out, list(full.unbind(0)), op=rop)
    torch.testing.assert_close(out, want(RANK))
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, full.reshape(-1), op=rop)
    torch.testing.assert_close(out, want(RANK))
    original = full.clone()
    dist.reduce_scatter_tensor(out, full.reshape(-1), op=dist._make_nccl_premul_sum(2.0))
    assert torch.equal(full, original)          # the input is only read
    torch.testing.assert_close(out, 2 * torch.stack([data(r, n=4) * (RANK + 1)
                                                     for r in range(SIZE)]).sum(0))


def test_all_to_all_single_equal_and_split_sizes():
    inp = torch.arange(SIZE * 2, dtype=torch.float64) + 100 * RANK
    out = torch.empty(SIZE * 2, dtype=torch.float64)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.arange(RANK * 2, RANK * 2 + 2, dtype=torch.float64) + 100 * r
                      for r in range(SIZE)])
    assert torch.equal(out, want)
    # rank r sends s + 1 rows of 3 to rank s; so it receives RANK + 1 rows from each
    rows_to = [s + 1 for s in range(SIZE)]
    inp = torch.cat([torch.full((s + 1, 3), float(RANK * 10 + s)) for s in range(SIZE)])
    out = torch.empty(SIZE * (RANK + 1), 3)
    dist.all_to_all_single(out, inp, output_split_sizes=[RANK + 1] * SIZE,
                           input_split_sizes=rows_to)
    assert torch.equal(out, torch.cat([torch.full((RANK + 1, 3), float(r * 10 + RANK))
                                       for r in range(SIZE)]))


def test_all_to_all_list():
    inputs = [torch.full((s + 1,), float(RANK * 10 + s)) for s in range(SIZE)]
    outputs = [torch.empty(RANK + 1) for _ in range(SIZE)]
    dist.all_to_all(outputs, inputs)
    assert all(torch.equal(o, torch.full((RANK + 1,), float(r * 10 + RANK)))
               for r, o in enumerate(outputs))


def test_gather_and_scatter_every_root():
    for root in range(SIZE):
        got = [torch.empty(5, dtype=torch.int32) for _ in range(SIZE)] if RANK == root else None
        dist.gather(data(RANK, torch.int32), got, dst=root)
        if RANK == root:
            assert all(torch.equal(g, data(r, torch.int32)) for r, g in enumerate(got))
        out = torch.empty(5)
        dist.scatter(out, [data(r) * 7 for r in range(SIZE)] if RANK == root else None, src=root)
        assert torch.equal(out, data(RANK) * 7)


def test_object_collectives():
    objs = [None] * SIZE
    dist.all_gather_object(objs, {"rank": RANK, "name": f"r{RANK}"})
    assert objs == [{"rank": r, "name": f"r{r}"} for r in range(SIZE)]
    box = [("from", RANK, list(range(RANK)))]
    dist.broadcast_object_list(box, src=SIZE - 1)
    assert box == [("from", SIZE - 1, list(range(SIZE - 1)))]
    got = [None] * SIZE if RANK == 0 else None
    dist.gather_object(RANK * 3, got, dst=0)
    assert RANK != 0 or got == [r * 3 for r in range(SIZE)]


@pytest.mark.skipif(SIZE == 1, reason="point to point needs a peer")
def test_send_recv_tags_any_source_and_batch():
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    if SIZE > 1:
        # two messages with different tags, received in the other order
        a, b = torch.full((3,), float(RANK)), torch.full((2,), float(RANK) + 0.5)
        works = [dist.isend(a, right, tag=1), dist.isend(b, right, tag=2)]
        rb, ra = torch.empty(2), torch.empty(3)
        dist.recv(rb, left, tag=2)
        dist.recv(ra, left, tag=1)
        for w in works:
            w.wait()
        assert torch.equal(ra, torch.full((3,), float(left)))
        assert torch.equal(rb, torch.full((2,), float(left) + 0.5))
    if RANK == 0:
        senders = set()
        for _ in range(SIZE - 1):
            buf = torch.empty(1, dtype=torch.int64)
            src = dist.recv(buf, tag=7)                # any source (tag 7: the ring
            # below uses tag 0 and may already be sending to this rank)
            assert buf.item() == src * 11
            senders.add(src)
        assert senders == set(range(1, SIZE))
    else:
        dist.send(torch.tensor([RANK * 11]), dst=0, tag=7)
    ops = [dist.P2POp(dist.isend, data(RANK), right), dist.P2POp(dist.irecv, torch.empty(5), left)]
    recv = ops[1].tensor
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(recv, data(left))


@pytest.mark.skipif(SIZE == 1, reason="point to point needs a peer")
def test_messages_and_collectives_in_flight_together_on_one_group():
    """On up to 8 ranks the core sends all-gather and reduce-scatter blocks
    as point-to-point messages on the group's own communicator: a user's
    messages in flight beside them (the same tag 0 every pair uses) still
    meet their own receives, and MPI's largest tag, the core's, is refused."""
    from mpidp import MPI

    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    n = 40000  # blocks past the eager limit: rendezvous
    mine = torch.arange(n, dtype=torch.float32) + RANK * n
    gathered = torch.empty(SIZE * n)
    scatter_in = torch.stack([data(r, n=n) * (RANK + 1) for r in range(SIZE)]).reshape(-1)
    scattered = torch.empty(n)
    note, heard = torch.full((7,), float(RANK)), torch.empty(7)
    works = [dist.irecv(heard, left), dist.all_gather_into_tensor(gathered, mine, async_op=True),
             dist.isend(note, right),
             dist.reduce_scatter_tensor(scattered, scatter_in, async_op=True)]
    for w in reversed(works):
        w.wait()
    assert torch.equal(heard, torch.full((7,), float(left)))
    assert torch.equal(gathered, torch.arange(SIZE * n, dtype=torch.float32))
    assert torch.equal(scattered, data(RANK, n=n) * (SIZE * (SIZE + 1) // 2))
    reserved = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    with pytest.raises(Exception, match=f"tag {reserved} is not in 0..{reserved - 1}"):
        dist.send(note, right, tag=reserved)
    dist.barrier()


def test_mpidps_failures_are_torchs_backend_errors():
    """What the docs promise a torch.distributed program (as gloo and NCCL
    raise): a timeout with MPIDP_ON_TIMEOUT=raise is a DistBackendError."""
    assert issubclass(mpidp.CommTimeout, dist.DistBackendError)
    assert issubclass(mpidp.CommTimeout, TimeoutError)
    assert issubclass(mpidp.RanksLost, dist.DistBackendError)


def test_async_work_future_and_timeout_argument():
    t = data(RANK)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    value = fut.wait()
    assert torch.equal(value[0], everyone().sum(0))
    assert work.wait(timeout=datetime.timedelta(seconds=30))
    assert work.is_completed() and work.exception() is None
    chained = dist.all_reduce(data(RANK), async_op=True).get_future().then(
        lambda f: f.value()[0] * 2)
    assert torch.equal(chained.wait(), everyone().sum(0) * 2)
    dist.barrier()


def test_subgroups_new_group_and_new_subgroups():
    evens = [r for r in range(SIZE) if r % 2 == 0]
    group = dist.new_group(evens)
    if RANK in evens:
        t = data(RANK)
        dist.all_reduce(t, group=group)
        assert torch.equal(t, torch.stack([data(r) for r in evens]).sum(0))
        assert dist.get_rank(group) == evens.index(RANK)
        assert dist.get_backend(group) == "mpidp"
    mine, _ = dist.new_subgroups_by_enumeration([[r] for r in range(SIZE)])
    t = data(RANK)
    dist.all_reduce(t, group=mine)
    assert torch.equal(t, data(RANK))
    if SIZE % 2 == 0:
        pair, _ = dist.new_subgroups(2)
        t = data(RANK)
        dist.all_reduce(t, group=pair)
        first = RANK - RANK % 2
        assert torch.equal(t, data(first) + data(first + 1))
        t = torch.tensor([float(RANK)])
        dist.broadcast(t, src=first + 1, group=pair)    # a global rank as src
        assert t.item() == first + 1


_CAUGHT_TIMEOUT = """
    import datetime, time, torch, torch.distributed as dist, mpidp
    dist.init_process_group("mpidp")
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t, group=group)
    if rank == 0:
        try:
            dist.all_reduce(t, group=group)        # rank 1 does not come: it sleeps
        except mpidp.CommTimeout as e:
            print(f"rank 0 caught {type(e).__name__} {isinstance(e, dist.DistBackendError)}",
                  flush=True)
    else:
        time.sleep(4)
    try:                                            # would pair with rank 0's posted call
        dist.all_reduce(t, group=group)
        print(f"rank {rank} returned {t.tolist()}", flush=True)
    except RuntimeError as e:
        print(f"rank {rank} refused: {e}", flush=True)
    fresh = dist.new_group([0, 1])
    u = torch.full((4,), float(rank + 1))
    dist.all_reduce(u, group=fresh)
    print(f"rank {rank} fresh {u.tolist()}", flush=True)
"""


@pytest.mark.serial
@pytest.mark.parametrize("impl", ["cpp", "python"])
def test_a_group_whose_call_timed_out_refuses_later_calls(tmp_path, impl):
    """MPIDP_ON_TIMEOUT=raise (torch's contract: the program catches the
    timeout): the call that timed out stays posted in MPI, so that rank's
    group refuses every later call (its next one would pair with the late
    rank's call and sum the wrong tensors); the late rank's call completes
    the posted one, and a new group works."""
    from mpi_jobs import run_mpi
    script = tmp_path / "caught.py"
    script.write_text(textwrap.dedent(_CAUGHT_TIMEOUT))
    rc, out, seconds = run_mpi(2, [str(script)], timeout=120, MPIDP_ON_TIMEOUT="raise",
                               MPIDP_C10D_IMPL=impl)
    assert "rank 0 caught CommTimeout True" in out, out
    assert "rank 0 returned" not in out, out
    if impl == "cpp":      # the call was posted at once: rank 1's completes it, 8 + 8
        assert "rank 1 returned [16.0, 16.0, 16.0, 16.0]" in out, out
    else:                  # rank 0's check was posted, its data call never: rank 1 times out
        assert "rank 1 refused:" in out and "timed out" in out, out
    assert "rank 0 refused: mpidp backend: all_reduce on a group that can no longer be used" \
        in out, out
    assert "rank 0 fresh [3.0, 3.0, 3.0, 3.0]" in out and "rank 1 fresh [3.0" in out, out
