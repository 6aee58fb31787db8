"""A process started by torchrun, by srun without MPI, or by another MPI's
mpirun is an MPI singleton that would train alone: mpidp refuses it with how
to launch, unless MPIDP_IGNORE_LAUNCHER=1."""

import subprocess
import sys

import pytest

from mpi_jobs import ROOT, clean_env
from mpidp._launch import launcher_mismatch

LAUNCHERS = [
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, "torchrun"),
    ({"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2"}, "srun started it without MPI"),
    ({"SLURM_NTASKS": "4"}, "the batch script ran python directly"),
    ({"PMI_SIZE": "2"}, "different MPI"),
]
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_STEP_ID",
                 "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


@pytest.fixture
def bare_env(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env,says", LAUNCHERS)
def test_a_launcher_of_several_with_one_mpi_process_is_named(bare_env, env, says):
    for k, v in env.items():
        bare_env.setenv(k, v)
    assert says in launcher_mismatch(1)
    assert launcher_mismatch(2) is None      # MPI sees the processes: nothing to say


def test_single_process_launches_are_fine(bare_env):
    assert launcher_mismatch(1) is None
    bare_env.setenv("WORLD_SIZE", "1")
    bare_env.setenv("SLURM_NTASKS", "1")
    assert launcher_mismatch(1) is None


TRAIN = ("import torch, mpidp; net = mpidp.DataParallel(torch.nn.Linear(2, 2)); "
         "net(torch.ones(1, 2)).sum().backward(); print('trained')")


@pytest.mark.serial
@pytest.mark.parametrize("env,says", LAUNCHERS[:3])
def test_training_under_a_non_mpi_launcher_is_refused(env, says):
    def run(**extra):
        return subprocess.run([sys.executable, "-c", TRAIN], cwd=ROOT, env=clean_env(**env, **extra),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=120)
    refused = run()
    assert refused.returncode != 0, refused.stdout
    assert says in refused.stdout and "mpirun -np N" in refused.stdout, refused.stdout
    allowed = run(MPIDP_IGNORE_LAUNCHER="1")
    assert allowed.returncode == 0 and "trained" in allowed.stdout, allowed.stdout
