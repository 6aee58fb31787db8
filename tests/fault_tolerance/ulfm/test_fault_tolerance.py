"""Fault-tolerant mode (mpidp/fault_tolerance/__init__.py), tested by killing ranks.

Each test launches tests/fault_tolerance/ulfm/train_ft.py under ULFM (scripts/mpirun_ft.sh) at
3 or 4 ranks, SIGKILLs some of them at a chosen step and phase, and compares
what every survivor ends with against a single-process simulation of every
replica written from the documented rule: a step in which a rank dies is
applied by no survivor; the dead rank's data counts in every step applied
before its death and in none after. Survivors must end bit for bit equal.

These run in `make pytest-ft` (.venv-ft: Open MPI 5 with ULFM), not in the
main passes, whose Open MPI 4.1 has no ULFM."""

import collections
import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(ROOT, "tests", "support"))   # the main suite's references
import train_ft  # noqa: E402
from quant_reference import replica_of  # noqa: E402

pytestmark = pytest.mark.serial


def launch(tmp_path, n, kill, steps=8, **env):
    """Runs tests/fault_tolerance/ulfm/train_ft.py on n ranks; returns the finished process,
    once no rank of it outlives the job."""
    environ = dict(os.environ, FT_KILL=kill, FT_STEPS=str(steps), MPIDP_TIMEOUT="60")
    environ.update({k: str(v) for k, v in env.items()})
    script = environ.pop("FT_SCRIPT", "train_ft.py")     # test_groups.py's: groups_ft.py
    proc = subprocess.run([os.path.join(ROOT, "scripts/mpirun_ft.sh"), str(n), sys.executable,
                           os.path.join(HERE, script), str(tmp_path)],
                          env=environ, capture_output=True, text=True, timeout=240)
    assert_no_rank_outlives(str(tmp_path), proc)
    return proc


