"""The "mpidp" backend's C++ groups (MPIDP_C10D_IMPL=cpp, mpidp._c10d): the
calls it runs itself (all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, broadcast, barrier on host tensors) and those it hands
the Python group, against the reduction of every rank's data computed here;
the ranks' agreement and its message; torch's functional collectives, which
reach only a backend registered in the dispatcher (also compiled: DDP with
Dynamo's DDP optimizer, a DTensor's redistribute); DDP over it against a
single-process reference; the profiler's record of each call."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch._C._distributed_c10d as c10d

from dp_reference import RANK, SIZE

pytestmark = pytest.mark.ranks3
OP = dist.ReduceOp
_c10d = pytest.importorskip("mpidp._c10d", reason="mpidp was built without torch importable "
                                                  "(no C++ backend)")


@pytest.fixture(scope="module", autouse=True)
def cpp_world():
    """A default "mpidp" group made with MPIDP_C10D_IMPL=cpp (another module
    may have left a default group of its own: replaced here, and destroyed
    after these tests)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MPIDP_C10D_IMPL", "cpp")
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("mpidp")
    mp.undo()
    assert isinstance(dist.group.WORLD._get_backend(torch.device("cpu")), _c10d.BackendMPIDP)
    yield
    dist.destroy_process_group()


def data(rank, dtype=torch.float32, n=6):
    base = torch.arange(n, dtype=torch.float64) % 3 + 1 + rank
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    return base.to(dtype)


def everyone(n=6):
    return torch.stack([data(r, torch.float64, n) for r in range(SIZE)])


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX"])
def test_all_reduce_every_dtype_and_op(dtype, op):
    """Fast path where the core reduces the dtype as it is; the Python
    group's staging for 16-bit min/max/product."""
    t = data(RANK, dtype)
    dist.all_reduce(t, op=getattr(OP, op))
    all_ = everyone()
    want = {"SUM": all_.sum(0), "PRODUCT": all_.prod(0), "MIN": all_.min(0).values,
            "MAX": all_.max(0).values}[op]
    assert t.dtype is dtype
    assert torch.equal(t, want.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.complex64])
def test_all_reduce_avg(dtype):
    t = data(RANK, dtype)
    dist.all_reduce(t, op=OP.AVG)
    mean = everyone().mean(0)
    want = torch.complex(mean, -mean) if dtype.is_complex else mean
    torch.testing.assert_close(t, want.to(dtype))


def test_non_contiguous_and_async_all_reduce():
    t = data(RANK, n=12).reshape(3, 4).t()          # handed to the Python group
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    assert torch.equal(t, everyone(12).sum(0).reshape(3, 4).t().float())
    c = data(RANK)
    fut = dist.all_reduce(c, async_op=True).get_future()
    assert torch.equal(fut.wait()[0], everyone().sum(0).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.complex64])
def test_all_gather_into_tensor(dtype):
    mine = data(RANK, torch.float64 if dtype is torch.bool else dtype, 4)
    mine = mine > 2 if dtype is torch.bool else mine
    out = torch.empty(SIZE * 4, dtype=dtype)
    dist.all_gather_single(out, mine)
    rows = [data(r, torch.float64 if dtype is torch.bool else dtype, 4) for r in range(SIZE)]
    want = torch.cat([r > 2 for r in rows] if dtype is torch.bool else rows)
    assert torch.equal(out, want)


@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX"])
def test_reduce_scatter_tensor(op):
    n = 3
    out = torch.empty(n)
    dist.reduce_scatter_single(out, data(RANK, n=n * SIZE), op=getattr(OP, op))
    all_ = everyone(n * SIZE)
    red = {"SUM": all_.sum(0), "AVG": all_.mean(0), "MAX": all_.max(0).values}[op]
    torch.testing.assert_close(out, red[RANK * n:(RANK + 1) * n].float())


@pytest.mark.parametrize("root", range(SIZE))
def test_broadcast_from_every_root(root):
    t = data(RANK, torch.int32)
    dist.broadcast(t, root)
    assert torch.equal(t, data(root, torch.int32))


