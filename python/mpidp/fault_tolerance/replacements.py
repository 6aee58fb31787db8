"""Growing back (recover(replace=True)): the replacements are spawned running
this program and merged after the survivors, and take from them, before
their program builds anything, what the survivors' rebuild makes first (the
plan: torch.distributed's default group)."""

from __future__ import annotations

import os
import shutil
import sys

from .._runtime import fault_tolerant_groups, fault_tolerant_mode
from .._runtime import mpi as _mpi
from .._runtime.deadline import deadline
from .._runtime.mpi import MPI
from ..collectives import process_groups as process_group


_RUNTIME_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "OPAL_", "PMI_", "HYDRA_", "MPI_LOCAL")


def spawn_replacements(survivors: MPI.Intracomm, n: int):
    """Spawns n processes running this program, merged after the survivors:
    (the merged communicator, the replacements' ranks in it)."""
    if not sys.argv or sys.argv[0] in ("", "-c", "-m") or not os.path.exists(sys.argv[0]):
        raise RuntimeError("recover(replace=True): this program was not started from a script "
                           f"file (sys.argv[0] is {sys.argv[:1]}), so it cannot be started "
                           "again for a replacement; recover() without replace goes on smaller")
    # The replacements get this rank's environment (spawned processes start
    # from the launcher's), less the MPI runtime's own per-process variables.
    env = [f"{k}={v}" for k, v in sorted(os.environ.items())
           if not k.startswith(_RUNTIME_PREFIXES)]
    command = shutil.which("env") or "/usr/bin/env"
    inter = survivors.Spawn(command, env + [sys.executable] + sys.argv, maxprocs=n, root=0)
    merged = inter.Merge(high=False)
    inter.Disconnect()
    size = merged.Get_size()
    return merged, tuple(range(size - n, size))


def send_plan(merged: MPI.Intracomm) -> None:
    """On the survivors, once the replacements merged: rank 0 tells them what
    the rebuild makes before any algorithm's set-up -- torch.distributed's
    default group, where mpidp.init_process_group made it over the job
    (the survivors make it again first; a replacement's program would
    otherwise make it later, in the middle of a set-up the survivors repeat
    in another order: DataParallelMultiGPU's). A group the program made with
    torch's own dist.init_process_group its replacement makes the same way,
    first thing, as the survivors do."""
    made = None
    if process_group.made_by_init_process_group() and \
            fault_tolerant_groups.of(process_group.default_group_source()) is None:
        made = process_group.made_again_by_recovery()
    merged.bcast({"default_group": made} if merged.Get_rank() == 0 else None, root=0)


def take_plan() -> None:
    """On a replacement, when its fault-tolerant mode starts (at import, or
    enable()): the survivors' plan (send_plan), carried out."""
    if not fault_tolerant_mode.joining() or fault_tolerant_mode._state.plan_taken:
        return
    fault_tolerant_mode._state.plan_taken = True
    with deadline("taking the survivors' plan", caller="a replacement",
                  hint="they are gone (another rank failed) or stuck"):
        plan = _mpi.world_mpi().bcast(None, root=0)
    if plan["default_group"] is not None:
        backend, timeout = plan["default_group"]
        process_group.init_process_group(_mpi.world_mpi(), backend=backend, timeout=timeout)