def ranks_of(job_arg: str) -> list:
    """PIDs of the processes whose command line has job_arg (a test's own
    directory, so only that job's ranks)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if job_arg.encode() in args and int(pid) != os.getpid():
            pids.append(int(pid))
    return pids


def assert_no_rank_outlives(job_arg: str, proc, grace_s=5.0) -> None:
    """The launcher has exited: every rank must be gone (within grace_s, a
    dying process's last moments). One that is not is killed, and fails the test."""
    deadline = time.monotonic() + grace_s
    while ranks_of(job_arg) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = ranks_of(job_arg)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, (f"ranks {left} outlived the job (mpirun exit {proc.returncode})\n"
                      + stderr_of(proc)[-3000:])


def stderr_of(proc) -> str:
    """The job's stderr without Open MPI's per-schedule lines (docs/fault-tolerance.md)."""
    return "\n".join(line for line in proc.stderr.splitlines() if "NBC_Progress" not in line)


def run_job(tmp_path, n, kill, steps=8, expect=None, **env):
    """Runs the job; returns {data stream (launched rank): what it saved}.
    expect: the streams that must finish (default: the survivors')."""
    proc = launch(tmp_path, n, kill, steps, **env)
    saved = {int(f[5:-3]): torch.load(tmp_path / f) for f in os.listdir(tmp_path)
             if f.startswith("rank-")}
    victims = {r for ranks, _, _ in train_ft.kill_plan(kill) for r in ranks}
    expect = set(range(n)) - victims if expect is None else set(expect)
    assert set(saved) == expect, (
        f"survivors that finished: {sorted(saved)}; mpirun exit {proc.returncode}\n"
        + stderr_of(proc)[-4000:])
    return saved


def simulate(n, steps, lost_from, clip=None):
    """Every replica of the rule: rank r's batch counts in step t while r is
    alive (t < lost_from[r] for the victims); the mean over those ranks
    (clipped to norm `clip`, if given) is stepped by SGD with momentum.
    Returns (params, momentum, params after each step)."""
    model = train_ft.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    history = []
    for t in range(steps):
        alive = [r for r in range(n) if t < lost_from.get(r, steps)]
        grads = None
        for r in alive:
            model.zero_grad()
            x, y = train_ft.batch(r, t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            g = [p.grad.clone() for p in model.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(model.parameters(), grads):
            p.grad = g / len(alive)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        history.append({"model": {k: v.clone() for k, v in model.state_dict().items()},
                        "optimizer": copy.deepcopy(opt.state_dict())})
    return ([p.detach() for p in model.parameters()],
            [opt.state[p]["momentum_buffer"] for p in model.parameters()], history)


def assert_matches(who, got, params, momentum):
    """A survivor's saved parameters and momentum against the simulation's."""
    for what, mine, want in (("parameters", got["params"], params),
                             ("momentum", got["momentum"], momentum)):
        for a, b in zip(mine, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{who}'s {what}: {m}")


def launched_ranks_lost(recoveries, n):
    """The launched ranks each recovery lost (Membership.lost numbers them in
    the world before that recovery), in order."""
    alive, lost = list(range(n)), []
    for r in recoveries:
        gone = [alive[i] for i in r["lost"]]
        lost += gone
        alive = [a for a in alive if a not in gone]
    return sorted(lost)


def check_survivors(saved, n, lost_from, steps=8, tol=None, clip=None):
    victims = set(lost_from)
    params, momentum, history = simulate(n, steps, lost_from, clip)
    first = saved[min(saved)]
    for rank, got in saved.items():
        for a, b in zip(got["params"], first["params"]):
            assert torch.equal(a, b), f"rank {rank}'s parameters differ from rank {min(saved)}'s"
        assert launched_ranks_lost(got["recoveries"], n) == sorted(victims), got["recoveries"]
        last = got["recoveries"][-1]
        assert (last["size"], last["mpidp_size"]) == (n - len(victims),) * 2
        assert last["mpidp_rank"] == last["rank"] == sorted(saved).index(rank)
    tol = tol or dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(first["params"], params):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(first["momentum"], momentum):
        torch.testing.assert_close(a, b, **tol)
    return history


# (ranks, kill spec: failures one after the other, {victim: the first step
# without its data}). A rank lost in a step's forward, backward or before
# its optimizer step costs that step; one lost after it, the next.
CASES = {
    "after backward, then rank 0 in backward with buckets in flight":
        (4, "3:2:step;0:5:backward", {3: 2, 0: 5}),
    "between two steps, then before a forward": (4, "2:2:between;1:5:forward", {2: 3, 1: 5}),
    "two ranks at once in backward": (4, "1,2:4:backward", {1: 4, 2: 4}),
    # A second failure inside recover(), as the survivors of the first rebuild:
    # the recovery starts over with the survivors of both.
    "in backward, then another inside the recovery's rebuild":
        (4, "3:3:backward;1:3:rebuild", {3: 3, 1: 3}),
    "in backward, then another inside the rebuild, leaving one rank":
        (3, "2:3:backward;1:3:rebuild", {2: 3, 1: 3}),
    # ... or while the survivors agree that a rank failed, or inside MPI's
    # shrink (the dying rank skips its part, so the survivors are in it).
    "in backward, then another in the recovery's agreement":
        (4, "3:3:backward;2:3:agreement", {3: 3, 2: 3}),
    "in backward, then another in the recovery's agreement, leaving one rank":
        (3, "2:3:backward;1:3:agreement", {2: 3, 1: 3}),
    "in backward, then another inside the survivors' shrink":
        (4, "3:3:backward;2:3:shrink", {3: 3, 2: 3}),
    "in backward, then another inside the survivors' shrink, leaving one rank":
        (3, "2:3:backward;1:3:shrink", {2: 3, 1: 3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_survivors_finish_equal_to_the_simulation(tmp_path, case):
    n, kill, lost_from = CASES[case]
    check_survivors(run_job(tmp_path, n, kill), n, lost_from)


def test_a_default_group_made_by_torch_distributed_is_made_again(tmp_path):
    """DataParallel beside a default group made by dist.init_process_group
    ("mpidp") rather than mpidp's: recover() makes the group again over the
    survivors, and an all_reduce over it sees them."""
    saved = run_job(tmp_path, 4, "3:3:backward", FT_DIST_INIT=1)
    check_survivors(saved, 4, {3: 3})
    for got in saved.values():
        assert got["dist_sum"] == (3.0, 3)


def test_an_error_taken_for_a_failure_where_no_rank_failed_costs_one_step(tmp_path):
    """A rank takes an MPI error for a peer's failure (as the core does with
    errors that a death can cause) where none failed: recover() finds no rank
    lost, the world keeps its size and the step is done again; the replicas
    end as a run without a failure."""
    saved = run_job(tmp_path, 4, "", FT_SUSPECT="1:2")
    check_survivors(saved, 4, {})
    for got in saved.values():
        assert [(r["lost"], r["size"]) for r in got["recoveries"]] == [((), 4)]


def test_an_error_that_keeps_recurring_with_no_rank_lost_ends_the_job(tmp_path):
    proc = launch(tmp_path, 3, "", FT_SUSPECT="1:2,2,2")
    assert proc.returncode != 0
    assert "3 recoveries in a row found no rank lost" in proc.stderr, stderr_of(proc)[-4000:]
    assert "rank 1 suspects a failure at step 2" in proc.stderr


def test_a_survivor_that_never_recovers_ends_the_job_at_the_deadline(tmp_path):
    """Every wait inside recover() has a deadline (MPIDP_TIMEOUT): the others
    do not wait forever for a survivor that never calls it, and that survivor
    (asleep outside MPI) ends with the job instead of living on (launch
    checks that no rank outlives mpirun)."""
    proc = launch(tmp_path, 3, "2:2:backward", MPIDP_TIMEOUT=5, FT_NO_RECOVER=1)
    assert proc.returncode != 0
    assert "took longer than MPIDP_TIMEOUT (5 s); a survivor is not taking part" in proc.stderr, \
        stderr_of(proc)[-4000:]


def test_a_replacement_whose_program_fails_ends_the_job(tmp_path):
    """A replacement is alone in its own MPI_COMM_WORLD (its spawn), and so
    were its uncaught exceptions (no abort) and its aborts (its world only):
    its failure must end the job at once, the survivors waiting for its
    set-up and the launched ranks included (launch checks that no rank
    outlives mpirun), after a second try at most; MPIDP_TIMEOUT is longer
    than the test waits."""
    started = time.monotonic()
    proc = launch(tmp_path, 3, "2:2:backward", MPIDP_TIMEOUT=600, FT_REPLACE=1,
                  FT_REPLACEMENT_FAILS=1)
    assert proc.returncode != 0
    assert "mpidp: uncaught RuntimeError on rank 2 of 3: aborting the job" in proc.stderr, \
        stderr_of(proc)[-4000:]
    # The survivors end the job after their second try (Open MPI's abort from
    # the spawned job ends only that job; a first replacement can be lost
    # through no fault of its own: recovery._SPAWN_TRIES).
    assert proc.stderr.count("mpidp: uncaught RuntimeError on rank 2 of 3") == 2, \
        stderr_of(proc)[-4000:]
    assert "the replacements spawned ended before the recovery did, 2 times" in proc.stderr, \
        stderr_of(proc)[-4000:]
    assert time.monotonic() - started < 120, stderr_of(proc)[-4000:]


def test_a_program_on_torch_distributed_alone_recovers():
    """dist.init_process_group("mpidp") and dist.all_reduce, no mpidp wrapper:
    RanksLost from the collective, recover() makes the default group again,
    and the sums after it are the survivors'."""
    out = subprocess.run([os.path.join(ROOT, "scripts/mpirun_ft.sh"), "3", sys.executable,
                          os.path.join(HERE, "dist_only.py")], capture_output=True, text=True,
                         timeout=120)
    done = sorted(line for line in out.stdout.splitlines() if line.startswith("done"))
    # Ranks 0, 1, 2 add rank + 1 (6) before step 3; rank 2 dies at step 3.
    want = [6.0] * 3 + [3.0] * 3
    assert done == [f"done {r} {want} 2" for r in (0, 1)], out.stdout + stderr_of(out)[-3000:]


def test_a_default_group_over_the_jobs_ranks_in_another_order_keeps_it():
    """mpidp.init_process_group over the job's ranks in reverse order: it is
    the job's (recover() of the job makes it again), and its survivors keep
    their order in it; the sums after the loss are the survivors'."""
    out = subprocess.run([os.path.join(ROOT, "scripts/mpirun_ft.sh"), "3", sys.executable,
                          os.path.join(HERE, "dist_only.py")], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, FT_DIST_REVERSED="1"))
    done = sorted(line for line in out.stdout.splitlines() if line.startswith("done"))
    want = [6.0] * 3 + [3.0] * 3
    assert done == [f"done {r} {want} 2 [1, 0]" for r in (0, 1)], \
        out.stdout + stderr_of(out)[-3000:]


def test_a_default_group_made_over_a_worker_group_is_recovered_by_that_group_alone():
    """mpidp.init_process_group(comm=worker) in each pair of ranks (the
    Propulate recipe): the pair that lost a rank recovers it alone
    (recover(comm=worker) makes its default group again over its survivor);
    the other pair's sums go on and it never sees the loss."""
    out = subprocess.run([os.path.join(ROOT, "scripts/mpirun_ft.sh"), "4", sys.executable,
                          os.path.join(HERE, "dist_only.py")], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, FT_DIST_GROUPS="1"))
    done = sorted(line for line in out.stdout.splitlines() if line.startswith("done"))
    # Pair 0-1 adds 1 + 2; pair 2-3 adds 3 + 4 until rank 2 dies at step 3.
    assert done == [f"done {r} {[3.0] * 6} 2 0" for r in (0, 1)] + \
        [f"done 3 {[7.0] * 3 + [4.0] * 3} 1 1"], out.stdout + stderr_of(out)[-3000:]


def test_torch_shrink_group_goes_on_with_the_survivors():
    """dist.shrink_group on a subgroup and on the default group, excluding
    the failed rank (ULFM's shrink of the revoked communicators), after the
    failure surfaced in a point-to-point all-gather: the sums, gathers and
    reduce-scatters after it are the survivors'."""
    out = subprocess.run([os.path.join(ROOT, "scripts/mpirun_ft.sh"), "3", sys.executable,
                          os.path.join(HERE, "shrink_group.py")], capture_output=True, text=True,
                         timeout=120)
    done = sorted(line for line in out.stdout.splitlines() if line.startswith("done"))
    assert done == ["done 0 [6.0, 6.0, 3.0, 3.0] 2 [1.0, 2.0] 1.0",
                    "done 1 [6.0, 6.0, 3.0, 3.0] 2 [1.0, 2.0] 3.0"], \
        out.stdout + stderr_of(out)[-3000:]


def test_torch_shrink_group_that_leaves_out_a_live_rank_ends_the_job_at_the_deadline():
    out = subprocess.run([os.path.join(ROOT, "scripts/mpirun_ft.sh"), "2", sys.executable,
                          os.path.join(HERE, "shrink_group.py")], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, FT_SHRINK_LIVE="1"))
    assert out.returncode != 0
    assert ("shrink_group on rank 0: the live ranks' shrink took longer than the group's "
            "timeout (3 s); in fault-tolerant mode every live rank") in out.stderr, \
        out.stdout + stderr_of(out)[-3000:]


def test_nonblocking_survivors_finish_equal_to_the_simulation(tmp_path):
    """Non-blocking DataParallel: a step's end is the next forward, which
    applies it; a rank lost between step() and that forward discards that
    step (2 here), one lost in backward the step it was in."""
    saved = run_job(tmp_path, 4, "2:2:between;0:5:backward", FT_NONBLOCKING=1)
    check_survivors(saved, 4, {2: 2, 0: 5})


def test_habits_in_fault_tolerant_mode(tmp_path):
    """The model wrapped twice, two optimizers, AMP's GradScaler, the
    gradients unscaled and clipped before the step: a rank lost after
    backward (before the scaler's unscale and step), then one in backward;
    the survivors end as the simulation of the clipped mean gradient (a
    step counted once per optimizer would skip batches)."""
    saved = run_job(tmp_path, 4, "1:2:step;3:5:backward", FT_HABITS=1)
    check_survivors(saved, 4, {1: 2, 3: 5}, clip=train_ft.CLIP)


def test_a_whole_emulated_node_is_lost_under_hierarchical_averaging(tmp_path):
    saved = run_job(tmp_path, 4, "2,3:3:backward", MPIDP_RANKS_PER_NODE=2, FT_HIERARCHICAL=1)
    check_survivors(saved, 4, {2: 3, 3: 3})


def test_one_rank_of_an_emulated_node_is_lost_under_hierarchical_bytegrad(tmp_path):
    """ByteGrad (8-bit gradients, hierarchical) through with_bagua: 3
    survivors cannot form nodes of 2, so it goes on flat; the survivors end
    equal bit for bit, and within the 8-bit rounding of the simulation."""
    saved = run_job(tmp_path, 4, "1:3:backward", FT_ALGORITHM="bytegrad",
                    MPIDP_RANKS_PER_NODE=2, FT_HIERARCHICAL=1)
    # The rounding leaves it within 1e-3 here; the dead rank counted one step
    # longer would put it 7e-3 away.
    check_survivors(saved, 4, {1: 3}, tol=dict(rtol=0, atol=3e-3))


def simulate_replicas(n, steps, lost_from, algorithm, clip=None, streams=None, joins=None):
    """Every replica of a replica algorithm, each with its own model and inner
    optimizer (a victim's stops at lost_from[victim]). postlocalsgd: after local step
    t, t % PERIOD == 0, the live replicas take their mean. hierarchical: the
    same over pairs of launched ranks (0 and 1, 2 and 3), over all where t %
    (2 PERIOD) == 0. diloco: after
    inner step t, (t + 1) % PERIOD == 0, θ takes an outer step on θ - (the
    live replicas' mean), and they take θ. A sync a rank's death
    interrupted is done over the survivors. clip: each inner gradient is
    clipped to this norm. streams: each replica's data stream (the launched
    rank whose batches it trains on; default its own). joins: {victim: (t,
    source)}: a replacement trains on the victim's stream from step t on,
    from replica `source`'s parameters and momentum. Returns each replica's
    parameters and the momentum saved (inner for postlocalsgd, outer for
    diloco)."""
    period = train_ft.PERIOD
    models = [train_ft.make_model() for _ in range(n)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    theta = train_ft.make_model()
    outer = torch.optim.SGD(theta.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    joins = joins or {}
    for t in range(steps):
        for r, (at, source) in joins.items():
            if t == at:
                models[r].load_state_dict(models[source].state_dict())
                inner[r].load_state_dict(copy.deepcopy(inner[source].state_dict()))
        alive = [r for r in range(n)
                 if t < lost_from.get(r, steps) or t >= joins.get(r, (steps,))[0]]
        for r in alive:
            models[r].zero_grad()
            x, y = train_ft.batch(r if streams is None else streams[r], t)
            torch.nn.functional.mse_loss(models[r](x), y).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(models[r].parameters(), clip)
            inner[r].step()
        replicas = [list(models[r].parameters()) for r in alive]
        with torch.no_grad():
            if algorithm == "postlocalsgd" and t % period == 0:
                for ps in zip(*replicas):
                    mean = sum(p / len(alive) for p in ps)
                    for p in ps:
                        p.copy_(mean)
            if algorithm == "hierarchical" and t % period == 0:
                size = n if t % (2 * period) == 0 else 2
                for first in range(0, n, size):
                    group = [list(models[r].parameters()) for r in alive
                             if first <= r < first + size]
                    for ps in zip(*group):
                        mean = sum(p / len(group) for p in ps)
                        for p in ps:
                            p.copy_(mean)
            if algorithm == "diloco" and (t + 1) % period == 0:
                for i, th in enumerate(theta.parameters()):
                    th.grad = th - sum(ps[i] for ps in replicas) / len(alive)
                outer.step()
                for ps in replicas:
                    for p, th in zip(ps, theta.parameters()):
                        p.copy_(th)
    momentum = {r: [inner[r].state[p].get("momentum_buffer") for p in models[r].parameters()]
                for r in range(n)}
    if algorithm == "diloco":
        momentum = {r: [outer.state[p].get("momentum_buffer") for p in theta.parameters()]
                    for r in range(n)}
    return {r: [p.detach() for p in models[r].parameters()] for r in range(n)}, momentum


# (algorithm, ranks, kill spec, {victim: the first step whose sync goes without it},
# FT_HABITS: AMP's GradScaler, the gradients clipped, DiLoCo entered twice)
REPLICA_CASES = {
    "postlocalsgd, habits: a rank lost between averagings, then rank 0 at an averaging step":
        ("postlocalsgd", 4, "2:3:backward;0:6:step", {2: 3, 0: 6}, True),
    "with_bagua LocalSGD: a rank lost at an averaging step, then another in backward":
        ("localsgd", 4, "1:2:step;3:5:backward", {1: 2, 3: 5}),
    "diloco, a rank lost between syncs, then one at a sync step":
        ("diloco", 4, "1:2:backward;3:5:step", {1: 2, 3: 5}),
    "diloco, two ranks lost at once": ("diloco", 4, "0,2:5:backward", {0: 5, 2: 5}),
    # The second loss cuts short the redo of the sync the first interrupted
    # (before the redo's send): the redo must survive a second recovery.
    "diloco, rank 0 lost at a sync, then rank 3 before the survivors' redo of it":
        ("diloco", 4, "0:3:step;3:4:forward", {0: 3, 3: 3}),
    "diloco, habits: rank 0 lost in backward, then one with the outer-gradient allreduce posted":
        ("diloco", 4, "0:2:backward;2:5:outer", {0: 2, 2: 5}, True),
}


@pytest.mark.parametrize("case", list(REPLICA_CASES))
def test_replica_algorithms_continue_from_the_survivors_replicas(tmp_path, case):
    algorithm, n, kill, lost_from, habits = (REPLICA_CASES[case] + (False,))[:5]
    saved = run_job(tmp_path, n, kill, FT_ALGORITHM=algorithm,
                    **({"FT_HABITS": 1} if habits else {}))
    rule = "postlocalsgd" if algorithm == "localsgd" else algorithm    # torch's rule, both
    params, momentum = simulate_replicas(n, 8, lost_from, rule,
                                         clip=train_ft.CLIP if habits else None)
    for rank, got in saved.items():
        assert launched_ranks_lost(got["recoveries"], n) == sorted(lost_from), \
            got["recoveries"]
        assert_matches(f"rank {rank}", got, params[rank], momentum[rank])


@pytest.mark.parametrize("algorithm, habits", [("postlocalsgd", True), ("localsgd", False)])
def test_model_averaging_grows_back_from_the_averaged_replica(tmp_path, algorithm, habits):
    """recover(replace=True) under PostLocalSGDOptimizer and with_bagua's
    LocalSGDAlgorithm, rank 2 lost as the others average (step 4): the
    survivors finish that averaging among themselves, then the replacement
    takes rank 0's averaged parameters (the averager's, or with_bagua's,
    set-up), its momentum (share_state) and step count, and trains on rank
    2's data from step 5; the survivors keep their own replicas. habits: AMP's
    scaler and the gradients clipped, on every rank and the replacement."""
    saved = run_job(tmp_path, 4, "2:4:step", expect=range(4), FT_ALGORITHM=algorithm,
                    FT_REPLACE=1, **({"FT_HABITS": 1} if habits else {}))
    params, momentum = simulate_replicas(4, 8, {2: 4}, "postlocalsgd", joins={2: (5, 0)},
                                         clip=train_ft.CLIP if habits else None)
    for key, got in saved.items():
        if key != 2:
            assert [(r["size"], r["lost"], r["joined"]) for r in got["recoveries"]] == \
                [(4, (2,), (3,))], got["recoveries"]
        assert_matches(f"stream {key}", got, params[key], momentum[key])


def test_hierarchical_averaging_grows_back_into_the_lost_ranks_groups(tmp_path):
    """recover(replace=True) under PostLocalSGDOptimizer with a
    HierarchicalModelAverager (pairs every PERIOD steps, the world every 2
    PERIOD), rank 1 lost as the pairs average (step 2): its pair mate
    finishes that averaging alone, then the replacement takes rank 0's
    replica and momentum and rank 1's place in every level's group -- last
    in the world's order, it still averages with rank 0's replica in the
    pairs (step 6)."""
    saved = run_job(tmp_path, 4, "1:2:step", expect=range(4), FT_ALGORITHM="postlocalsgd",
                    FT_HIERARCHICAL=1, FT_REPLACE=1)
    params, momentum = simulate_replicas(4, 8, {1: 2}, "hierarchical", joins={1: (3, 0)})
    for key, got in saved.items():
        if key != 1:
            assert [(r["size"], r["lost"], r["joined"]) for r in got["recoveries"]] == \
                [(4, (1,), (3,))], got["recoveries"]
        assert_matches(f"stream {key}", got, params[key], momentum[key])


@pytest.mark.parametrize("n, victim, at", [(3, 2, 4), (4, 0, 6)])
def test_async_averaging_survivors_apply_the_same_rounds(tmp_path, n, victim, at):
    """AsyncModelAverageAlgorithm, a rank lost while the background threads
    average (learning rate 0, so only averaging moves the weights): no
    survivor applies a round another did not, so every survivor ends with
    the same weights, at the mean of every rank's initial ones (rounds
    completed before the loss) or of the survivors' (none had); and the
    thread averaged again after recover()."""
    proc = launch(tmp_path, n, "", FT_SCRIPT="async_ft.py", FT_VICTIM=victim, FT_AT=at)
    saved = {int(f[5:-3]): torch.load(tmp_path / f) for f in os.listdir(tmp_path)
             if f.startswith("rank-")}
    assert set(saved) == set(range(n)) - {victim}, (
        f"survivors that finished: {sorted(saved)}; mpirun exit {proc.returncode}\n"
        + stderr_of(proc)[-4000:])
    import async_ft
    lost = async_ft.own_weights(torch.nn.Sequential(      # the victim's initial weights
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)), victim)
    survivors = [saved[r]["initial"] for r in sorted(saved)]
    means = {"every rank's": [sum(ps) / n for ps in zip(lost, *survivors)],
             "the survivors'": [sum(ps) / (n - 1) for ps in zip(*survivors)]}
    first = saved[min(saved)]
    for rank, got in saved.items():
        assert launched_ranks_lost(got["recoveries"], n) == [victim], got["recoveries"]
        for a, b in zip(got["params"], first["params"]):
            assert torch.equal(a, b), f"rank {rank} applied rounds rank {min(saved)} did not"
    assert first["rounds"] > 0
    close = [name for name, mean in means.items()
             if all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                    for a, b in zip(first["params"], mean))]
    assert close, "the survivors' weights are neither mean: a round was half applied"


def test_async_averaging_grows_back_from_rank_0s_weights(tmp_path):
    """recover(replace=True) under AsyncModelAverageAlgorithm (learning rate
    0), rank 1 lost while the threads average: the replacement starts from
    rank 0's weights, the threads start again over all four at the next
    forward, and every rank ends with the same weights -- the mean of what
    the four held at the growth: the survivors' weights and rank 0's copy
    (all at every rank's initial mean where a round completed before the
    loss; else the survivors' initial weights, rank 0's counted twice)."""
    n, victim = 4, 1
    proc = launch(tmp_path, n, "", FT_SCRIPT="async_ft.py", FT_VICTIM=victim, FT_AT=6,
                  FT_REPLACE=1)
    saved = {int(f[5:-3]): torch.load(tmp_path / f) for f in os.listdir(tmp_path)
             if f.startswith("rank-")}
    assert set(saved) == set(range(n)), (
        f"ranks that finished: {sorted(saved)}; mpirun exit {proc.returncode}\n"
        + stderr_of(proc)[-4000:])
    import async_ft
    initial = {r: async_ft.own_weights(torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)), r) for r in range(n)}
    survivors = [r for r in range(n) if r != victim]
    means = {"every rank's": [sum(ps) / n for ps in zip(*initial.values())],
             "the survivors' and rank 0's": [sum(ps) / n for ps in
                                             zip(initial[0], *(initial[r] for r in survivors))]}
    first = saved[0]
    for rank, got in saved.items():
        if rank != victim:
            assert [(r["size"], r["lost"], r["joined"]) for r in got["recoveries"]] == \
                [(n, (victim,), (n - 1,))], got["recoveries"]
        for a, b in zip(got["params"], first["params"]):
            assert torch.equal(a, b), f"rank {rank}'s weights differ from rank 0's"
    assert saved[victim]["rounds"] > 0, "the replacement's thread never averaged"
    close = [name for name, mean in means.items()
             if all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                    for a, b in zip(first["params"], mean))]
    assert close, "the weights are neither mean: a round was half applied, or weight was lost"


def simulate_daso(n, steps, lost_from, per_node=2, clip=None, joins=None, dropped=()):
    """DASO in its warm-up (a blocking global average every batch, float32
    on the wire) over emulated nodes of `per_node` ranks, by its rule: each
    node's ranks average their gradients and step SGD with the node's
    momentum; the parameters then become the mean over the nodes. A step in
    whose backward a rank died is not taken; at each recovery every
    survivor takes the new rank 0's (the lowest surviving rank's) momentum
    (and parameters), and where the survivors cannot form whole nodes every
    rank is a node of its own from then on. dropped: the steps whose global
    sync a loss cut short (the rank lost from the next step on): the step
    stands, its mean over the nodes does not, so the parameters are those
    of the new rank 0's node after its local step. joins: {victim: step}, a
    replacement on the victim's data from `step` on, last in the world's
    order (the nodes whole again). Returns the parameters and each rank's
    momentum."""
    model = train_ft.make_model()
    params = [p.detach().clone() for p in model.parameters()]
    alive, one_rank_nodes, joins = list(range(n)), False, joins or {}
    momentum = {r: None for r in alive}          # of each rank (its node's)
    for t in range(steps):
        joined = [r for r, at in joins.items() if at == t]
        survivors = [r for r in alive if r not in joined
                     and (t < lost_from.get(r, steps) or t >= joins.get(r, steps))]
        if survivors + joined != alive:
            alive = survivors + joined
            momentum = {r: momentum[alive[0]] for r in alive}
            one_rank_nodes = (one_rank_nodes and not joined) or len(alive) % per_node != 0
        size = 1 if one_rank_nodes else per_node
        nodes = [alive[i:i + size] for i in range(0, len(alive), size)]
        stepped = []
        for node in nodes:
            grads = None
            for r in node:
                with torch.no_grad():
                    for p, v in zip(model.parameters(), params):
                        p.copy_(v)
                model.zero_grad()
                x, y = train_ft.batch(r, t)
                torch.nn.functional.mse_loss(model(x), y).backward()
                g = [p.grad.clone() for p in model.parameters()]
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            grads = [g / len(node) for g in grads]
            if clip is not None:     # every rank of the node clips the node's mean
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                             for g in grads]))
                grads = [g * torch.clamp(clip / (norm + 1e-6), max=1.0) for g in grads]
            m = momentum[node[0]]
            m = [g.clone() for g in grads] if m is None else [0.9 * a + g for a, g in zip(m, grads)]
            for r in node:
                momentum[r] = m
            stepped.append([v - 0.05 * b for v, b in zip(params, m)])
        if t in dropped:
            new_rank_0 = min(r for r in alive if lost_from.get(r, steps) > t + 1)
            params = next(ps for node, ps in zip(nodes, stepped) if new_rank_0 in node)
        else:
            params = [sum(ps) / len(stepped) for ps in zip(*stepped)]
    return params, momentum


