"""The "mpidp" torch.distributed backend on CUDA tensors (its device path:
NCCL where every rank has a GPU of its own, MPI on device pointers where
ranks share one and MPI is CUDA-aware, else host staging; the JSON's
"device_path" says which ran), checked against values computed here, and DDP on a CUDA model over
"mpidp" and over gloo, timed. Run at 2 or more ranks on a GPU machine:

    mpirun -np 2 python scripts/gpu/c10d_cuda.py

Every rank uses GPU (local rank % GPUs). Checks: each collective on CUDA
tensors (fp32, bf16, int64; async and blocking; a tensor made on a side
stream and reduced on it at once); DDP (fp32 and under bf16 autocast) and
FSDP2 on CUDA models, each rank with its own batch, against one process
training on every rank's batches. Prints one JSON line (rank 0): each
check's largest difference and whether it passed, and the step times;
exits 1 when a check fails."""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mpidp
from mpidp import MPI

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
local = COMM.Split_type(MPI.COMM_TYPE_SHARED)
# Without a GPU the same checks run on the CPU (a trial of the script itself).
if torch.cuda.is_available():
    DEV = torch.device("cuda", local.Get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(DEV)
else:
    DEV = torch.device("cpu")
IDS = [DEV] if DEV.type == "cuda" else None


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()
results: dict = {"ranks": SIZE, "checks": {}}


def check(name, got, want, tol=0.0):
    diff = (got.double().cpu() - want.double().cpu()).abs().max().item() if got.numel() else 0.0
    worst = max(COMM.allgather(diff))
    results["checks"][name] = {"max_diff": worst, "passed": worst <= tol}


def rank_data(r, n=1000, dtype=torch.float32):
    return ((torch.arange(n, dtype=torch.float64) % 7) + r + 1).to(dtype)


def collectives(group):
    everyone = torch.stack([rank_data(r) for r in range(SIZE)])
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        t = rank_data(RANK, dtype=dtype).to(DEV)
        dist.all_reduce(t, group=group)
        check(f"all_reduce sum {dtype}", t, everyone.sum(0).to(dtype))
    t = rank_data(RANK).to(DEV)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    check("all_reduce max", t, everyone.max(0).values)
    t = rank_data(RANK).to(DEV)
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group, async_op=True)
    got = work.get_future().wait()[0]
    check("all_reduce avg async future", got, everyone.mean(0), 1e-6)
    check("all_reduce avg async tensor", t, everyone.mean(0), 1e-6)
    t = rank_data(RANK).to(DEV)[::2]          # non-contiguous CUDA view
    dist.all_reduce(t, group=group)
    check("all_reduce strided", t, everyone.sum(0)[::2])
    t = rank_data(RANK).to(DEV)
    dist.broadcast(t, src=SIZE - 1, group=group)
    check("broadcast", t, everyone[SIZE - 1])
    out = torch.empty(SIZE * 1000, device=DEV)
    dist.all_gather_into_tensor(out, rank_data(RANK).to(DEV), group=group)
    check("all_gather_into_tensor", out, everyone.reshape(-1))
    part = torch.empty(1000 // SIZE, device=DEV)
    dist.reduce_scatter_tensor(part, rank_data(RANK, 1000 // SIZE * SIZE).to(DEV), group=group)
    n = 1000 // SIZE
    check("reduce_scatter_tensor", part,
          torch.stack([rank_data(r, n * SIZE) for r in range(SIZE)]).sum(0)[RANK * n:(RANK + 1) * n])
    send = (torch.arange(SIZE * 4, dtype=torch.float32) + 100 * RANK).to(DEV)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    want = torch.cat([torch.arange(RANK * 4, RANK * 4 + 4, dtype=torch.float32) + 100 * r
                      for r in range(SIZE)])
    check("all_to_all_single", recv, want)
    peer = (RANK + 1) % SIZE
    got = torch.empty(1000, device=DEV)
    reqs = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, rank_data(RANK).to(DEV), peer, group=group),
        dist.P2POp(dist.irecv, got, (RANK - 1) % SIZE, group=group)])
    for r in reqs:
        r.wait()
    check("isend/irecv", got, everyone[(RANK - 1) % SIZE])
    # A tensor a kernel on a side stream is still writing when the
    # collective is called on that stream: the staging copy must see it.
    side = torch.cuda.Stream() if DEV.type == "cuda" else None
    with torch.cuda.stream(side):
        a = torch.full((2048, 2048), float(RANK + 1), device=DEV)
        b = (a @ a) / 2048.0          # every element (RANK+1)^2
        dist.all_reduce(b, group=group)
        total = torch.tensor(float(sum((r + 1) ** 2 for r in range(SIZE))))
        check("side stream all_reduce", b[:4, :4], total.expand(4, 4), 1e-3)
    sync()


