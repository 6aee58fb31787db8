"""Training-step time of mpidp against torch DDP, at the ranks it is started on.

    mpirun -np 2 python benchmarks/bench_step.py [--json] [--quick] [--device cuda]

For each model, every method runs the same training step (forward, backward,
SGD step) on the same data; methods take turns in several rounds and each
reports the median over rounds of its mean step time. Methods:
  local         no communication at all (each rank trains alone): the floor
  mpidp-block   mpidp.DataParallel, blocking
  mpidp-nb      mpidp.DataParallel, non-blocking (update applied by the next forward)
  mpidp-nb-bf16 the same with gradients sent as bf16
  mpidp-block-staged, mpidp-nb-staged   (GPU only) blocking and non-blocking
                through pinned host buffers and MPI (MPIDP_DP_DEVICE_COMM=staging),
                beside the default, which sums on the device (NCCL) where every
                rank has a GPU of its own
  ddp           torch DistributedDataParallel, its defaults, over gloo on CPUs;
                on GPUs over NCCL when each rank has a GPU of its own, else
                gloo (NCCL refuses two ranks on one GPU)
  heat-block    Heat's DataParallel with a blocking DataParallelOptimizer,
  heat-nb       and non-blocking (CPU only; skipped, with the reason, when
                Heat is not installed: scripts/install_heat.sh)
Set MPIDP_HOOK_PROGRESS=0 to see mpidp without MPI progress from its hooks.
and, on rank 0 alone, the cost of mpidp's gradient hook per parameter, C++
and Python (a 1-rank DataParallel, hooked backward vs plain backward, on the
500-tensor MLP, CPU only), beside a no-op Python hook and, as the floor under
mpidp's C++ hook, a C++ hook that does nothing. Prints a table of step times and ratios against ddp and local.
--device cuda puts each rank's model and data on GPU local_rank (modulo the
GPUs there are) and synchronises the GPU before reading a clock.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpidp  # noqa: E402
from heat_baseline import import_heat  # noqa: E402
from models import ManyTensorMLP, ResNet18  # noqa: E402
from mpidp import MPI  # noqa: E402
from mpidp._engines import grad_hook_loader as _grad_hook_loader
from mpidp._runtime.flat_buffers import grad_view  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def make_case(name, quick, device):
    if name == "resnet18":
        model = ResNet18(width=32 if quick else 64)
        # A GPU needs a larger batch than a CPU core for a step worth timing.
        batch = (8 if quick else 16) * (8 if device.type == "cuda" else 1)
        x = torch.randn(batch, 3, 32, 32)
        y = torch.randint(0, 10, (batch,))
    else:
        model = ManyTensorMLP()
        x = torch.randn(32, 32)
        y = torch.randint(0, 10, (32,))
    return model.to(device), x.to(device), y.to(device)


def make_method(method, base, heat):
    """(module to call, optimizer to step)."""
    model = copy.deepcopy(base)
    if method == "local":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return model, opt
    if method.startswith("mpidp"):
        opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        saved = os.environ.get("MPIDP_DP_DEVICE_COMM")
        if method.endswith("-staged"):
            os.environ["MPIDP_DP_DEVICE_COMM"] = "staging"
        try:
            net = mpidp.DataParallel(model, optimizer=opt,
                                     blocking_parameter_updates=method.startswith("mpidp-block"),
                                     wire_dtype=torch.bfloat16 if method.endswith("bf16") else None)
        finally:
            if saved is None:
                os.environ.pop("MPIDP_DP_DEVICE_COMM", None)
            else:
                os.environ["MPIDP_DP_DEVICE_COMM"] = saved
        return net, opt
    if method == "ddp":
        first = next(model.parameters())
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[first.device.index] if first.is_cuda else None)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    if method.startswith("heat"):
        blocking = method == "heat-block"
        opt = heat.optim.DataParallelOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), blocking=blocking)
        return heat.nn.DataParallel(model, heat.MPI_WORLD, opt, blocking_parameter_updates=blocking), opt
    raise ValueError(method)


def _dp_path(device):
    """How DataParallel reduces this device's gradients by default here."""
    net = mpidp.DataParallel(torch.nn.Linear(2, 2).to(device))
    path = "device (NCCL)" if net._reducer.device_resident else "host staging"
    del net
    return path