# (kill spec, {victim: the first step without its data}, steps whose global
# sync was dropped), at 4 ranks on emulated nodes of 2.
DASO_CASES = {
    "one rank of a node in backward (every rank a node after), then rank 0 between steps":
        ("1:2:backward;0:5:between", {1: 2, 0: 6}, ()),
    "a whole node in backward": ("2,3:3:backward", {2: 3, 3: 3}, ()),
    "one rank after its node's averaging, before the step": ("2:4:step", {2: 4}, ()),
    "a rank in the global sync, its local step taken": ("3:4:outer", {3: 5}, (4,)),
}


# The same with the habits (FT_HABITS): DASO's own GradScaler (add_scaler),
# the gradients unscaled and clipped before daso.step().
DASO_HABITS_CASES = {
    "habits: a rank lost after backward": ("2:3:step", {2: 3}, ()),
    "habits: a rank in the global sync, its local step taken": ("3:4:outer", {3: 5}, (4,)),
}


@pytest.mark.parametrize("case", list(DASO_CASES) + list(DASO_HABITS_CASES))
def test_daso_survivors_finish_equal_to_the_simulation(tmp_path, case):
    habits = case in DASO_HABITS_CASES
    kill, lost_from, dropped = (DASO_HABITS_CASES if habits else DASO_CASES)[case]
    saved = run_job(tmp_path, 4, kill, FT_ALGORITHM="daso", MPIDP_RANKS_PER_NODE=2,
                    **({"FT_HABITS": 1} if habits else {}))
    params, momentum = simulate_daso(4, 8, lost_from, clip=train_ft.CLIP if habits else None,
                                     dropped=dropped)
    first = saved[min(saved)]
    for rank, got in saved.items():
        assert launched_ranks_lost(got["recoveries"], 4) == sorted(lost_from), got["recoveries"]
        for a, b in zip(got["params"], first["params"]):
            assert torch.equal(a, b), f"rank {rank}'s parameters differ from rank {min(saved)}'s"
        for a, b in zip(got["params"], params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}'s parameters: {m}")
        for a, b in zip(got["momentum"], momentum[rank]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}'s momentum: {m}")