class MLP(torch.nn.Module):
    def __init__(self, width=64, depth=6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def batch(r, step, n=16):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(n, 64, generator=g).to(DEV), torch.randint(0, 10, (n,), generator=g).to(DEV)


def reference(base, steps, autocast):
    """One process, one model: the mean of every rank's loss each step."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        opt.zero_grad()
        for r in range(SIZE):
            x, y = batch(r, s)
            with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(model(x), y) / SIZE
            loss.backward()
        opt.step()
    return model


def ddp(group, base, steps, autocast):
    model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=IDS,
                                                      process_group=group, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        opt.zero_grad()
        x, y = batch(RANK, s)
        with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return model.module


def training(group):
    torch.manual_seed(0)
    base = MLP().to(DEV)
    for autocast in (False, True):
        want = reference(base, 5, autocast)
        got = ddp(group, base, 5, autocast)
        diff = torch.cat([(a - b).flatten() for a, b in
                          zip(got.parameters(), want.parameters())])
        check(f"DDP{' bf16 autocast' if autocast else ''} vs reference", diff,
              torch.zeros_like(diff), 1e-4 if autocast else 1e-5)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(group, DEV.type)
    model = copy.deepcopy(base)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(5):
        opt.zero_grad()
        x, y = batch(RANK, s)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    want = reference(base, 5, False)
    full = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    check("FSDP2 vs reference", full, torch.cat([p.flatten() for p in want.parameters()]), 1e-5)


def timing(group, steps=20, rounds=5):
    torch.manual_seed(0)
    base = MLP(width=256, depth=24).to(DEV)
    x = torch.randn(64, 256, device=DEV)
    y = torch.randint(0, 10, (64,), device=DEV)
    runs = {}
    for label, g in (("ddp-gloo", None), ("ddp-mpidp", group)):
        net = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=IDS,
                                                        process_group=g)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        def step(net=net, opt=opt):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        runs[label] = step
    samples = {k: [] for k in runs}
    for fn in runs.values():
        fn(), fn()
    for _ in range(rounds):
        for k, fn in runs.items():
            sync()
            COMM.Barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            sync()
            COMM.Barrier()
            samples[k].append((time.perf_counter() - t0) / steps)
    t = {k: max(COMM.allgather(statistics.median(v))) * 1e3 for k, v in samples.items()}
    results["ddp_cuda_ms"] = {**t, "mpidp_vs_gloo": t["ddp-mpidp"] / t["ddp-gloo"],
                              "model": f"MLP 256 x 24 on {DEV.type}, batch 64"}


def main():
    if SIZE < 2:
        sys.exit("run it at 2 or more ranks")
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    mpidp.init_process_group(backend="gloo")
    group = dist.new_group(backend="mpidp")
    collectives(group)
    python_group = group if hasattr(group, "_device") else group._get_backend(DEV).python_group
    device = python_group._device
    results["device_path"] = {str(d): (dc.kind if dc is not None else "host staging")
                              for d, dc in (device._comms.items() if device else ())}
    training(group)
    timing(group)
    passed = all(c["passed"] for c in results["checks"].values())
    results["passed"] = passed
    if RANK == 0:
        print(json.dumps(results))
        for name, c in results["checks"].items():
            print(f"{'ok  ' if c['passed'] else 'FAIL'} {name}: max diff {c['max_diff']:.3g}",
                  file=sys.stderr)
    dist.destroy_process_group()
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
