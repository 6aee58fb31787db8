"""Memory and step time over many wrap / step / drop cycles of one model.

    .venv/bin/python benchmarks/bench_rewrap.py [--cycles 200]

Each cycle wraps the same model in a new DataParallel (with a new
DataParallelOptimizer), takes one training step and drops both. A wrapper
must leave nothing behind: no hooks on the parameters, no buckets waiting
for the garbage collector, no slower steps. Prints, per mode, the resident
memory added over the cycles (after gc) and the step time before and after.
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings

import torch

import mpidp


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def run(blocking: bool, cycles: int) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    x = torch.randn(16, 256)

    def wrap():
        opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        return mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=blocking), opt

    def step_ms(net, opt, n=50) -> float:
        start = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            net(x).sum().backward()
            opt.step()
        return (time.perf_counter() - start) / n * 1e3

    for _ in range(10):
        net, opt = wrap()
        step_ms(net, opt, 1)
    gc.collect()
    before_mib, before_ms = rss_mib(), step_ms(net, opt)
    for _ in range(cycles):
        net, opt = wrap()
        step_ms(net, opt, 1)
    gc.collect()
    hooks = len(next(model.parameters())._post_accumulate_grad_hooks or {})
    return rss_mib() - before_mib, before_ms, step_ms(net, opt), hooks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=200)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # each re-wrap warns that it replaces the previous wrapper
    print(f"{args.cycles} wrap/step/drop cycles of one model (8 x Linear(256, 256)), 1 rank")
    print(f"{'mode':<14} {'RSS added MiB':>14} {'step ms before':>15} {'after':>7} {'hooks':>6}")
    for blocking in (True, False):
        added, before, after, hooks = run(blocking, args.cycles)
        mode = "blocking" if blocking else "non-blocking"
        print(f"{mode:<14} {added:>14.1f} {before:>15.2f} {after:>7.2f} {hooks:>6}")


if __name__ == "__main__":
    main()