# DASO's global syncs through the engine of GPU parameters (packed and
# merged where the parameters live), run here on CPU parameters.
DEVICE_ENGINE = {"MPIDP_DASO_DEVICE_SYNC": "1"}


@pytest.mark.parametrize("habits,engine", [(False, "host"), (True, "host"), (False, "device")])
def test_daso_grows_back_with_rank_0s_state(tmp_path, habits, engine):
    """recover(replace=True) under DASO (its warm-up), rank 1 lost in step
    3's backward: the step is not taken, then every rank -- the replacement
    last in the world's order, the nodes whole again -- takes rank 0's
    parameters, momentum and schedule, and step 3 is done again by all
    four, the replacement on rank 1's data. habits: DASO's AMP (the step
    through its scaler) and the gradients unscaled and clipped, on every
    rank and the replacement. engine "device": the global syncs through
    the engine of GPU parameters."""
    saved = run_job(tmp_path, 4, "1:3:backward", expect=range(4), FT_ALGORITHM="daso",
                    FT_REPLACE=1, MPIDP_RANKS_PER_NODE=2, **({"FT_HABITS": 1} if habits else {}),
                    **(DEVICE_ENGINE if engine == "device" else {}))
    params, momentum = simulate_daso(4, 8, {1: 3}, joins={1: 3},
                                     clip=train_ft.CLIP if habits else None)
    for key, got in saved.items():
        if key != 1:
            assert [(r["size"], r["lost"], r["joined"]) for r in got["recoveries"]] == \
                [(4, (1,), (3,))], got["recoveries"]
        assert_matches(f"stream {key}", got, params, momentum[key])


