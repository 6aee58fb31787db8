"""What runs on the "mpidp" backend, each against one process training on
the union of every rank's data: DDP (plain, comm hooks, no_sync, join for
uneven inputs, static_graph, find_unused_parameters), FSDP2 with and
without mixed precision, DTensor on a 2-D mesh, torch.distributed.checkpoint
and DistributedSampler; and users' habits with DDP on it: bf16 autocast,
bucket sizes that differ across ranks, a rank that loaded other weights."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from c10d_world import mpidp_world  # noqa: F401  (the "mpidp" default group)
from dp_reference import RANK, SIZE, seeded

pytestmark = pytest.mark.ranks3
BATCH = 4   # per rank


def batches(steps, features=8, outputs=3, seed=1):
    g = seeded(seed)
    return [(torch.randn(SIZE * BATCH, features, generator=g),
             torch.randn(SIZE * BATCH, outputs, generator=g)) for _ in range(steps)]


def mine(t):
    return t[RANK * BATCH:(RANK + 1) * BATCH]


def model(seed=0, features=8, outputs=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, outputs))


def reference(net, data, lr=0.1):
    """One process, every rank's batch at once (the mean loss over the union)."""
    net = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return net


def train(ddp, data, lr=0.1, autocast=False):
    """Each rank's share of every batch, one SGD step each (what reference() does
    on the union)."""
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.mse_loss(ddp(mine(x)), mine(y))
        loss.backward()
        opt.step()


def assert_same(a, b, atol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=atol, rtol=1e-5, msg=name)


@pytest.mark.parametrize("flavour", ["plain", "static_graph", "find_unused", "bucket_small"])
def test_ddp_trains_like_one_process(flavour):
    net, data = model(), batches(4)
    want = reference(net, data)
    kwargs = {"plain": {}, "static_graph": {"static_graph": True},
              "find_unused": {"find_unused_parameters": True},
              "bucket_small": {"bucket_cap_mb": 0.0002}}[flavour]
    ddp = DDP(net, **kwargs)
    train(ddp, data)
    assert_same(ddp.module, want)


def test_ddp_with_sparse_embedding_gradients_trains_like_one_process():
    """nn.Embedding(sparse=True): DDP all-reduces its sparse gradients (a
    sparse all_reduce, as on gloo), the Linear's dense ones as usual."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(20, 6, sparse=True), nn.Flatten(), nn.Linear(12, 3))
    g = seeded(3)
    data = [(torch.randint(0, 20, (SIZE * BATCH, 2), generator=g),
             torch.randn(SIZE * BATCH, 3, generator=g)) for _ in range(4)]
    ref = reference(net, data)
    ddp = DDP(copy.deepcopy(net))
    train(ddp, data)
    assert_same(ddp.module, ref, atol=1e-5)


def test_ddp_no_sync_accumulates_like_one_process():
    net, data = model(), batches(4)
    # the reference: two batches' gradients summed, one step per pair
    ref = copy.deepcopy(net)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(0, 4, 2):
        ropt.zero_grad()
        for x, y in data[i:i + 2]:
            nn.functional.mse_loss(ref(x), y).backward()
        ropt.step()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for i in range(0, 4, 2):
        opt.zero_grad()
        with ddp.no_sync():
            nn.functional.mse_loss(ddp(mine(data[i][0])), mine(data[i][1])).backward()
        nn.functional.mse_loss(ddp(mine(data[i + 1][0])), mine(data[i + 1][1])).backward()
        opt.step()
    assert_same(ddp.module, ref)


def test_ddp_bf16_compress_hook_is_close_to_one_process():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    net, data = model(), batches(3)
    want = reference(net, data)
    ddp = DDP(net)
    # DDP refuses the hook by name without CUDA and NCCL; the hook itself
    # (bfloat16 all_reduce, then decompress) runs on any backend.
    def bf16_hook(state, bucket):
        return default_hooks.bf16_compress_hook(state, bucket)
    ddp.register_comm_hook(None, bf16_hook)
    train(ddp, data)
    assert_same(ddp.module, want, atol=2e-3)
    # every rank holds the same model
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    top, low = flat.clone(), flat.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    assert torch.equal(top, low)


# torch's powerSGD_hook calls torch.cuda.synchronize(the gradients' device)
# whenever CUDA is available, which fails for CPU gradients on any backend.
@pytest.mark.skipif(torch.cuda.is_available(), reason="torch's powerSGD_hook cannot run on CPU "
                    "gradients where CUDA is available (torch.cuda.synchronize of a CPU device)")
def test_ddp_powersgd_hook_keeps_replicas_equal_and_learns():
    """PowerSGD's callbacks start collectives and wait for them inside
    other collectives' futures (once a deadlock of the progress thread).
    Its first two steps are plain allreduces (equal to one process), the
    later ones compressed: replicas stay equal and the loss on the union of
    the data falls."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    net, data = model(), batches(6)
    union = lambda m: sum(nn.functional.mse_loss(m(x), y).item() for x, y in data)  # noqa: E731
    before = union(net)
    ddp = DDP(net)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, min_compression_rate=0.5)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step, (x, y) in enumerate(data + data):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(mine(x)), mine(y)).backward()
        opt.step()
        if step == 1:
            assert_same(ddp.module, reference(model(), data[:2]))
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    top, low = flat.clone(), flat.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    assert torch.equal(top, low)
    assert union(ddp.module) < before