def test_barrier_and_a_subgroup():
    dist.barrier()
    members = list(range(0, SIZE, 2))
    group = dist.new_group(members)
    if RANK in members:
        t = data(RANK)
        dist.all_reduce(t, group=group)
        assert torch.equal(t, everyone()[members].sum(0).float())


def test_ranks_that_pass_different_shapes_raise_on_every_rank():
    if SIZE == 1:
        pytest.skip("one rank cannot disagree")
    t = torch.ones(3 + (RANK == SIZE - 1))
    with pytest.raises(ValueError, match="the ranks' calls differ"):
        dist.all_reduce(t)
    t = torch.ones(3)
    with pytest.raises(ValueError, match="differ"):
        dist.broadcast(t, 0 if RANK else SIZE - 1)
    dist.all_reduce(t)          # the group goes on
    assert torch.equal(t, torch.full((3,), float(SIZE)))


def _repeat_then(calls, steps=4):
    """A training loop's repeated calls (learnt after the first steps, then
    checked at no cost), with the sums checked."""
    for _ in range(steps):
        for n in calls:
            t = data(RANK, n=n)
            dist.all_reduce(t)
            assert torch.equal(t.double(), everyone(n).sum(0))


ODD = SIZE - 1
ODD_CALLS = {"shape": "all_reduce of float32 [7] on cpu, op sum",
             "dtype": "all_reduce of float64 [6] on cpu, op sum",
             "op": "all_reduce of float32 [6] on cpu, op max",
             "all_gather_into_tensor": "all_gather_into_tensor of float32 [6] on cpu",
             "barrier": "barrier",
             "gather": "gather (with tensors or settings the backend hands to its Python group)",
             "python_group_all_reduce": "all_reduce (with tensors or settings the backend hands "
                                        "to its Python group)"}


@pytest.mark.parametrize("odd_call", ["shape", "dtype", "op", "all_gather_into_tensor", "barrier",
                                      "gather", "python_group_all_reduce"])
def test_a_rank_that_leaves_a_repeated_sequence_raises_on_every_rank(odd_call):
    """After steps of the same calls the ranks check at no cost; one rank that
    then passes something else -- another shape, dtype or op, another
    collective, one the Python group takes, a tensor elsewhere -- is named on
    every rank, and the group goes on with right sums."""
    if SIZE == 1:
        pytest.skip("one rank cannot disagree")
    _repeat_then([6, 4])
    t = data(RANK, n=6)
    with pytest.raises(ValueError) as raised:
        if RANK != ODD:
            dist.all_reduce(t)
        elif odd_call == "shape":
            dist.all_reduce(data(RANK, n=7))
        elif odd_call == "dtype":
            dist.all_reduce(data(RANK, torch.float64))
        elif odd_call == "op":
            dist.all_reduce(t, op=OP.MAX)
        elif odd_call == "all_gather_into_tensor":
            dist.all_gather_into_tensor(torch.empty(6 * SIZE), t)
        elif odd_call == "barrier":
            dist.barrier()
        elif odd_call == "gather":
            dist.gather(t, [torch.empty(6) for _ in range(SIZE)] if RANK == 0 else None, dst=0)
        elif odd_call == "python_group_all_reduce":
            dist.all_reduce(data(RANK, torch.bfloat16), op=OP.MIN)   # staged in float32
    message = str(raised.value)
    assert "the ranks' calls differ" in message
    others = list(range(SIZE - 1))
    assert f"rank(s) {others}: all_reduce of float32 [6] on cpu, op sum" in message
    assert f"rank(s) [{ODD}]: {ODD_CALLS[odd_call]}" in message
    _repeat_then([6, 4], steps=2)


def test_a_strided_tensor_on_one_rank_only_takes_the_same_path():
    """Whether a tensor is contiguous is not part of the check: a strided one
    goes through a contiguous copy, and its values come back."""
    for _ in range(3):
        base = data(RANK, n=12)
        t = base[::2] if RANK == 0 else base[::2].clone()
        dist.all_reduce(t)
        assert torch.equal(t.double(), everyone(12)[:, ::2].sum(0))
        if RANK == 0:
            assert torch.equal(base[1::2], data(RANK, n=12)[1::2])   # the rest untouched
        out = torch.empty(SIZE, 2 * 6)[:, ::2] if RANK == 0 else torch.empty(SIZE, 6)
        dist.all_gather_into_tensor(out, data(RANK))
        assert torch.equal(out.double(), everyone())