@pytest.mark.parametrize("engine", ["host", "device"])
def test_daso_a_rank_lost_with_a_global_sync_in_flight(tmp_path, engine):
    """DASO's cycling phase: replicas differ between global syncs, which are
    in flight across batches. At the recovery every survivor holds the new
    rank 0's replica and momentum as they were after the last step every
    rank completed (the interrupted step not taken, the sync in flight
    dropped); the epoch's last batch ends in a blocking sync. engine
    "device": the syncs through the engine of GPU parameters."""
    # The schedule here: group 1 (ranks 1 and 3) sends after step 4 and
    # merges after step 5; rank 3 dies in step 5's backward.
    saved = run_job(tmp_path, 4, "3:5:backward", FT_ALGORITHM="daso", FT_DASO_CYCLING=1,
                    MPIDP_RANKS_PER_NODE=2, **(DEVICE_ENGINE if engine == "device" else {}))
    root = saved[0]
    (recovery,) = root["recoveries"]
    step = recovery["step"]
    assert step == 5
    kept_params, kept_momentum = root["committed"][step]
    for rank, got in saved.items():
        (mine,) = got["recoveries"]
        for a, b in zip(mine["params"] + mine["momentum"], kept_params + kept_momentum):
            assert torch.equal(a, b), f"rank {rank} did not take rank 0's state at the recovery"
        for a, b in zip(got["params"], root["params"]):
            assert torch.equal(a, b), f"rank {rank} ended with other parameters than rank 0"


