"""Real mpirun jobs: the example trains to its accuracy, and a rank that fails
ends the whole job with a message instead of leaving the others hanging."""

import re
import textwrap

import pytest

from mpi_jobs import ROOT, run_mpi

pytestmark = pytest.mark.serial


def test_digits_example_reaches_95_percent():
    rc, out, _ = run_mpi(2, ["examples/digits.py", "--quiet"], timeout=300)
    assert rc == 0, out
    acc = float(re.search(r"test accuracy ([\d.]+)%", out).group(1))
    assert acc >= 95.0, out


FAILING_RANK = textwrap.dedent("""
    import torch, mpidp
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    model = torch.nn.Linear(4, 2)
    opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=True)
    for step in range(1000):
        if rank == 1 and step == 3:
            raise RuntimeError("simulated failure on rank 1")
        opt.zero_grad()
        net(torch.randn(8, 4)).sum().backward()
        opt.step()
""")


def test_a_rank_that_raises_ends_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING_RANK)
    rc, out, seconds = run_mpi(2, [str(script)], timeout=120, MPIDP_TIMEOUT="600")
    assert rc != 0, out
    assert "simulated failure on rank 1" in out
    assert "aborting the job" in out
    assert seconds < 30, f"the job took {seconds:.0f} s to end"


def test_a_stuck_collective_times_out_and_aborts(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent("""
        import time, torch, mpidp
        from mpi4py import MPI
        mpidp.allreduce(torch.ones(4))       # both ranks
        if MPI.COMM_WORLD.Get_rank() == 0:
            mpidp.allreduce(torch.ones(4))   # rank 1 never joins this one
        else:
            time.sleep(60)
    """))
    rc, out, seconds = run_mpi(2, [str(script)], timeout=120, MPIDP_TIMEOUT="2")
    assert rc != 0, out
    assert "timed out" in out and "MPI_Iallreduce" in out, out
    assert seconds < 30, f"the job took {seconds:.0f} s to end"