def step(net, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    opt.step()


def settle(device):
    """Wait for the GPU's queued work (none on the CPU), then for every rank."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    COMM.Barrier()


def time_steps(net, opt, x, y, steps):
    settle(x.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(net, opt, x, y)
    if hasattr(net, "synchronize"):
        net.synchronize()  # non-blocking mode: the last update is part of the work
    settle(x.device)
    return (time.perf_counter() - t0) / steps


def bench_model(name, methods, rounds, steps, quick, device, heat):
    torch.manual_seed(0)
    base, x, y = make_case(name, quick, device)
    built = {m: make_method(m, base, heat) for m in methods}
    for net, opt in built.values():  # warm-up: allocator, buckets, gloo connections
        for _ in range(2):
            step(net, opt, x, y)
    samples = {m: [] for m in methods}
    for _ in range(rounds):
        for m in methods:
            samples[m].append(time_steps(*built[m], x, y, steps))
    # Every rank's time counts: the slowest rank sets the pace.
    return {m: max(COMM.allgather(statistics.median(s))) for m, s in samples.items()}


def hook_overhead_us(repeats):
    """Per-parameter cost of mpidp's gradient hook on rank 0 (one-rank
    communicator): the one DataParallel uses (C++ where built) and the Python
    fallback (MPIDP_GRAD_HOOK=python), and, as the floor any Python hook
    pays, of a no-op Python lambda registered as a post-accumulate-grad hook
    (torch's own cost of calling one), and of a C++ accumulator hook that
    does nothing (torch's cost of the hook mpidp's C++ one is). Returns
    (mpidp us/param, no-op us/param, Python-fallback us/param, C++ no-op
    us/param or None where the C++ hook is not built)."""
    torch.manual_seed(0)
    plain = ManyTensorMLP()
    hooked = copy.deepcopy(plain)
    net = mpidp.DataParallel(hooked, comm=MPI.COMM_SELF, blocking_parameter_updates=True)
    hooked_py = copy.deepcopy(plain)
    saved = os.environ.get("MPIDP_GRAD_HOOK")
    os.environ["MPIDP_GRAD_HOOK"] = "python"
    try:
        net_py = mpidp.DataParallel(hooked_py, comm=MPI.COMM_SELF, blocking_parameter_updates=True)
    finally:
        if saved is None:
            del os.environ["MPIDP_GRAD_HOOK"]
        else:
            os.environ["MPIDP_GRAD_HOOK"] = saved
    noop = copy.deepcopy(plain)
    for p in noop.parameters():
        p.register_post_accumulate_grad_hook(lambda _: None)
    # torch's own cost of a C++ accumulator hook, the floor under mpidp's:
    # the same hooks doing nothing, with gradients aliasing one flat buffer
    # as DataParallel's do (grad_view), so that only the hook differs.
    floor = copy.deepcopy(plain)
    floor_params = tuple(floor.parameters())
    flat = torch.zeros(sum(p.numel() for p in floor_params))
    offsets = itertools.accumulate((p.numel() for p in floor_params), initial=0)
    for p, off in zip(floor_params, offsets):
        p.grad = grad_view(flat, off, p)
    cpp = _grad_hook_loader.cpp_hook_module()
    floor_hooks = cpp.install_noop(floor_params) if cpp else None  # kept until we return
    x, y = torch.randn(32, 32), torch.randint(0, 10, (32,))
    n_params = len(list(plain.parameters()))

    def backward_time(module, forward):
        module.zero_grad(set_to_none=False)
        loss = F.cross_entropy(forward(x), y)
        t0 = time.perf_counter()
        loss.backward()
        return time.perf_counter() - t0

    # The backwards run in rounds and each overhead is the median of its
    # differences with the plain backward of the same round: a difference of
    # two separate medians drifts with whatever else the machine does by
    # more than the hooks cost. Each round runs them in a new order, so that
    # none always follows the same other (whose data it would find in, or
    # missing from, the caches).
    variants = [(plain, plain), (hooked, net), (noop, noop), (hooked_py, net_py), (floor, floor)]
    for _ in range(20):
        for v in variants:
            backward_time(*v)
    order = random.Random(0)
    runs = []
    for _ in range(repeats):
        times = [0.0] * len(variants)
        for k in order.sample(range(len(variants)), len(variants)):
            times[k] = backward_time(*variants[k])
        runs.append(times)
    per_param = [1e6 * statistics.median(r[k] - r[0] for r in runs) / n_params for k in (1, 2, 3, 4)]
    if floor_hooks is None:
        per_param[3] = None  # the C++ hook is not built: no C++ floor to show
    return tuple(per_param)


def overhead_over_heat(r):
    """mpidp's time over the local step divided by Heat's, per mode (none
    without Heat). Heat's DataParallel overlaps nothing in its blocking mode,
    so its overhead is its whole communication."""
    if "heat-block" not in r:
        return {}
    over = {m: r[m] - r["local"] for m in r}
    return {"block": over["mpidp-block"] / over["heat-block"], "nb": over["mpidp-nb"] / over["heat-nb"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--quick", action="store_true", help="a smaller, faster run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")
        device = torch.device("cuda", mpidp.topology().local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        mpidp.init_process_group(COMM)   # NCCL when each rank has its own GPU, else gloo
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(SIZE, 1)))
        mpidp.init_process_group(COMM, backend="gloo")
    backend = dist.get_backend()
    methods = ["local", "mpidp-block", "mpidp-nb", "mpidp-nb-bf16", "ddp"]
    if device.type == "cuda":
        methods[3:3] = ["mpidp-block-staged", "mpidp-nb-staged"]
    heat, heat_note = import_heat() if device.type == "cpu" else (None, "not on GPUs")
    if heat is not None:
        methods += ["heat-block", "heat-nb"]
    results = {}
    dp_path = _dp_path(device) if device.type == "cuda" else None
    for name in ("resnet18", "mlp500"):
        results[name] = bench_model(name, methods, args.rounds if not args.quick else 3,
                                    args.steps if name == "resnet18" else 4 * args.steps,
                                    args.quick, device, heat)
    hook = None
    if RANK == 0 and device.type == "cpu":
        hook = hook_overhead_us(repeats=100 if args.quick else 300)
    COMM.Barrier()
    if RANK != 0:
        return
    if args.json:
        out = {"ranks": SIZE, "device": str(device), "ddp_backend": backend}
        if device.type == "cuda":
            out["mpidp_path"] = dp_path
        if device.type == "cuda":
            out["gpu"] = torch.cuda.get_device_name(device)
        if hook:
            out.update(hook_us_per_param=round(hook[0], 3), noop_hook_us_per_param=round(hook[1], 3),
                       python_hook_us_per_param=round(hook[2], 3),
                       cpp_noop_hook_us_per_param=None if hook[3] is None else round(hook[3], 3),
                       hook_over_noop=round(hook[0] / hook[1], 3))
        for name, r in results.items():
            for m, t in r.items():
                out[f"{name}_{m}_ms"] = round(1e3 * t, 3)
            out[f"{name}_mpidp_over_ddp"] = round(r["mpidp-block"] / r["ddp"], 3)
            out[f"{name}_nb_over_ddp"] = round(r["mpidp-nb"] / r["ddp"], 3)
            out[f"{name}_nb_over_block"] = round(r["mpidp-nb"] / r["mpidp-block"], 3)
            if "mpidp-block-staged" in r:
                out[f"{name}_staged_over_ddp"] = round(r["mpidp-block-staged"] / r["ddp"], 3)
            for mode, ratio in overhead_over_heat(r).items():
                out[f"{name}_{mode}_overhead_over_heat"] = round(ratio, 3)
        out["heat"] = heat_note
        print(json.dumps(out))
        return
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"step time at {SIZE} ranks on {where}, DDP over {backend} (median of per-round means; "
          "slowest rank)" + (f"; mpidp's default path: {dp_path}" if dp_path else ""))
    print(f"{'model':<10} {'method':<14} {'ms/step':>9} {'vs ddp':>9} {'vs block':>9} {'vs local':>9}")
    for name, r in results.items():
        for m, t in r.items():
            print(f"{name:<10} {m:<14} {1e3 * t:9.2f} {t / r['ddp']:9.3f} "
                  f"{t / r['mpidp-block']:9.3f} {t / r['local']:9.3f}")
        for mode, ratio in overhead_over_heat(r).items():
            print(f"{name:<10} communication overhead over the local step, mpidp over Heat, "
                  f"{mode}: {ratio:.3f}")
    print(f"heat: {heat_note}" if heat is not None else f"heat: skipped: {heat_note}")
    if hook is None:
        return
    print(f"gradient hook, us per parameter (1 rank, 500 tensors, hooked minus plain backward): "
          f"mpidp's {hook[0]:.2f} ({_grad_hook_loader.describe()}), {hook[0] / hook[1]:.2f}x a "
          f"no-op Python hook's {hook[1]:.2f}; mpidp's Python fallback {hook[2]:.2f}")
    if hook[3] is not None:
        print(f"  of which torch's cost of any C++ accumulator hook (one that does nothing): "
              f"{hook[3]:.2f} = {hook[3] / hook[1]:.2f}x the no-op Python hook; mpidp's own work "
              f"{hook[0] - hook[3]:.2f}")


if __name__ == "__main__":
    main()
