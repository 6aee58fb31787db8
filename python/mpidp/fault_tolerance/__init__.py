"""Fault-tolerant mode: training goes on when ranks die (MPI's ULFM).

Asked for with MPIDP_FAULT_TOLERANCE=1 (or mpidp.enable_fault_tolerance()),
under an MPI with the ULFM extension launched with it on (Open MPI 5:
``mpirun --with-ft ulfm``). The default mode is unchanged: a lost rank ends
the job.

The rule, on every survivor alike:

- A training step is a transaction. Its end (the optimizer's step under
  DataParallel) is an agreement of every rank (MPIX_Comm_agree, which either
  succeeds everywhere or fails everywhere). A step in which a rank died is
  discarded by every survivor: nobody applies it, whether or not its own
  gradient averaging happened to complete.
- Every survivor raises mpidp.RanksLost within that step: where it saw the
  failure (forward, backward, any mpidp collective) or at the step's end.
  The rank that sees a failure first revokes every communicator of mpidp, so
  no survivor waits on a rank that is gone or busy recovering.
- The training loop catches RanksLost and calls mpidp.recover(): the
  survivors agree on who died, shrink the world to themselves (rank order
  kept), and every algorithm that ran over the world is set up again over
  the survivors. recover() returns the new Membership, so the loop re-shards
  its data (DistributedSampler(num_replicas=m.size, rank=m.rank)) and may
  scale its learning rate; mpidp.rank(), size(), topology() and
  MPI.COMM_WORLD passed to mpidp follow.

Why an exception and not a callback or a generator of steps: the failed step
must be abandoned wherever each survivor is in it (a callback cannot unwind
a backward pass), and the loop -- which alone knows its sampler, its step
counter and its batch -- decides what to do next. It is the pattern of
Horovod's elastic mode and torchft's should_commit, in one except clause.

Worker groups: an algorithm over a communicator split off the world agrees
on its steps among that communicator's ranks only, so a rank's death stops
only its group, whose survivors call recover(comm=group); the other groups
train on (mpidp/_runtime/fault_tolerant_groups.py, domains.py).

Every survivor holds the full training state after a failure (data
parallelism keeps a replica per rank), so the survivors' new rank 0 can
write a checkpoint from memory (mpidp.fault_tolerance.save_checkpoint)."""

from __future__ import annotations

# The files, by job: recovery.py (recover() and its rounds), domains.py (what
# one recover() shrinks: the job or one worker group), survivors.py
# (MPI's agreement and shrink, which errors are failures), training_state.py
# (checkpoints, share_state, GradScaler), replacements.py (growing back),
# replica_groups.py (FT-HSDP's rule: the replica groups that lost no rank go
# on); the per-step half that algorithms call is
# mpidp/_runtime/fault_tolerant_mode.py, and the deadline on each wait MPI
# cannot interrupt mpidp/_runtime/deadline.py (a replacement's joining uses
# it before any of this is imported).
from .._runtime import fault_tolerant_mode
from .._runtime.fault_tolerant_mode import (RanksLost, agree_all_alive, commit_step, defer,
                                   enabled, is_replacement, participate, places_after_growth,
                                   raise_deferred, revoke_everything, step_boundary,
                                   world_agreement, world_comm)
from .._runtime.fault_tolerant_groups import survivors_of
from .._runtime.deadline import deadline
from .recovery import Membership, recover, recovery_times, steps_committed
from .replacements import take_plan
from .replica_groups import give_replacements_shards, keep_whole_groups
from .training_state import reset_grad_scaler, save_checkpoint, share_state

_state = fault_tolerant_mode._state


def enable() -> None:
    """Turn fault-tolerant mode on (every rank, before any model is wrapped).
    Raises RuntimeError naming what is missing where the MPI has no ULFM or
    the job was not launched with it. (A replacement then takes the
    survivors' plan.)"""
    fault_tolerant_mode.enable()
    take_plan()


take_plan()     # a replacement whose mode MPIDP_FAULT_TOLERANCE started at import

__all__ = ["Membership", "RanksLost", "enable", "enabled", "recover", "is_replacement",
           "share_state", "world_comm", "steps_committed", "save_checkpoint", "recovery_times",
           "reset_grad_scaler", "deadline", "survivors_of", "keep_whole_groups",
           "give_replacements_shards", "places_after_growth",
           # the per-step half, for the algorithms (mpidp/_runtime/fault_tolerant_mode.py;
           # step_boundary also ends the steps of torch.distributed programs):
           "step_boundary", "agree_all_alive", "world_agreement", "commit_step", "participate",
           "defer", "raise_deferred", "revoke_everything"]