def emulated_nodes(alive, per_node, one_rank_nodes, grew):
    """The emulated nodes of the ranks `alive` (lists of ranks, in `alive`'s
    order): rank r on node r // per_node -- or every rank a node of its own,
    as the algorithms over nodes do where the nodes alive hold different
    numbers of ranks, and go on doing (`one_rank_nodes`, from the step
    before) until the job grows back (`grew`). Returns the nodes and
    whether they are one-rank nodes."""
    sizes = collections.Counter(r // per_node for r in alive)
    one_rank_nodes = (one_rank_nodes and not grew) or len(set(sizes.values())) > 1
    nodes = {}
    for r in alive:
        nodes.setdefault(r if one_rank_nodes else r // per_node, []).append(r)
    return list(nodes.values()), one_rank_nodes


def simulate_slowmo(n, steps, lost_from, sync_lost_from, per_node=2, clip=None, joins=None):
    """SlowMo (LOCALSGD base; θ and u whole in fault-tolerant mode) over
    emulated nodes of `per_node` ranks, by its rule: every rank holds its
    node's replica and inner momentum; a node's ranks average their
    gradients and step. After step t, (t + 1) % PERIOD == 0, the replicas
    take their mean over the ranks -- or, where (t + 1) % (2 PERIOD) == 0,
    the slow step runs on that mean x (u = β u + (θ - x) / γ,
    θ -= α γ u) and they take θ. Rank r's data counts in the steps before
    lost_from[r]; it is in the syncs after the steps before
    sync_lost_from[r] (a rank lost in a sync: the sync is done again over
    the survivors). Where the survivors' nodes hold different numbers of
    ranks, every rank is a node of its own from then on. clip: the node's
    mean gradient is clipped to this norm. joins: {rank: (step, source)}, a
    replacement in rank's place from `step` on, holding rank `source`'s
    replica and momentum then (the nodes whole again). Returns each rank's
    parameters and momentum, and (θ, u)."""
    period, lr = train_ft.PERIOD, train_ft.BASE_LR
    models = [train_ft.make_model() for _ in range(n)]
    inner = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in models]
    theta = torch.nn.utils.parameters_to_vector(train_ft.make_model().parameters()).detach()
    u = torch.zeros_like(theta)
    alive, one_rank_nodes, joins = list(range(n)), False, joins or {}

    def takes_part(r, t, lost):
        return t < lost.get(r, steps) or t >= joins.get(r, (steps,))[0]

    for t in range(steps):
        for r, (at, source) in joins.items():
            if t == at:
                models[r].load_state_dict(models[source].state_dict())
                inner[r].load_state_dict(copy.deepcopy(inner[source].state_dict()))
        now = [r for r in range(n) if takes_part(r, t, lost_from)]
        grew, alive = len(now) > len(alive), now
        nodes, one_rank_nodes = emulated_nodes(alive, per_node, one_rank_nodes, grew)
        for node in nodes:
            grads = []
            for r in node:
                models[r].zero_grad()
                x, y = train_ft.batch(r, t)
                torch.nn.functional.mse_loss(models[r](x), y).backward()
                grads.append([p.grad.clone() for p in models[r].parameters()])
            mean = [sum(gs) / len(node) for gs in zip(*grads)]
            if clip is not None:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                             for g in mean]))
                mean = [g * torch.clamp(clip / (norm + 1e-6), max=1.0) for g in mean]
            for r in node:
                for p, g in zip(models[r].parameters(), mean):
                    p.grad = g.clone()
                inner[r].step()
        if (t + 1) % period:
            continue
        in_sync = [r for r in alive if takes_part(r, t, sync_lost_from)]
        x = sum(torch.nn.utils.parameters_to_vector(models[r].parameters()).detach()
                for r in in_sync) / len(in_sync)
        if (t + 1) % (2 * period) == 0:
            u = train_ft.SLOW_MOMENTUM * u + (theta - x) / lr
            theta = theta - train_ft.SLOW_LR * lr * u
            x = theta
        for r in in_sync:
            torch.nn.utils.vector_to_parameters(x.clone(), models[r].parameters())
    return ({r: [p.detach() for p in models[r].parameters()] for r in range(n)},
            {r: [inner[r].state[p]["momentum_buffer"] for p in models[r].parameters()]
             for r in range(n)}, (theta, u))


