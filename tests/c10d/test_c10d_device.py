"""The "mpidp" backend's device path (mpidp/c10d/_device.py) on CPUs: with
MPIDP_C10D_DEVICE_COMM=standin, all_reduce, broadcast,
all_gather_into_tensor and reduce_scatter_tensor of CPU tensors take the
path CUDA tensors take to NCCL -- the choice of the device communicator,
the contiguous copies, the averages, the results that land only at the
wait -- over the core's MPI stand-in. Each against the values every rank's
data gives, and DDP and FSDP2 against one process training on the union
of the ranks' data. On a GPU, scripts/gpu_check.sh's c10d step runs the
same calls on NCCL."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dp_reference import RANK, SIZE
from mpidp.c10d._process_group import ProcessGroupMPIDP
import test_c10d_training as training
from test_c10d_collectives import data, everyone

pytestmark = pytest.mark.ranks3
OP = dist.ReduceOp


@pytest.fixture(scope="module", autouse=True)
def standin_world():
    """The default group made with the stand-in (every rank sets it)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    before = os.environ.get("MPIDP_C10D_DEVICE_COMM")
    os.environ["MPIDP_C10D_DEVICE_COMM"] = "standin"
    try:
        dist.init_process_group("mpidp")
        yield
        dist.destroy_process_group()
    finally:
        if before is None:
            del os.environ["MPIDP_C10D_DEVICE_COMM"]
        else:
            os.environ["MPIDP_C10D_DEVICE_COMM"] = before


def python_group():
    """The default group's Python group (behind the C++ backend, or the group
    itself where mpidp was built without torch's headers)."""
    pg = dist.group.WORLD
    if isinstance(pg, ProcessGroupMPIDP):
        return pg
    return pg._get_backend(torch.device("cpu")).python_group


REDUCED = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
           torch.int32, torch.int64]


@pytest.mark.parametrize("dtype", REDUCED)
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX", "AVG"])
def test_all_reduce_on_the_device_path(dtype, op):
    if op == "AVG" and not dtype.is_floating_point:
        pytest.skip("AVG is defined for floating-point tensors (refused, as on the host path)")
    t = data(RANK, dtype)
    dist.all_reduce(t, op=getattr(OP, op))
    all_ = everyone(torch.float64)
    want = {"SUM": all_.sum(0), "PRODUCT": all_.prod(0), "MIN": all_.min(0).values,
            "MAX": all_.max(0).values, "AVG": all_.mean(0)}[op]
    torch.testing.assert_close(t, want.to(dtype), rtol=1e-2 if dtype in (
        torch.bfloat16, torch.float16) else 0, atol=0)
    assert python_group()._device._comms[torch.device("cpu")].kind == "standin"


def test_a_result_lands_only_at_the_wait():
    """As a device result is seen only by work ordered after it: the
    caller's tensor holds its own values until wait() (the stand-in, unlike
    MPI on host memory, never writes it earlier)."""
    t = data(RANK)
    work = dist.all_reduce(t, async_op=True)
    assert torch.equal(t, data(RANK))
    work.wait()
    torch.testing.assert_close(t, everyone(torch.float64).sum(0).float())


def test_a_strided_tensor_goes_through_a_contiguous_copy():
    base = torch.stack([data(RANK), data(RANK) * 10])      # 2 x 5
    t = base.t()                                           # 5 x 2, not contiguous
    dist.all_reduce(t)
    total = everyone(torch.float64).sum(0)
    want = torch.stack([total, total * 10]).t().float()
    torch.testing.assert_close(base.t(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64, torch.int16])
def test_broadcast_from_every_root(dtype):
    for root in range(SIZE):
        t = data(RANK, dtype)
        dist.broadcast(t, src=root)
        assert torch.equal(t, data(root, dtype))


def test_all_gather_into_tensor_and_reduce_scatter_tensor():
    out = torch.full((SIZE * 5,), -1.0)
    dist.all_gather_into_tensor(out, data(RANK))
    assert torch.equal(out, everyone(torch.float64).reshape(-1).float())
    flags = torch.empty(SIZE * 5, dtype=torch.bool)
    dist.all_gather_into_tensor(flags, data(RANK, torch.bool))
    assert torch.equal(flags, everyone(torch.bool).reshape(-1))
    for op, reduce in (("SUM", lambda a: a.sum(0)), ("AVG", lambda a: a.mean(0)),
                       ("MAX", lambda a: a.max(0).values)):
        send = torch.arange(SIZE * 4, dtype=torch.float32) * (RANK + 1)
        got = torch.empty(4)
        dist.reduce_scatter_tensor(got, send, op=getattr(OP, op))
        every = torch.stack([torch.arange(SIZE * 4, dtype=torch.float64) * (r + 1)
                             for r in range(SIZE)])
        torch.testing.assert_close(got, reduce(every)[RANK * 4:(RANK + 1) * 4].float())


def test_functional_collectives_reach_the_device_path():
    t = data(RANK)
    summed = funcol.all_reduce(t, "sum", dist.group.WORLD)
    torch.testing.assert_close(summed.wait() if hasattr(summed, "wait") else summed,
                               everyone(torch.float64).sum(0).float())
    gathered = funcol.all_gather_tensor(t, 0, dist.group.WORLD)
    torch.testing.assert_close(torch.as_tensor(gathered).reshape(-1),
                               everyone(torch.float64).reshape(-1).float())


@pytest.mark.skipif(SIZE == 1, reason="ranks that differ need two ranks")
def test_a_rank_whose_tensor_differs_raises_on_every_rank():
    t = data(RANK, torch.float64 if RANK == SIZE - 1 else torch.float32)
    with pytest.raises(ValueError, match="differ"):
        dist.all_reduce(t)
    t = data(RANK)                       # the group goes on
    dist.all_reduce(t)
    torch.testing.assert_close(t, everyone(torch.float64).sum(0).float())


def test_ddp_trains_like_one_process():
    net, batches = training.model(), training.batches(4)
    want = training.reference(net, batches)
    ddp = DDP(net, bucket_cap_mb=0.0002)          # several buckets in flight
    training.train(ddp, batches)
    training.assert_same(ddp.module, want)


def test_fsdp2_trains_like_one_process():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    batches = training.batches(3, features=16, outputs=16)
    want = training.reference(net, batches)
    mesh = init_device_mesh("cpu", (SIZE,))
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(net(training.mine(x)), training.mine(y)).backward()
        opt.step()
    full = {k: v.full_tensor() for k, v in net.state_dict().items()}
    for k, v in want.state_dict().items():
        torch.testing.assert_close(full[k], v, atol=1e-6, rtol=1e-4, msg=k)


# Users' habits with DDP, as tests/c10d/test_c10d_training.py checks them on the
# host path, here on the device path (this module's default group): bf16
# autocast, bucket sizes that differ across ranks, a rank that loaded other
# weights. Each compares with one process training on every rank's data.
test_ddp_under_cpu_autocast_trains_like_one_process = \
    training.test_ddp_under_cpu_autocast_trains_like_one_process
test_ddp_with_bucket_sizes_that_differ_across_ranks_trains_like_one_process = \
    training.test_ddp_with_bucket_sizes_that_differ_across_ranks_trains_like_one_process
test_ddp_starts_every_rank_from_rank_0s_weights = \
    training.test_ddp_starts_every_rank_from_rank_0s_weights


def test_the_habits_above_ran_on_the_device_path():
    assert python_group()._device._comms[torch.device("cpu")].kind == "standin"
