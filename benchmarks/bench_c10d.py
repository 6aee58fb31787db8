"""torch.distributed over the "mpidp" backend against gloo, and against
mpidp.DataParallel and mpi4py, at the ranks it is started on.

    mpirun -np 2 python benchmarks/bench_c10d.py [--quick] [--json] [--impl cpp|python]

One process tree: the default group is gloo (made from MPI by
mpidp.init_process_group) and an "mpidp" group of the same ranks sits
beside it, so every method runs on the same processes and data, taking
turns in several rounds (median of each method's mean step time; the
slowest rank counts). Three tables:
  1. DDP step time on bench_step's models (the 500-tensor MLP, ResNet-18):
     local (no communication), DDP over gloo, DDP over "mpidp",
     mpidp.DataParallel (blocking), and DDP with no communication at all (a
     comm hook handing each bucket back: DDP's own floor); the
     communication overhead over the local step and its ratios, and each
     backend's time above DDP's floor (goal: "mpidp"'s at most 0.7x gloo's).
  2. FSDP2 (fully_shard of eight Linear(256, 256)) step time over gloo and
     over "mpidp" (goal: "mpidp" <= 0.5x gloo).
  3. all_reduce, all_gather_into_tensor and reduce_scatter_tensor through
     dist on the "mpidp" group against mpi4py's blocking Allreduce,
     Allgather and Reduce_scatter_block on the same buffers, 1 KB to 64 MB
     (goal: >= 0.95x mpi4py's bandwidth from 256 KB, or what torch's
     dispatch floor leaves of it: mpi4py's time / (mpi4py's time + the
     floor)), and the same calls at 1 and 16 KB on torch's "fake" backend,
     which does nothing: torch's dispatch floor (goal: the time above
     mpi4py's at most that floor + 3 us). mpi4py works on the tensors' own
     memory.
  4. Per call under load (--only percall): a loop of 1 KB all_reduce
     through dist on the "mpidp" group against mpi4py's blocking Allreduce
     on the same buffer, taking turns, first on a quiet machine, then with
     --busy processes spinning beside the ranks (data-loader workers,
     another job); the ratio to mpi4py in each, and how much each grows
     under load (goal: "mpidp"'s ratio under load at most 1.5x its quiet
     one).
  5. Overlap: a step of 4 MB all_reduce beside compute (matmuls), on gloo
     and on "mpidp": compute alone (the floor), blocking (all_reduce then
     compute), non-blocking (post, compute, wait) and non-blocking with its
     future asked for (as DDP does: "mpidp" then drives it on its progress
     thread). What overlap hides shows only where a core is free for it.
--impl picks the "mpidp" group's implementation (MPIDP_C10D_IMPL)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpidp  # noqa: E402
from models import ManyTensorMLP, ResNet18  # noqa: E402
from mpidp import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
# Sizes at which a call's time is its per-call cost, not its bandwidth.
PER_CALL_BYTES = 1 << 14


def slowest(seconds: float) -> float:
    return max(COMM.allgather(seconds))


def timed(fn, repeats: int) -> float:
    COMM.Barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    COMM.Barrier()
    return (time.perf_counter() - t0) / repeats


def rounds_of(methods: dict, rounds: int, repeats: int) -> dict:
    for fn in methods.values():       # warm-up: allocators, buckets, connections
        fn()
        fn()
    samples = {m: [] for m in methods}
    for _ in range(rounds):
        for m, fn in methods.items():
            samples[m].append(timed(fn, repeats))
    return {m: slowest(statistics.median(s)) for m, s in samples.items()}


def train_step(net, opt, x, y):
    def run():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return run


def _no_communication(state, bucket):
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def ddp_table(mpidp_group, quick, rounds, steps):
    rows = []
    for name in ("mlp", "resnet18"):
        torch.manual_seed(0)
        if name == "mlp":
            base, x, y = ManyTensorMLP(), torch.randn(32, 32), torch.randint(0, 10, (32,))
        else:
            base = ResNet18(width=32 if quick else 64)
            x, y = torch.randn(8 if quick else 16, 3, 32, 32), torch.randint(0, 10, (8 if quick else 16,))
        methods = {}
        local = copy.deepcopy(base)
        methods["local"] = train_step(local, torch.optim.SGD(local.parameters(), lr=0.01), x, y)
        for label, group in (("ddp-gloo", None), ("ddp-mpidp", mpidp_group)):
            ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                            process_group=group)
            methods[label] = train_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), x, y)
        # DDP's own cost with no communication at all (a comm hook that hands
        # the bucket back): the floor any backend's DDP overhead sits on.
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        ddp.register_comm_hook(None, _no_communication)
        methods["ddp-nocomm"] = train_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), x, y)
        model = copy.deepcopy(base)
        opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=True)
        methods["dataparallel"] = train_step(net, opt, x, y)
        t = rounds_of(methods, rounds, steps)
        over = {m: t[m] - t["local"] for m in t}
        # The goal's measure: each backend's time above DDP's own floor.
        above = {m: t[m] - t["ddp-nocomm"] for m in ("ddp-gloo", "ddp-mpidp")}
        rows.append({"model": name, **{m: t[m] * 1e3 for m in t},
                     "above_floor_vs_gloo": (above["ddp-mpidp"] / above["ddp-gloo"]
                                             if above["ddp-gloo"] > 0 else float("nan")),
                     "nocomm_overhead_vs_gloo": over["ddp-nocomm"] / over["ddp-gloo"],
                     "overhead_vs_gloo": over["ddp-mpidp"] / over["ddp-gloo"],
                     "overhead_vs_dataparallel": over["ddp-mpidp"] / over["dataparallel"]})
    return rows


def fsdp_table(mpidp_group, rounds, steps):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    times = {}
    methods = {}
    for label, group in (("fsdp2-gloo", dist.group.WORLD), ("fsdp2-mpidp", mpidp_group)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(32, 256)

        def run(model=model, opt=opt, x=x):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        methods[label] = run
    times = rounds_of(methods, rounds, steps)
    return [{**{m: times[m] * 1e3 for m in times},
             "mpidp_vs_gloo": times["fsdp2-mpidp"] / times["fsdp2-gloo"]}]


def fake_group():
    """A group on torch's "fake" backend, which returns at once: what
    dist.* costs in torch's wrapper and dispatch alone, the floor under any
    backend's per-call time."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    return dist.new_group(backend="fake")


