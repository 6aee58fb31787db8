"""torch.distributed.shrink_group on "mpidp" groups after a rank's failure
(launched by tests/ft/test_fault_tolerance.py at 3 ranks), torch's own way
on without mpidp.recover(): a subgroup over every rank and the default
group sum rank + 1; launched rank 2 ends itself with SIGKILL; the survivors
see the failure in the subgroup's all_reduce, shrink the subgroup and then
the default group by excluding rank 2, and sum again on each.
FT_SHRINK_LIVE=1 instead: rank 0 alone excludes rank 1, which is alive and
does not take part; rank 0's shrink must end the job at the group's
deadline with a message saying why.
Prints "done <launched rank> <the sums> <world size>"."""

import datetime
import os
import signal

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidp

RANK = MPI.COMM_WORLD.Get_rank()


def total(group=None) -> float:
    t = torch.full((4,), float(RANK + 1))
    dist.all_reduce(t, group=group)
    return t[0].item()


dist.init_process_group("mpidp")
if os.environ.get("FT_SHRINK_LIVE"):
    sub = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    if RANK == 0:
        dist.shrink_group([1], group=sub)
    MPI.COMM_WORLD.Barrier()
    raise SystemExit("the job should have ended at the shrink's deadline")
sub = dist.new_group([0, 1, 2])
sums = [total(sub), total()]
if RANK == 2:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    total(sub)
    raise AssertionError("the subgroup's all_reduce should have seen rank 2's failure")
except mpidp.RanksLost:
    pass
sub = dist.shrink_group([2], group=sub)
sums.append(total(sub))
dist.shrink_group([2])           # the default group (torch destroys the others with it)
sums.append(total())
print(f"done {RANK} {sums} {dist.get_world_size()}", flush=True)
