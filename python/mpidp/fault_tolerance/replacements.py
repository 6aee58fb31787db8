"""Growing back (recover(replace=True)): the replacements are spawned running
this program and merged after the survivors."""

from __future__ import annotations

import os
import shutil
import sys

from .._runtime.mpi import MPI


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