def test_a_destroyed_group_refuses_every_call():
    """destroy_process_group shuts the group's backend down (its check's
    communicator is freed): a call through a kept handle raises instead of
    reaching MPI."""
    group = dist.new_group(list(range(SIZE)))
    t = data(RANK)
    dist.all_reduce(t, group=group)
    assert torch.equal(t.double(), everyone().sum(0))
    dist.destroy_process_group(group)
    with pytest.raises(RuntimeError, match="all_reduce on a group that was shut down"):
        group.allreduce([data(RANK)]).wait()
    with pytest.raises(RuntimeError, match="gather on a group that was shut down"):
        group.gather([[torch.empty(6) for _ in range(SIZE)]] if RANK == 0 else [],
                     [data(RANK)], dist.GatherOptions()).wait()
    dist.all_reduce(t)          # the default group is untouched
    assert torch.equal(t.double(), SIZE * everyone().sum(0))


@pytest.mark.skipif(SIZE < 2, reason="excludes a rank")
def test_shrink_group_goes_on_without_the_excluded_rank():
    """torch's shrink_group: the remaining ranks (only they call it) get a
    group of themselves, whose sums are theirs; the old group is destroyed;
    every rank passed the same ranks_to_exclude (a check over the new group)."""
    group = dist.new_group(list(range(SIZE)))
    gone = SIZE - 1
    if RANK != gone:
        shrunk = dist.shrink_group([gone], group=group)
        assert shrunk.size() == SIZE - 1 and shrunk.rank() == RANK
        assert dist.get_process_group_ranks(shrunk) == list(range(SIZE - 1))
        t = data(RANK)
        dist.all_reduce(t, group=shrunk)
        assert torch.equal(t.double(), everyone()[:gone].sum(0))
        dist.destroy_process_group(shrunk)
    dist.barrier()


def _backend():
    return dist.group.WORLD._get_backend(torch.device("cpu"))


@pytest.mark.parametrize("meta", ["output", "input"])
def test_tensors_on_two_devices_are_refused_naming_both(meta):
    """A call's tensors on two devices raise naming both, before anything is
    sent; the group goes on. (The meta device stands in for a GPU: torch's
    dispatcher would send a meta tensor to its own no-op kernel, so the
    backend is called as the dispatcher calls it.)"""
    output = torch.empty(6 * SIZE, device="meta" if meta == "output" else "cpu")
    data_in = data(RANK).to("meta" if meta == "input" else "cpu")
    with pytest.raises(ValueError, match=r"all_gather_into_tensor: the tensors are on "
                                         r"(cpu and meta|meta and cpu): a collective's tensors "
                                         r"must all be on one device"):
        _backend()._allgather_base(output, data_in, c10d.AllgatherOptions())
    with pytest.raises(ValueError, match="all_gather: the tensors are on"):
        _backend().allgather([[torch.empty(6, device="meta") for _ in range(SIZE)]],
                             [data(RANK)], c10d.AllgatherOptions())
    t = data(RANK)
    dist.all_reduce(t)
    assert torch.equal(t.double(), everyone().sum(0))


def test_a_meta_tensor_alone_is_refused():
    opts = c10d.AllreduceOptions()
    with pytest.raises(ValueError, match="meta device, which holds no values"):
        _backend().allreduce([torch.ones(3, device="meta")], opts)


def test_functional_collectives():
    """What torch.compile traces DDP, FSDP2 and DTensor into: the dispatcher's
    ops, which reach only a registered c10d::Backend."""
    group = dist.group.WORLD
    x = data(RANK)
    assert torch.equal(funcol.all_reduce(x, "sum", group), everyone().sum(0).float())
    gathered = funcol.all_gather_single(data(RANK, n=2), 0, group)
    assert torch.equal(gathered, torch.cat([data(r, n=2) for r in range(SIZE)]))
    scattered = funcol.reduce_scatter_single(data(RANK, n=2 * SIZE), "sum", 0, group)
    assert torch.equal(scattered, everyone(2 * SIZE).sum(0)[RANK * 2:RANK * 2 + 2].float())