def test_ddp_join_with_uneven_inputs_matches_the_simulation():
    """Rank r has r + 1 batches; joined ranks contribute zero gradients and
    DDP divides by the world size, so each step's gradient is the sum of
    the active ranks' mean-loss gradients over SIZE."""
    net, data = model(), batches(SIZE)
    ref = copy.deepcopy(net)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(SIZE):
        ropt.zero_grad()
        active = [r for r in range(SIZE) if step < r + 1]
        for r in active:
            x, y = data[step]
            (nn.functional.mse_loss(ref(x[r * BATCH:(r + 1) * BATCH]),
                                    y[r * BATCH:(r + 1) * BATCH]) / SIZE).backward()
        ropt.step()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        for step in range(RANK + 1):
            x, y = data[step]
            opt.zero_grad()
            nn.functional.mse_loss(ddp(mine(x)), mine(y)).backward()
            opt.step()
    assert_same(ddp.module, ref)


@pytest.mark.parametrize("mixed", [False, True])
def test_fsdp2_trains_like_one_process(mixed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    data = batches(3, features=16, outputs=16)
    want = reference(net, data)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed else MixedPrecisionPolicy()
    # The mesh is named: without one, fully_shard moves the model to CUDA where it is available.
    mesh = init_device_mesh("cpu", (SIZE,))
    for layer in net:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(net(mine(x)), mine(y)).backward()
        opt.step()
    full = {k: v.full_tensor() for k, v in net.state_dict().items()}
    for k, v in want.state_dict().items():
        torch.testing.assert_close(full[k], v, atol=3e-2 if mixed else 1e-6, rtol=1e-4, msg=k)


@pytest.mark.skipif(SIZE != 4, reason="a 2 x 2 mesh")
def test_dtensor_redistribute_on_a_2d_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    assert d.to_local().shape == (4, 3)
    assert torch.equal(d.redistribute(mesh, [Replicate(), Replicate()]).to_local(), full)
    assert torch.equal(d.redistribute(mesh, [Shard(1), Replicate()]).full_tensor(), full)
    local = torch.full((2, 2), float(RANK))
    p = torch.distributed.tensor.DTensor.from_local(local, mesh, [Partial(), Partial()])
    assert torch.equal(p.full_tensor(), torch.full((2, 2), float(sum(range(SIZE)))))
    dp_group = mesh.get_group("dp")
    t = torch.tensor([float(RANK)])
    dist.all_reduce(t, group=dp_group)
    tp = RANK % 2
    assert t.item() == tp + (tp + 2)


def test_distributed_checkpoint_save_and_load_across_ranks(tmp_path_factory):
    import torch.distributed.checkpoint as dcp
    from mpidp import MPI
    path = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("dcp")) if RANK == 0 else None)
    net = model(seed=3)
    state = {"model": net.state_dict(), "step": torch.tensor(RANK * 0 + 7)}
    dcp.save(state, checkpoint_id=path)
    other = model(seed=4)
    loaded = {"model": other.state_dict(), "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=path)
    other.load_state_dict(loaded["model"])
    assert loaded["step"].item() == 7
    assert_same(other, net, atol=0)


def test_distributed_sampler_shards_by_backend_rank():
    from torch.utils.data import DistributedSampler
    sampler = DistributedSampler(list(range(SIZE * 5)), shuffle=False)
    assert sampler.num_replicas == SIZE and sampler.rank == RANK
    got = [None] * SIZE
    dist.all_gather_object(got, list(sampler))
    assert sorted(sum(got, [])) == list(range(SIZE * 5))


def test_ddp_under_cpu_autocast_trains_like_one_process():
    """bf16 autocast on the CPU: the gradients DDP averages are float32
    (autocast leaves parameters and their gradients alone)."""
    net, data = model(), batches(3)
    ref = copy.deepcopy(net)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        grads = []
        for r in range(SIZE):          # each rank's slice on its own, as DDP computes it
            part = slice(r * BATCH, (r + 1) * BATCH)
            ropt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                nn.functional.mse_loss(ref(x[part]), y[part]).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, *per_rank in zip(ref.parameters(), *grads):   # DDP's average, in float32
            p.grad = torch.stack(per_rank).sum(0) / SIZE
        ropt.step()
    ddp = DDP(net)
    train(ddp, data, autocast=True)
    assert all(p.dtype is torch.float32 for p in ddp.parameters())
    assert_same(ddp.module, ref, atol=1e-5)


def test_ddp_with_bucket_sizes_that_differ_across_ranks_trains_like_one_process():
    """bucket_cap_mb set differently on one rank: DDP rebuilds its buckets
    after the first step from rank 0's layout, sent over the backend, so
    every rank all-reduces the same buckets and training is exact."""
    net, data = model(), batches(4)
    want = reference(net, data)
    ddp = DDP(net, bucket_cap_mb=0.0002 if RANK == 0 else 25)
    train(ddp, data)
    assert_same(ddp.module, want)


def test_ddp_starts_every_rank_from_rank_0s_weights():
    """A rank that loaded other weights (a stale checkpoint, another seed)
    gets rank 0's when DDP wraps the model (its broadcast over the backend),
    and training then matches one process started from rank 0's weights."""
    net, data = model(), batches(3)
    want = reference(net, data)
    mine_only = copy.deepcopy(net)
    if RANK != 0:
        with torch.no_grad():
            for p in mine_only.parameters():
                p.add_(float(RANK))
    ddp = DDP(mine_only)
    assert_same(ddp.module, net, atol=0)
    train(ddp, data)
    assert_same(ddp.module, want)


def test_compiled_ddp_trains_like_one_process():
    """torch.compile(DDP(model)): the group's calls (DDP broadcasts its
    buffers at every forward) run eagerly between the compiled graphs."""
    net, data = model(seed=5), batches(3, seed=5)
    net.register_buffer("seen", torch.arange(3.0) + RANK)   # broadcast from rank 0 per forward
    want = reference(net, data)
    ddp = DDP(net)
    train(torch.compile(ddp, backend="aot_eager"), data)
    assert_same(ddp.module, want)
    assert torch.equal(net.seen, torch.arange(3.0))


def test_a_gloo_side_group_without_a_store_is_refused_naming_what_works():
    with pytest.raises(RuntimeError, match=r"dist.new_group\(ranks, backend='mpidp'\) serves them"):
        dist.new_group(list(range(SIZE)), backend="gloo")
    side = dist.new_group(list(range(SIZE)), backend="mpidp")
    t = torch.full((2,), float(RANK))
    dist.all_reduce(t, group=side)
    assert t.tolist() == [float(sum(range(SIZE)))] * 2


def test_distributed_checkpoint_async_save(tmp_path_factory):
    import torch.distributed.checkpoint as dcp
    from mpidp import MPI
    path = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("dcp_async")) if RANK == 0 else None)
    net = model(seed=6)
    dcp.async_save({"model": net.state_dict()}, checkpoint_id=path).result()
    other = model(seed=7)
    loaded = {"model": other.state_dict()}
    dcp.load(loaded, checkpoint_id=path)
    other.load_state_dict(loaded["model"])
    assert_same(other, net, atol=0)
