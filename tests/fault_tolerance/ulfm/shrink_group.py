"""torch.distributed.shrink_group on "mpidp" groups after a rank's failure
(launched by tests/fault_tolerance/ulfm/test_fault_tolerance.py at 3 ranks), torch's own way
on without mpidp.recover(): a subgroup over every rank and the default
group sum rank + 1; launched rank 2 ends itself with SIGKILL; the survivors
see the failure in the subgroup's all_gather_into_tensor (the core's
point-to-point allgather, waiting on rank 2's block), shrink the subgroup
and then the default group by excluding rank 2, and sum again on each, then
gather and reduce-scatter on the shrunk default group.
FT_SHRINK_LIVE=1 instead: rank 0 alone excludes rank 1, which is alive and
does not take part; rank 0's shrink must end the job at the group's
deadline with a message saying why.
Prints "done <launched rank> <the sums> <world size> <gathered> <reduced>"."""

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


def gathered(group) -> list:
    t = torch.full((2,), float(RANK + 1))
    out = torch.empty(2 * dist.get_world_size(group))
    dist.all_gather_into_tensor(out, t, group=group)
    return out[::2].tolist()


def reduced(group) -> float:
    """This rank's block of a reduce-scatter: block b of group rank g's input
    is b + g, so group rank r gets the sum over g of r + g."""
    t = torch.arange(dist.get_world_size(group), dtype=torch.float32) + dist.get_rank(group)
    out = torch.empty(1)
    dist.reduce_scatter_tensor(out, t, group=group)
    return out.item()


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
    gathered(sub)
    raise AssertionError("the subgroup's all_gather should have seen rank 2's failure")
except mpidp.RanksLost:
    pass
sub = dist.shrink_group([2], group=sub)
sums.append(total(sub))
dist.shrink_group([2])           # the default group (torch destroys the others with it)
sums.append(total())
print(f"done {RANK} {sums} {dist.get_world_size()} {gathered(None)} {reduced(None)}", flush=True)
