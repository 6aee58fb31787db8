"""A process started by torchrun, by srun without MPI, or by another MPI's
mpirun is an MPI singleton that would train alone: mpidp refuses it with how
to launch, unless MPIDP_IGNORE_LAUNCHER=1."""

import re
import subprocess
import sys

import pytest

from mpi_jobs import ROOT, clean_env, run_mpi
from mpidp._runtime.launch import launcher_mismatch

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


def run_info(env=None, ranks=1):
    if ranks == 1:
        proc = subprocess.run([sys.executable, "-m", "mpidp"], cwd=ROOT, env=clean_env(**(env or {})),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        return proc.returncode, proc.stdout
    rc, out, _ = run_mpi(ranks, ["-m", "mpidp"], timeout=120, **(env or {}))
    return rc, out


@pytest.mark.serial
def test_python_m_mpidp_reports_what_a_bug_report_needs():
    rc, out = run_info()
    assert rc == 0, out
    for field in ("mpidp ", "torch", "mpi4py", "MPI library (mpidp)", "same MPI                  yes",
                  "MPI thread level", "SIMD path", "CUDA kernels", "GPUs visible to torch",
                  "rank 0 of 1: host", "MPIDP_TIMEOUT", "MPIDP_CHECK "):
        assert field in out, (field, out)
    rc, out = run_info(ranks=2, env={"MPIDP_RANKS_PER_NODE": "1", "MPIDP_CHECK": "1"})
    assert rc == 0, out
    assert "rank 0 of 2: host" in out and "rank 1 of 2: host" in out and "node 1 of 2" in out, out
    assert re.search(r"MPIDP_CHECK\s+True \(set\)", out), out


@pytest.mark.serial
def test_python_m_mpidp_exits_1_with_the_reason():
    rc, out = run_info(env={"WORLD_SIZE": "2", "RANK": "0"})
    assert rc == 1 and "PROBLEMS" in out and "torchrun" in out, out
    rc, out = run_info(env={"MPIDP_CHECK_EVERY": "-3"})
    assert rc == 1 and "MPIDP_CHECK_EVERY must be a positive integer" in out, out


STORE_ON_LOOPBACK = (
    "import mpidp, mpidp.process_group as pg\n"
    "pg._store_host = lambda comm: ('127.0.1.1', True)  # rank 0's hostname in Debian's /etc/hosts\n"
    "try:\n"
    "    pg.init_process_group(mpidp.MPI.COMM_WORLD)\n"
    "except RuntimeError as exc:\n"
    "    print('refused:', exc)\n")


@pytest.mark.serial
def test_a_store_on_a_loopback_address_across_nodes_is_refused_not_waited_for():
    proc = subprocess.run([sys.executable, "-c", STORE_ON_LOOPBACK], cwd=ROOT, env=clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert "refused: init_process_group: rank 0's hostname resolves to 127.0.1.1" in proc.stdout, \
        proc.stdout
    assert "MPIDP_STORE_ADDR" in proc.stdout, proc.stdout
