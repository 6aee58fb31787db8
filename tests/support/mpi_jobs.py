"""Starting real mpirun jobs from a test (for the `serial` tests).

The test process may itself be an MPI singleton; Open MPI's variables in its
environment would confuse a child mpirun, so they are removed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "OPAL_", "ORTE_", "HYDRA_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_mpi(n: int, args: list[str], timeout: float, **env: str):
    """Runs `python args...` on n ranks; returns (returncode, output, seconds)."""
    cmd = [str(ROOT / "scripts" / "mpirun.sh"), str(n), sys.executable, *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(**env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, time.monotonic() - start