# (kill spec, {victim: the first step without its data}, {victim: the first
# sync without it}, habits), at 4 ranks on emulated nodes of 2; LocalSGD after
# steps 1 and 5, the slow step after steps 3 and 7. habits: the model wrapped
# twice, AMP's GradScaler, the gradients unscaled and clipped before the step.
SLOWMO_CASES = {
    "one rank of a node in backward (every rank a node after), then rank 0 in a slow step":
        ("1:2:backward;0:3:sync", {1: 2, 0: 4}, {1: 2, 0: 3}, False),
    "a whole node in a LocalSGD average, with the habits":
        ("2,3:5:sync", {2: 6, 3: 6}, {2: 5, 3: 5}, True),
}


def assert_slow_momentum(got, want):
    """SlowMo's u = β u + (θ - x) / γ divides a difference of parameters by
    the base optimizer's learning rate γ, so a parameter's last-bit rounding
    moves u 1/γ times as much: compared in the parameters' units (γ u), at
    their tolerance."""
    lr = train_ft.BASE_LR
    torch.testing.assert_close(got * lr, want * lr, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(SLOWMO_CASES))
def test_slowmo_survivors_continue_from_their_replicas(tmp_path, case):
    kill, lost_from, sync_lost_from, habits = SLOWMO_CASES[case]
    saved = run_job(tmp_path, 4, kill, FT_ALGORITHM="slowmo", MPIDP_RANKS_PER_NODE=2,
                    **({"FT_HABITS": 1} if habits else {}))
    params, momentum, (theta, u) = simulate_slowmo(4, 8, lost_from, sync_lost_from,
                                                   clip=train_ft.CLIP if habits else None)
    tol = dict(rtol=1e-5, atol=1e-6)
    for rank, got in saved.items():
        assert launched_ranks_lost(got["recoveries"], 4) == sorted(lost_from), got["recoveries"]
        for a, b in zip(got["params"], params[rank]):
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"rank {rank}'s parameters: {m}")
        for a, b in zip(got["momentum"], momentum[rank]):
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"rank {rank}'s momentum: {m}")
        torch.testing.assert_close(got["slowmo"]["theta"], theta, **tol)
        assert_slow_momentum(got["slowmo"]["u"], u)


# (kill spec, {victim: the first step without its data}, {victim: the first
# sync without it}, {victim: (the replacement's first step, the survivor whose
# replica and momentum it takes)}), at 4 ranks on emulated nodes of 2.
SLOWMO_GROWING_CASES = {
    "rank 3 lost in a slow step: the survivors finish it, the replacement joins rank 2's node":
        ("3:3:sync", {3: 4}, {3: 3}, {3: (4, 2)}),
    "rank 1 lost in backward: the replacement joins rank 0's node":
        ("1:5:backward", {1: 5}, {1: 5}, {1: (5, 0)}),
    "rank 3 lost in a slow step, every rank and the replacement with the habits (SlowMo "
    "wrapped twice, AMP's scaler, the gradients unscaled and clipped)":
        ("3:3:sync", {3: 4}, {3: 3}, {3: (4, 2)}, True),
}


@pytest.mark.parametrize("case", list(SLOWMO_GROWING_CASES))
def test_slowmo_grows_back_into_the_lost_ranks_node(tmp_path, case):
    """recover(replace=True) under SlowMo (LOCALSGD base): a slow step the
    loss cut short is finished by the survivors alone (every rank a node of
    its own for it, as the nodes are uneven), then the replacement takes the
    lost rank's place in its node, so the nodes are whole again: it trains
    on the lost rank's data with its node's replica, takes its node mate's
    optimizer state before its first step (share_state gave it rank 0's),
    and rank 0's θ, u and step count."""
    kill, lost_from, sync_lost_from, joins, habits = (SLOWMO_GROWING_CASES[case] + (False,))[:5]
    saved = run_job(tmp_path, 4, kill, expect=range(4), FT_ALGORITHM="slowmo", FT_REPLACE=1,
                    MPIDP_RANKS_PER_NODE=2, **({"FT_HABITS": 1} if habits else {}))
    params, momentum, (theta, u) = simulate_slowmo(4, 8, lost_from, sync_lost_from, joins=joins,
                                                   clip=train_ft.CLIP if habits else None)
    victim = next(iter(joins))
    for key, got in saved.items():
        if key != victim:
            assert [(r["size"], r["lost"], r["joined"]) for r in got["recoveries"]] == \
                [(4, (victim,), (3,))], got["recoveries"]
        assert_matches(f"stream {key}", got, params[key], momentum[key])
        torch.testing.assert_close(got["slowmo"]["theta"], theta, rtol=1e-5, atol=1e-6)
        assert_slow_momentum(got["slowmo"]["u"], u)


