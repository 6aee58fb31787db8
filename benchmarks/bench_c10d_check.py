"""What the "mpidp" backend's check of each call costs (its C++ groups).

    ./scripts/mpirun.sh 2 .venv/bin/python benchmarks/bench_c10d_check.py [--calls N] [--rounds R] [--json]

Every collective of a C++ "mpidp" group is first checked across the ranks
(mpidp/callcheck.h: free while the program repeats calls the ranks agreed
on). This times N calls of a 1 KB all_reduce on a checked group and on an
unchecked one (MPIDP_C10D_CHECK=0 when the group is made) of the same
ranks, and mpi4py's blocking Allreduce of the same buffer as the floor,
taking turns round by round; reported are the medians (rank 0's) in
microseconds a call and the check's cost, checked minus unchecked (the
goal: at most 1 us).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import mpidp  # noqa: F401  (registers the backend)
from mpidp import MPI


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.pop("MPIDP_C10D_CHECK", None)
    dist.init_process_group("mpidp")
    checked = dist.group.WORLD
    os.environ["MPIDP_C10D_CHECK"] = "0"     # read when a group is made, on every rank
    unchecked = dist.new_group(list(range(dist.get_world_size())))
    os.environ.pop("MPIDP_C10D_CHECK")
    comm = MPI.COMM_WORLD
    t = torch.ones(256)
    a = t.numpy()
    times: dict = {"checked": [], "unchecked": [], "mpi4py": []}
    for _ in range(args.rounds):
        for name, group in (("checked", checked), ("unchecked", unchecked), ("mpi4py", None)):
            comm.Barrier()
            start = time.perf_counter()
            if group is None:
                for _ in range(args.calls):
                    comm.Allreduce(MPI.IN_PLACE, a)
            else:
                for _ in range(args.calls):
                    dist.all_reduce(t, group=group)
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
    if dist.get_rank() == 0:
        if args.json:
            print(json.dumps({"ranks": dist.get_world_size(), "us_per_call": med,
                              "check_us": med["checked"] - med["unchecked"]}))
        else:
            print(f"{dist.get_world_size()} ranks, 1 KB all_reduce, {args.calls} calls x "
                  f"{args.rounds} rounds (medians, us a call)")
            for k, v in med.items():
                print(f"  {k:10s} {v:7.2f}   rounds: {', '.join(f'{x:.1f}' for x in times[k])}")
            print(f"  the check costs {med['checked'] - med['unchecked']:.2f} us a call "
                  "(goal: at most 1 us)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
