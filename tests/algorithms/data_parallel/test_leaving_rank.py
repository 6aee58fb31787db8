"""A rank that leaves its program early ends the job promptly, naming it.

SystemExit does not go through sys.excepthook, so a rank that called
sys.exit(1) mid-training, or whose checkpoint-on-preemption SIGTERM handler
raised SystemExit, used to sit in MPI_Finalize while the others waited for
it in their next collective until MPIDP_TIMEOUT (30 minutes by default).
Now the leaving rank tells the others as its program ends, and a wait on a
communicator holding it ends the job within MPIDP_DEPARTURE_GRACE. A normal
end -- ranks finishing at different times, collectives among the ranks that
remain -- is unchanged. Real mpirun jobs, MPIDP_TIMEOUT far above the limits."""

import textwrap

import pytest

from mpi_jobs import run_mpi

pytestmark = pytest.mark.serial

TRAIN = textwrap.dedent("""
    import os, signal, sys, time, torch, mpidp
    from mpi4py import MPI
    rank, mode, how = MPI.COMM_WORLD.Get_rank(), sys.argv[1], sys.argv[2]

    def preempted(signum, frame):          # the usual checkpoint-on-preemption handler
        torch.save(model.state_dict(), os.devnull)
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, preempted)

    model = torch.nn.Linear(4, 2)
    opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=mode == "blocking")
    for step in range(1000):
        if rank == MPI.COMM_WORLD.Get_size() - 1 and step == 3:
            if how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                sys.exit(int(how))
        opt.zero_grad()
        net(torch.randn(8, 4)).sum().backward()
        opt.step()
    print("rank", rank, "trained to the end", flush=True)
""")


@pytest.mark.parametrize("mode, how", [("blocking", "1"), ("non-blocking", "sigterm"),
                                       ("non-blocking", "0")],
                         ids=["blocking-exit-1", "non-blocking-sigterm", "non-blocking-exit-0"])
def test_a_rank_that_leaves_mid_training_ends_the_job_naming_it(tmp_path, mode, how):
    script = tmp_path / "leave.py"
    script.write_text(TRAIN)
    n = 3 if how == "0" else 2
    rc, out, seconds = run_mpi(n, [str(script), mode, how], timeout=200, MPIDP_TIMEOUT="600",
                               MPIDP_DEPARTURE_GRACE="1")
    assert rc != 0, out
    assert f"rank {n - 1} of the job has ended its program" in out, out
    assert "aborting the job" in out, out
    assert "trained to the end" not in out, out
    assert seconds < 60, f"the job took {seconds:.0f} s to end"


NORMAL_END = textwrap.dedent("""
    import time, torch, mpidp
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    model = torch.nn.Linear(4, 2)
    opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    net = mpidp.DataParallel(model, optimizer=opt)
    for step in range(5):
        opt.zero_grad()
        net(torch.randn(8, 4)).sum().backward()
        opt.step()
    net.synchronize()
    total = mpidp.allreduce_scalar(1, op="sum")
    # The last rank leaves now; the others go on among themselves, slowly,
    # for longer than the grace, then rank 0 works alone before it ends.
    rest = world.Split(0 if rank < world.Get_size() - 1 else MPI.UNDEFINED, rank)
    if rest != MPI.COMM_NULL:
        time.sleep(1.5 * rank)
        t = torch.ones(3)
        mpidp.allreduce(t, comm=rest)
        assert t.tolist() == [float(rest.Get_size())] * 3
    if rank == 0:
        time.sleep(1.5)
    print("rank", rank, "ended normally with", total, flush=True)
""")


def test_a_normal_end_with_ranks_finishing_at_different_times_is_unchanged(tmp_path):
    script = tmp_path / "normal.py"
    script.write_text(NORMAL_END)
    rc, out, _ = run_mpi(3, [str(script)], timeout=200, MPIDP_TIMEOUT="600",
                         MPIDP_DEPARTURE_GRACE="0.5")
    assert rc == 0, out
    for r in range(3):
        assert f"rank {r} ended normally with 3" in out, out
    assert "aborting" not in out, out