def simulate_qadam(n, steps, lost_from, order=lambda t, alive: alive):
    """QAdam by its rule over the ranks alive at each step (rank r's batch
    counts in the steps before lost_from[r]): for QADAM_WARMUP steps torch's
    Adam on the mean gradient; after, the second moment frozen, every rank's
    first moment m_r = b1 m + (1 - b1) g_r, their 8-bit average (a replica of
    the quantized allreduce, in the survivors' rank order) taken by all, and
    x -= lr / (1 - b1^t) m / (sqrt(v / (1 - b2^t)) + eps). Returns the
    parameters and the first moments. order(t, alive): the ranks' order in
    the world at step t (a replacement joins last)."""
    model = train_ft.make_model()
    params = list(model.parameters())
    adam = torch.optim.Adam(params, lr=train_ft.QADAM_LR)
    (b1, b2), eps = adam.defaults["betas"], adam.defaults["eps"]
    for t in range(steps):
        alive = order(t, [r for r in range(n) if t < lost_from.get(r, steps)])
        grads = []
        for r in alive:
            model.zero_grad()
            x, y = train_ft.batch(r, t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in params])
        if t < train_ft.QADAM_WARMUP:
            for p, gs in zip(params, zip(*grads)):
                p.grad = sum(gs) / len(alive)
            adam.step()
            continue
        states = [adam.state[p] for p in params]
        moments = [torch.cat([(s["exp_avg"] * b1).add_(g, alpha=1 - b1).reshape(-1)
                              for s, g in zip(states, gs)]) for gs in grads]
        mean = replica_of(moments, average=True)
        offset = 0
        with torch.no_grad():
            for p, s in zip(params, states):
                s["exp_avg"] = mean[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
                s["step"] += 1
                k = float(s["step"])
                denom = (s["exp_avg_sq"] / (1 - b2 ** k)).sqrt().add_(eps)
                p.addcdiv_(s["exp_avg"], denom, value=-train_ft.QADAM_LR / (1 - b1 ** k))
    return [p.detach() for p in params], [adam.state[p]["exp_avg"] for p in params]


def test_qadam_survivors_finish_equal_to_the_simulation(tmp_path):
    """Bagua's QAdam through with_bagua: a rank lost in the warm-up's
    backward (DataParallel's rule), then rank 0 inside a step past the
    warm-up, the survivors' new momenta computed and their average under
    way: that step is applied by no survivor (momenta and step counts
    included) and done again without it."""
    lost_from = {1: 1, 0: 5}
    saved = run_job(tmp_path, 4, "1:1:backward;0:5:average", FT_ALGORITHM="qadam")
    params, moments = simulate_qadam(4, 8, lost_from)
    first = saved[min(saved)]
    for rank, got in saved.items():
        assert launched_ranks_lost(got["recoveries"], 4) == sorted(lost_from), got["recoveries"]
        for a, b in zip(got["params"] + got["momentum"], first["params"] + first["momentum"]):
            assert torch.equal(a, b), f"rank {rank}'s state differs from rank {min(saved)}'s"
    for a, b in zip(first["params"], params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(first["momentum"], moments):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_qadam_grows_back_past_its_warm_up(tmp_path):
    """recover(replace=True) under QAdam, a rank lost inside a step past the
    warm-up: the replacement takes rank 0's parameters and optimizer state
    (with_bagua's set-up, then share_state), so it skips the warm-up as the
    survivors do; the step is done again by all four, the replacement last
    in the world's order (which the 8-bit average follows)."""
    saved = run_job(tmp_path, 4, "2:4:average", expect=range(4), FT_ALGORITHM="qadam",
                    FT_REPLACE=1)
    params, moments = simulate_qadam(
        4, 8, {}, order=lambda t, alive: alive if t < 4 else [0, 1, 3, 2])
    for key, got in saved.items():
        for a, b in zip(got["params"] + got["momentum"], saved[0]["params"] + saved[0]["momentum"]):
            assert torch.equal(a, b), f"stream {key}'s state differs from stream 0's"
    for a, b in zip(saved[0]["params"], params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(saved[0]["momentum"], moments):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_interrupted_by_a_failure_is_written_by_the_survivors(tmp_path):
    saved = run_job(tmp_path, 4, "3:4:checkpoint")
    history = check_survivors(saved, 4, {3: 5})
    written = torch.load(tmp_path / "checkpoint.pt")
    assert written["steps"] == 5
    for key, value in history[4]["model"].items():
        torch.testing.assert_close(written["model"][key], value, rtol=1e-5, atol=1e-6)
    # A relaunch (here: one process) resumes from it with the usual state_dicts.
    model = train_ft.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.load_state_dict(written["model"])
    opt.load_state_dict(written["optimizer"])
    ref = history[4]["optimizer"]["state"]
    for i, state in opt.state_dict()["state"].items():
        torch.testing.assert_close(state["momentum_buffer"], ref[i]["momentum_buffer"],
                                   rtol=1e-5, atol=1e-6)


GROWING_CASES = {
    "DataParallel": {},
    "hierarchical DataParallel, nodes of 2": {"FT_HIERARCHICAL": 1, "MPIDP_RANKS_PER_NODE": 2},
    "non-blocking DataParallel": {"FT_NONBLOCKING": 1},
    "DataParallel with the habits (wrapped twice, two optimizers, AMP, clipped), the "
    "replacement's script too": {"FT_HABITS": 1},
    # (with_bagua's set-up, repeated where a replacement joins, is covered by
    # LocalSGD's, QAdam's and the decentralized algorithms' growing back;
    # ByteGrad's runs on DataParallel's.)
}


@pytest.mark.parametrize("case", list(GROWING_CASES))
def test_the_job_grows_back_to_its_size_with_a_replacement_that_takes_the_state(tmp_path, case):
    """recover(replace=True): a process is spawned for the lost rank, takes
    rank 0's parameters (set-up) and optimizer state (share_state), and
    trains on the lost rank's data: with the failed step done again by all
    four, the run ends where a run without failure ends. Under with_bagua
    (ByteGrad), the survivors repeat with_bagua's own set-up too."""
    env = GROWING_CASES[case]
    algorithm = env.get("FT_ALGORITHM")
    saved = run_job(tmp_path, 4, "2:3:backward", expect=range(4), FT_REPLACE=1, **env)
    # ByteGrad's 8-bit codes of the mean gradient, as in the hierarchical case above.
    tol = dict(rtol=0, atol=3e-3) if algorithm else dict(rtol=1e-5, atol=1e-6)
    params, momentum, _ = simulate(4, 8, {}, clip=train_ft.CLIP if "FT_HABITS" in env else None)
    first = saved[0]
    for key, got in saved.items():
        for a, b in zip(got["params"], first["params"]):
            assert torch.equal(a, b), f"stream {key}'s parameters differ from stream 0's"
        if key != 2:
            assert [(r["size"], r["lost"], r["joined"]) for r in got["recoveries"]] == \
                [(4, (2,), (3,))], got["recoveries"]
    for a, b in zip(first["params"], params):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(saved[2]["momentum"], momentum):
        torch.testing.assert_close(a, b, **tol)


def test_algorithms_that_cannot_go_on_are_refused_when_set_up():
    out = subprocess.run([os.path.join(ROOT, "scripts/mpirun_ft.sh"), "1", sys.executable,
                          os.path.join(HERE, "refusals.py")], capture_output=True, text=True,
                         timeout=120)
    assert "ALL REFUSED" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_a_job_launched_without_ulfm_is_refused_naming_the_launch():
    env = dict(os.environ, FT_LAUNCH_WITHOUT_ULFM="1")
    out = subprocess.run([os.path.join(ROOT, "scripts/mpirun_ft.sh"), "2", sys.executable, "-c",
                          "import mpidp"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "not started with it: launch with `mpirun --with-ft ulfm" in out.stderr, out.stderr


def test_ranks_that_differ_in_the_mode_are_refused_on_every_rank():
    """A rank not in fault-tolerant mode would leave the others waiting
    forever in their step-end agreements: the first wrapper refuses."""
    script = ("import os\n"
              "from mpi4py import MPI\n"
              "if MPI.COMM_WORLD.Get_rank() == 1:\n"
              "    os.environ['MPIDP_FAULT_TOLERANCE'] = '0'\n"
              "import torch, mpidp\n"
              "try:\n"
              "    mpidp.DataParallel(torch.nn.Linear(3, 1))\n"
              "except RuntimeError as error:\n"
              "    print(f'rank {MPI.COMM_WORLD.Get_rank()} refused: {error}', flush=True)\n")
    out = subprocess.run([os.path.join(ROOT, "scripts/mpirun_ft.sh"), "2", sys.executable, "-c",
                          script], capture_output=True, text=True, timeout=120)
    for rank in (0, 1):
        assert (f"rank {rank} refused: fault-tolerant mode is on on rank(s) [0] and off on "
                "rank(s) [1]") in out.stdout, out.stdout + out.stderr[-3000:]
