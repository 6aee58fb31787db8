"""Was this process started by a launcher that is not MPI's?

Under torchrun, `srun` without an MPI plugin, or a batch script that runs
python directly, every process is an MPI singleton: rank 0 of 1. Each would
then train alone on its own data and save its own model, with no error
anywhere. The launchers leave their environment behind, so a job whose MPI
world is one process while its launcher says several is refused with how to
launch it (MPIDP_IGNORE_LAUNCHER=1 lets it run anyway)."""

from __future__ import annotations

import os
from typing import Optional

from . import config

__all__ = ["launcher_mismatch", "check_launch"]

_HOW = ("launch it with MPI instead: `mpirun -np N python train.py`, or under Slurm "
        "`srun --mpi=pmix python train.py` (see `srun --mpi=list`); set "
        "MPIDP_IGNORE_LAUNCHER=1 if one process is really what you want")


def _count(name: str) -> int:
    try:
        return int(os.environ.get(name, "1"))
    except ValueError:
        return 1


def launcher_mismatch(mpi_size: int) -> Optional[str]:
    """What the launcher says when it started more processes than MPI sees
    (mpi_size == 1), else None."""
    if mpi_size != 1:
        return None
    if _count("WORLD_SIZE") > 1:
        return (f"torchrun (or torch.distributed.launch) started this process as rank "
                f"{os.environ.get('RANK', '?')} of {os.environ['WORLD_SIZE']} (WORLD_SIZE), but "
                "MPI sees one process, so every process would train alone")
    if _count("SLURM_NTASKS") > 1:
        where = ("srun started it without MPI (no PMI/PMIx plugin)" if "SLURM_STEP_ID" in os.environ
                 else "the batch script ran python directly, not through srun")
        return (f"Slurm asked for {os.environ['SLURM_NTASKS']} tasks (SLURM_NTASKS) but MPI sees "
                f"one process: {where}, so every process would train alone")
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        if _count(var) > 1:
            return (f"an MPI launcher started {os.environ[var]} processes ({var}) but this "
                    "process's MPI sees one: mpi4py or mpidp is built against a different MPI "
                    "than the mpirun that started it (python -m mpidp shows which)")
    return None


def check_launch(mpi_size: int) -> None:
    """Raises RuntimeError when launcher_mismatch finds one (and it is not ignored)."""
    reason = launcher_mismatch(mpi_size)
    if reason and not config.get("MPIDP_IGNORE_LAUNCHER"):
        raise RuntimeError(f"mpidp: {reason}; {_HOW}")