def test_functional_all_reduce_under_compile():
    @torch.compile(backend="eager", fullgraph=True)
    def step(x):
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    assert torch.equal(step(data(RANK)), everyone().sum(0).float() * 2 + 1)


def ddp_against_reference(wrap):
    """Three SGD steps of DDP (as `wrap` makes it) on each rank's own batches,
    against one process training on the mean of every rank's loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference.load_state_dict(model.state_dict())
    ddp = wrap(torch.nn.parallel.DistributedDataParallel(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        batches = [torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + r))
                   for r in range(SIZE)]
        opt.zero_grad()
        ddp(batches[RANK]).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        torch.stack([reference(b).pow(2).mean() for b in batches]).mean().backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_ddp_matches_a_single_process_reference():
    ddp_against_reference(lambda ddp: ddp)


def test_compiled_ddp_with_dynamos_ddp_optimizer():
    """torch.compile(DDP) with optimize_ddp: the graph split at the buckets."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(optimize_ddp=True):
        ddp_against_reference(lambda ddp: torch.compile(ddp, backend="eager"))


def test_dtensor_redistribute_under_compile():
    """A DTensor sharded by rows, made whole again inside a compiled function:
    the all_gather reaches the backend as a functional collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (SIZE,))
    full = everyone(4).float()
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(sharded.to_local(), full[RANK:RANK + 1])

    @torch.compile(backend="eager")
    def whole_and_doubled(x):
        return x.redistribute(mesh, [Replicate()]).to_local() * 2

    assert torch.equal(whole_and_doubled(sharded), full * 2)


def test_the_profiler_records_each_call():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.all_reduce(torch.ones(4))
        dist.broadcast(torch.ones(4), 0)
    names = {e.name for e in prof.events()}
    assert {"mpidp:all_reduce", "mpidp:broadcast"} <= names, sorted(names)


def test_the_python_group_alone(monkeypatch):
    """MPIDP_C10D_IMPL=python (and a build without torch): the Python group
    runs every call the C++ backend would have run itself."""
    from mpidp.c10d._process_group import ProcessGroupMPIDP
    monkeypatch.setenv("MPIDP_C10D_IMPL", "python")
    group = dist.new_group(backend="mpidp")
    assert isinstance(group, ProcessGroupMPIDP)
    t = data(RANK)
    dist.all_reduce(t, group=group)
    assert torch.equal(t, everyone().sum(0).float())
    out = torch.empty(SIZE * 2)
    dist.all_gather_single(out, data(RANK, n=2), group=group)
    assert torch.equal(out, torch.cat([data(r, n=2) for r in range(SIZE)]))
    part = torch.empty(2)
    dist.reduce_scatter_single(part, data(RANK, n=2 * SIZE), group=group)
    assert torch.equal(part, everyone(2 * SIZE).sum(0)[RANK * 2:RANK * 2 + 2].float())
    b = data(RANK)
    dist.broadcast(b, SIZE - 1, group=group)
    assert torch.equal(b, data(SIZE - 1))
    dist.destroy_process_group(group)


@pytest.mark.parametrize("setting, values", [("MPIDP_C10D_IMPL", ("cpp", "python")),
                                             ("MPIDP_C10D_CHECK", ("1", "0")),
                                             ("MPIDP_C10D_DEVICE_COMM", ("auto", "standin"))])
def test_a_setting_that_differs_across_ranks_is_refused(monkeypatch, setting, values):
    """A rank that checks, runs the other implementation, or moves tensors
    by another path would pair its collective with another rank's other
    one: refused on every rank when the group is made."""
    if SIZE == 1:
        pytest.skip("one rank cannot differ")
    monkeypatch.setenv(setting, values[RANK == SIZE - 1])
    with pytest.raises(ValueError, match=rf"{setting}.* differs across the group's ranks: "
                                         rf"rank\(s\) \[{SIZE - 1}\]"):
        dist.new_group(backend="mpidp")
