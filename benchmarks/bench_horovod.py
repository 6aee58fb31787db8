"""Horovod's synthetic benchmark through mpidp.horovod.torch, against
mpidp.DataParallel on the same model, data and ranks.

    mpirun -np 2 python benchmarks/bench_horovod.py [--quick] [--json] [--device cuda]

The step is Horovod's pytorch_synthetic_benchmark.py's: zero_grad, forward
of a fixed random batch, cross-entropy, backward, step (SGD, lr 0.01 x
size). Methods take turns step by step, so that they share the machine's
drifts; each reports its images per second over all ranks from its median
step time:
  hvd          hvd.DistributedOptimizer (the script as Horovod users run it)
  hvd-fp16     the same with compression=hvd.Compression.fp16
  dp-block     mpidp.DataParallel, blocking
  dp-nb        mpidp.DataParallel, non-blocking (DataParallel's default)
Prints the table and hvd's ratio to each DataParallel mode, then how far
hvd's parameters are from dp-block's after the same steps on the same data
(both average the same gradients, so they should agree to rounding)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpidp  # noqa: E402
import mpidp.horovod.torch as hvd  # noqa: E402
from models import ResNet18  # noqa: E402

METHODS = ("hvd", "hvd-fp16", "dp-block", "dp-nb")


def build(method, base, device):
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    if method.startswith("hvd"):
        compression = hvd.Compression.fp16 if method == "hvd-fp16" else hvd.Compression.none
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        return model, opt
    dp_opt = mpidp.DataParallelOptimizer(opt)
    net = mpidp.DataParallel(model, optimizer=dp_opt,
                             blocking_parameter_updates=method == "dp-block")
    return net, dp_opt


def images_per_second(net, opt, x, y, steps, device) -> float:
    def settle():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        mpidp.MPI.COMM_WORLD.Barrier()
    settle()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    if hasattr(net, "synchronize"):
        net.synchronize()   # non-blocking DataParallel: the last update is part of the work
    settle()
    return x.shape[0] * hvd.size() * steps / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps (tests)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    hvd.init()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    width = 16 if args.quick else (64 if device.type == "cuda" else 32)
    base = ResNet18(width=width).to(device)
    batch = (8 if args.quick else 32) * (4 if device.type == "cuda" else 1)
    size = 32
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    # One step per turn, many rounds: the methods share the machine's slow
    # drifts (other load, frequency), and the median drops the steps a burst hit.
    rounds = args.rounds or (2 if args.quick else 40)
    steps = 1
    built = {m: build(m, base, device) for m in METHODS}
    for net, opt in built.values():          # warm-up: buckets, caches, first-touch
        images_per_second(net, opt, x, y, 1, device)
    results = {m: [] for m in METHODS}
    for r in range(rounds):
        order = METHODS if r % 2 == 0 else METHODS[::-1]
        for m in order:
            results[m].append(images_per_second(*built[m], x, y, steps, device))
    median = {m: statistics.median(v) for m, v in results.items()}
    for net, opt in built.values():
        if hasattr(net, "synchronize"):
            net.synchronize()
    hvd_model, dp_model = built["hvd"][0], built["dp-block"][0].module
    drift = max(float((a - b).detach().abs().max()) for a, b in zip(hvd_model.parameters(),
                                                           dp_model.parameters()))
    if hvd.rank() == 0:
        print(f"Horovod synthetic benchmark, ResNet-18 (width {width}), "
              f"batch {batch} x {size}x{size} per rank, {hvd.size()} rank(s), {device.type}, "
              f"median of {rounds} steps each, taken in turns")
        print(f"{'method':<10} {'images/s':>10} {'hvd / this':>11}")
        for m in METHODS:
            print(f"{m:<10} {median[m]:>10.1f} {median['hvd'] / median[m]:>11.3f}")
        print(f"hvd vs dp-block parameters after the same steps: max |difference| {drift:.3g}")
        if args.json:
            print(json.dumps({"images_per_s": median, "ranks": hvd.size(),
                              "device": device.type, "parameter_drift": drift}))


if __name__ == "__main__":
    main()
