"""What the ranks' agreement check costs the public collectives.

    ./scripts/mpirun.sh 2 .venv/bin/python benchmarks/bench_agreement.py [--reps R] [--json]

mpidp.allreduce and mpidp.broadcast first check that every rank passed the
same shape, dtype and settings (python/mpidp/_runtime/argument_agreement.py: one blocking
allreduce of 2 x 16 int64). This times each call with the check and the same
call without it (the unchecked path the algorithms use for their per-step
traffic), for 1, 1 Ki and 1 Mi float32 elements, round-robin, the ranks
meeting at a barrier before each call; reported are medians of the slowest
rank's microseconds and the ratio checked / unchecked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mpidp
from mpidp import MPI
from mpidp._runtime.mpi import resolve_comm
from mpidp.collectives import allreduce_agreed

COMM = MPI.COMM_WORLD


def timed(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        COMM.Barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    c = resolve_comm(None)
    rows = []
    for n in (1, 1024, 1 << 20):
        t = torch.ones(n)
        calls = {
            "allreduce": (lambda: mpidp.allreduce(t), lambda: allreduce_agreed(t)),
            "broadcast": (lambda: mpidp.broadcast(t), lambda: c.bcast(t, 0, False)),
        }
        for name, (checked, unchecked) in calls.items():
            checked(), unchecked()     # warm-up
            times = {"checked": [], "unchecked": []}
            for _ in range(3):         # round-robin rounds
                times["checked"].append(timed(checked, args.reps // 3))
                times["unchecked"].append(timed(unchecked, args.reps // 3))
            a, b = statistics.median(times["checked"]), statistics.median(times["unchecked"])
            rows.append({"call": name, "elements": n, "checked_us": round(a, 2),
                         "unchecked_us": round(b, 2), "extra_us": round(a - b, 2),
                         "ratio": round(a / b, 3)})
    if COMM.Get_rank() != 0:
        return
    if args.json:
        print(json.dumps({"ranks": COMM.Get_size(), "rows": rows}))
        return
    print(f"agreement check, {COMM.Get_size()} ranks, median of {args.reps} calls (us)")
    print(f"{'call':<10} {'elements':>9} {'checked':>9} {'unchecked':>10} {'extra':>8} "
          f"{'ratio':>6}")
    for r in rows:
        print(f"{r['call']:<10} {r['elements']:>9} {r['checked_us']:>9.1f} "
              f"{r['unchecked_us']:>10.1f} {r['extra_us']:>8.1f} {r['ratio']:>6.2f}")


if __name__ == "__main__":
    main()