def bandwidth_table(mpidp_group, quick, repeats):
    sizes = [1 << 10, 1 << 14, 1 << 18, 1 << 22] + ([] if quick else [1 << 26])
    floor_group = fake_group()
    rows = []
    per_call_floor = {}  # op -> torch's dispatch cost (us), timed at the smallest size
    for nbytes in sizes:
        n = nbytes // 4
        n -= n % SIZE
        # mpi4py works on the tensors' own memory: numpy's allocator asks for
        # transparent huge pages and torch's does not, which alone made
        # mpi4py's copies up to 1.8x faster at 64 MB than the same calls on
        # torch's buffers (measured here), a difference no backend can change.
        t, out_t, part_t = torch.ones(n), torch.empty(n * SIZE), torch.empty(n // SIZE)
        a, out_a, part_a = t.numpy(), out_t.numpy(), part_t.numpy()
        reps = max(3, min(repeats, (64 << 20) // max(nbytes, 1)))
        cases = {
            "all_reduce": (lambda: dist.all_reduce(t, group=mpidp_group),
                           lambda: COMM.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)),
            "all_gather_into_tensor": (
                lambda: dist.all_gather_into_tensor(out_t, t, group=mpidp_group),
                lambda: COMM.Allgather(a, out_a)),
            "reduce_scatter_tensor": (
                lambda: dist.reduce_scatter_tensor(part_t, t, group=mpidp_group),
                lambda: COMM.Reduce_scatter_block(a, part_a, op=MPI.SUM)),
        }
        fake = {"all_reduce": lambda: dist.all_reduce(t, group=floor_group),
                "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out_t, t,
                                                                              group=floor_group),
                "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part_t, t,
                                                                            group=floor_group)}
        for op, (ours, theirs) in cases.items():
            # The dispatch floor is the per-call goal's, so it is timed where
            # that goal applies (torch's "fake" all-gather writes its output:
            # at large sizes it times a memset, not dispatch).
            methods = {"mpidp": ours, "mpi4py": theirs}
            if nbytes <= PER_CALL_BYTES:
                methods["fake"] = fake[op]
            got = rounds_of(methods, 3, reps)
            floor = got.get("fake")
            if floor is not None:
                per_call_floor.setdefault(op, floor * 1e6)
            # Dispatch costs the same at every size, so no backend reached
            # through torch can exceed this fraction of mpi4py's bandwidth.
            attainable = got["mpi4py"] * 1e6 / (got["mpi4py"] * 1e6 + per_call_floor[op])
            rows.append({"op": op, "bytes": n * 4, "mpidp_us": got["mpidp"] * 1e6,
                         "mpi4py_us": got["mpi4py"] * 1e6,
                         "dispatch_floor_us": None if floor is None else floor * 1e6,
                         "attainable_vs_mpi4py": attainable,
                         "above_mpi4py_us": (got["mpidp"] - got["mpi4py"]) * 1e6,
                         "bandwidth_vs_mpi4py": got["mpi4py"] / got["mpidp"]})
    return rows


