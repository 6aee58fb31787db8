"""A fault-tolerant program on torch.distributed alone (launched by
tests/fault_tolerance/ulfm/test_fault_tolerance.py at 3 ranks): the "mpidp" default group made
by dist.init_process_group, a dist.all_reduce of rank + 1 per step; launched
rank 2 ends itself with SIGKILL at step 3, the survivors recover() and go on.
Prints "done <launched rank> <the sums> <world size>" (FT_DIST_GROUPS=1, at
4 ranks: "... <losses seen>"; FT_DIST_REVERSED=1: the default group made by
mpidp.init_process_group over the job's ranks in reverse order, "... <the
launched ranks in the order of the default group's ranks>")."""

import os
import signal

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidp

LAUNCHED_RANK = MPI.COMM_WORLD.Get_rank()

# FT_DIST_GROUPS=1: the default group of each pair of ranks, made over its
# communicator (the Propulate recipe); a loss is recovered by its pair alone.
groups = bool(os.environ.get("FT_DIST_GROUPS"))
reversed_order = bool(os.environ.get("FT_DIST_REVERSED"))
worker = MPI.COMM_WORLD.Split(LAUNCHED_RANK // 2, LAUNCHED_RANK) if groups else None
if groups:
    mpidp.init_process_group(comm=worker, backend="mpidp")
elif reversed_order:
    mpidp.init_process_group(comm=MPI.COMM_WORLD.Split(0, -LAUNCHED_RANK), backend="mpidp")
else:
    dist.init_process_group("mpidp")
sums, step, losses = [], 0, 0
while step < 6:
    try:
        if LAUNCHED_RANK == 2 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        t = torch.full((4,), float(LAUNCHED_RANK + 1))
        dist.all_reduce(t)
        sums.append(t[0].item())
        step += 1
    except mpidp.RanksLost:
        losses += 1
        worker = mpidp.recover(comm=worker).comm
extra = f" {losses}" if groups else ""
if reversed_order:
    order = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(order, torch.full((1,), float(LAUNCHED_RANK)))
    extra = f" {[int(t.item()) for t in order]}"
print(f"done {LAUNCHED_RANK} {sums} {dist.get_world_size()}{extra}", flush=True)
