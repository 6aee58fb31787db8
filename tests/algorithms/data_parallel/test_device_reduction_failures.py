"""A rank that stops taking part while DataParallel sums its buckets on the
device (here through the MPI stand-in): the others' waits end the job at the
deadline with a message naming the bucket, never a hang."""

import textwrap

import pytest

from mpi_jobs import run_mpi

pytestmark = pytest.mark.serial

STALLING_RANK = textwrap.dedent("""
    import time, torch, mpidp
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    net = mpidp.DataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
    assert net._reducer.device_resident
    for step in range(3):
        if rank == 1 and step == 2:
            time.sleep(120)            # rank 1 stops coming
        net(torch.randn(4, 8)).sum().backward()
""")


def test_a_stalled_rank_ends_the_job_naming_the_bucket(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(STALLING_RANK)
    rc, out, seconds = run_mpi(2, [str(script)], timeout=120, MPIDP_TIMEOUT="3",
                               MPIDP_DP_DEVICE_COMM="standin")
    assert rc != 0, out
    assert "timed out" in out and "gradient bucket" in out, out
    assert seconds < 40, f"the job took {seconds:.0f} s to end"