def percall_table(mpidp_group, rounds, busy):
    """1 KB all_reduce per call, quiet and with `busy` spinning processes
    (started by rank 0, on the same machine) beside the ranks."""
    import subprocess
    t = torch.ones(256)
    a = t.numpy()
    methods = {"mpidp": lambda: dist.all_reduce(t, group=mpidp_group),
               "mpi4py": lambda: COMM.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)}
    rows = []
    for load in (0, busy):
        spinners = []
        if RANK == 0:
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(load)]
        time.sleep(0.5 if load else 0.0)         # the spinners are running
        got = rounds_of(methods, rounds, 5000)
        for p in spinners:
            p.kill()
            p.wait()
        rows.append({"busy": load, "mpidp_us": got["mpidp"] * 1e6,
                     "mpi4py_us": got["mpi4py"] * 1e6, "ratio": got["mpidp"] / got["mpi4py"]})
    quiet, loaded = rows
    loaded["mpidp_growth"] = loaded["mpidp_us"] / quiet["mpidp_us"]
    loaded["mpi4py_growth"] = loaded["mpi4py_us"] / quiet["mpi4py_us"]
    loaded["ratio_vs_quiet"] = loaded["ratio"] / quiet["ratio"]
    return rows


def overlap_table(mpidp_group, rounds):
    """Step time of a 4 MB all_reduce beside ~10 ms of compute, per group
    and way of calling (see the module's docstring, table 4)."""
    t = torch.ones(1 << 20)
    a = torch.randn(400, 400)

    def compute():
        for _ in range(10):
            a @ a

    def step(group, how):
        def run():
            if how == "compute":
                compute()
            elif how == "blocking":
                dist.all_reduce(t, group=group)
                compute()
            else:
                work = dist.all_reduce(t, group=group, async_op=True)
                if how == "future":
                    work.get_future()
                compute()
                work.wait()
        return run

    methods = {"compute": step(None, "compute")}
    for name, group in (("gloo", None), ("mpidp", mpidp_group)):
        for how in ("blocking", "async", "future"):
            methods[f"{name}-{how}"] = step(group, how)
    times = rounds_of(methods, rounds, 10)
    return [{k: v * 1e3 for k, v in times.items()}]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and buffers")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", choices=("ddp", "fsdp", "bandwidth", "percall", "overlap"),
                        action="append")
    parser.add_argument("--busy", type=int, default=1,
                        help="spinning processes beside the ranks in the per-call table's "
                             "loaded half (default 1)")
    parser.add_argument("--impl", choices=("cpp", "python"), default="cpp",
                        help="the 'mpidp' group's implementation (MPIDP_C10D_IMPL)")
    args = parser.parse_args()
    if SIZE < 2:
        sys.exit("run it on 2 or more ranks: mpirun -np 2 python benchmarks/bench_c10d.py")
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    mpidp.init_process_group(backend="gloo")
    os.environ["MPIDP_C10D_IMPL"] = args.impl
    group = dist.new_group(backend="mpidp")
    only = set(args.only or ("ddp", "fsdp", "bandwidth", "percall", "overlap"))
    result = {"ranks": SIZE, "impl": args.impl}
    if "ddp" in only:
        result["ddp"] = ddp_table(group, args.quick, args.rounds, args.steps)
    if "fsdp" in only:
        result["fsdp"] = fsdp_table(group, args.rounds, args.steps)
    if "bandwidth" in only:
        result["bandwidth"] = bandwidth_table(group, args.quick, 20)
    if "percall" in only:
        result["percall"] = percall_table(group, args.rounds, args.busy)
    if "overlap" in only:
        result["overlap"] = overlap_table(group, args.rounds)
    if RANK != 0:
        return
    if args.json:
        print(json.dumps(result))
        return
    print(f"{SIZE} ranks, the 'mpidp' group in {args.impl}; times in ms (the slowest rank's median of {args.rounds} rounds)")
    for r in result.get("ddp", []):
        print(f"DDP {r['model']:9s} local {r['local']:8.2f}  gloo {r['ddp-gloo']:8.2f}  "
              f"mpidp {r['ddp-mpidp']:8.2f}  DataParallel {r['dataparallel']:8.2f}  "
              f"overhead: {r['overhead_vs_gloo']:.2f}x gloo's, "
              f"{r['overhead_vs_dataparallel']:.2f}x DataParallel's; DDP with no "
              f"communication {r['ddp-nocomm']:8.2f} ({r['nocomm_overhead_vs_gloo']:.2f}x gloo's "
              f"overhead); above that floor: {r['above_floor_vs_gloo']:.2f}x gloo's (goal: at most "
              "0.7x; nan: gloo at or below the floor, noise)")
    for r in result.get("fsdp", []):
        print(f"FSDP2 8 x Linear(256)  gloo {r['fsdp2-gloo']:8.2f}  mpidp {r['fsdp2-mpidp']:8.2f}"
              f"  = {r['mpidp_vs_gloo']:.2f}x")
    for r in result.get("percall", []):
        print(f"1 KB all_reduce per call, {r['busy']} busy process(es): mpidp "
              f"{r['mpidp_us']:.1f} us, mpi4py {r['mpi4py_us']:.1f} us = {r['ratio']:.2f}x", end="")
        if r["busy"]:
            print(f"; under load mpidp x{r['mpidp_growth']:.2f}, mpi4py x{r['mpi4py_growth']:.2f};"
                  f" ratio {r['ratio_vs_quiet']:.2f}x the quiet one (goal: at most 1.5x)")
        else:
            print()
    for r in result.get("overlap", []):
        print(f"overlap, 4 MB all_reduce beside compute ({r['compute']:.2f} ms alone): " + ", ".join(
            f"{name} blocking {r[name + '-blocking']:.2f} / non-blocking {r[name + '-async']:.2f}"
            f" / with its future {r[name + '-future']:.2f}" for name in ("gloo", "mpidp")))
    for r in result.get("bandwidth", []):
        print(f"{r['op']:24s} {r['bytes']:>10d} B  mpidp {r['mpidp_us']:10.1f} us  mpi4py "
              f"{r['mpi4py_us']:10.1f} us  ", end="")
        if r["dispatch_floor_us"] is None:
            print(f"bandwidth {r['bandwidth_vs_mpi4py']:.2f}x mpi4py's (goal: at least 0.95x, "
                  f"or {r['attainable_vs_mpi4py']:.2f}x where torch's dispatch floor allows less)")
        else:
            print(f"{r['above_mpi4py_us']:.1f} us above mpi4py, torch's dispatch floor "
                  f"{r['dispatch_floor_us']:.1f} us (goal: at most floor + 3 us)")


if __name__ == "__main__":
    main()
