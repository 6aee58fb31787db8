"""Soak test: does memory stay flat over long runs?

    ./scripts/mpirun.sh 2 .venv/bin/python benchmarks/soak.py [--json]
    MPIDP_RANKS_PER_NODE=1 ./scripts/mpirun.sh 2 ...   (DASO as 2 nodes x 1)

Runs 20,000 DataParallel steps (blocking and non-blocking alternating every
1,000 steps, bf16 wire on every other block) and 2,000 DASO steps (through
warm-up, cycling and cool-down) on a small model, sampling resident memory
(VmRSS). The goal: at the end within 5% of its value at step 1,000 (after
allocator warm-up), on every rank. Prints a table, or one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

import mpidp
from mpidp import MPI

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 10))


def soak_data_parallel(steps: int):
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    samples = {}
    nets = []
    for blocking in (True, False):
        for wire in (None, torch.bfloat16):
            m = model()
            opt = mpidp.DataParallelOptimizer(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
            nets.append((mpidp.DataParallel(m, optimizer=opt, blocking_parameter_updates=blocking,
                                            wire_dtype=wire), opt))
    start = time.perf_counter()
    for step in range(1, steps + 1):
        net, opt = nets[(step // 1000) % len(nets)]
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if step % 1000 == 0:
            samples[step] = rss_mib()
    return samples, time.perf_counter() - start


def soak_daso(steps: int):
    m = model()
    epochs, per_epoch = 20, steps // 20
    daso = mpidp.DASO(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), total_epochs=epochs,
                      warmup_epochs=2, cooldown_epochs=2)
    net = mpidp.DataParallelMultiGPU(m, daso)
    daso.last_batch = per_epoch - 1
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    samples, step = {}, 0
    start = time.perf_counter()
    for epoch in range(epochs):
        for _ in range(per_epoch):
            daso.zero_grad()
            F.cross_entropy(net(x), y).backward()
            daso.step()
            step += 1
            if step % 100 == 0:
                samples[step] = rss_mib()
        daso.epoch_loss_logic(1.0 / (epoch + 1))
    return samples, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dp-steps", type=int, default=20_000)
    parser.add_argument("--daso-steps", type=int, default=2_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dp, dp_s = soak_data_parallel(args.dp_steps)
    daso, daso_s = soak_daso(args.daso_steps)
    rows = []
    for name, samples, seconds, mark in (("DataParallel", dp, dp_s, 1000), ("DASO", daso, daso_s, 1000)):
        last = max(samples)
        ratio = samples[last] / samples[mark]
        rows.append((name, last, seconds, samples[mark], samples[last], ratio))
    everyone = COMM.gather(rows, root=0)
    if RANK != 0:
        return
    worst = {name: max(r[i][5] for r in everyone) for i, (name, *_rest) in enumerate(rows)}
    if args.json:
        out = {"ranks": SIZE}
        for i, (name, steps, seconds, *_rest) in enumerate(rows):
            key = name.lower()
            out[f"{key}_steps"] = steps
            out[f"{key}_seconds"] = round(seconds, 1)
            out[f"{key}_rss_end_over_1000"] = round(worst[name], 4)
        print(json.dumps(out))
        return
    print(f"soak at {SIZE} ranks: resident memory (MiB) at step 1,000 and at the end, worst rank")
    print(f"{'job':<13} {'steps':>6} {'seconds':>8} {'rss@1000':>9} {'rss@end':>8} {'end/1000':>9} goal<=1.05")
    for i, (name, steps, seconds, at_mark, at_end, _) in enumerate(rows):
        r = max(everyone, key=lambda rr: rr[i][5])[i]
        print(f"{name:<13} {steps:>6} {seconds:>8.1f} {r[3]:>9.1f} {r[4]:>8.1f} {worst[name]:>9.4f} "
              f"{'ok' if worst[name] <= 1.05 else 'NO'}")


if __name__ == "__main__":
    main()
