"""Fault-tolerant mode over worker groups (mpidp/_runtime/fault_tolerant_groups.py)
and HierarchicalModelAverager, tested by killing ranks.

Each test launches tests/fault_tolerance/ulfm/groups_ft.py: the world split into
groups, each training a model of its own over its group's communicator (the
Propulate recipe). A rank's death stops only its group: its survivors call
recover(comm=group) and the other groups never see the loss (or, with
FT_RECOVER=job, every survivor of the job calls recover() and every group is
made again of its survivors). Every survivor is compared with a simulation
of its group's replicas; those of groups the loss did not touch must match
training with no loss at all."""

import os
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import groups_ft  # noqa: E402
import train_ft  # noqa: E402
from test_fault_tolerance import (launch, simulate_daso, simulate_qadam, simulate_replicas,  # noqa: E402
                                  simulate_slowmo)
from test_decentralized import assert_survivors_match, simulate_dcd, simulate_dpsgd  # noqa: E402
from test_low_communication import (TOL, assert_noloco_matches,  # noqa: E402
                                    assert_sparseloco_matches, simulate_demo, simulate_desloc,
                                    simulate_noloco, simulate_sparseloco)

pytestmark = pytest.mark.serial
STEPS = 8


def run_groups(tmp_path, n, groups, kill, **env):
    """Runs groups_ft.py; returns {launched rank: what it saved}."""
    proc = launch(tmp_path, n, kill, STEPS, FT_GROUPS=";".join(",".join(map(str, g))
                                                                for g in groups),
                  FT_SCRIPT="groups_ft.py", **env)
    saved = {int(f[5:-3]): torch.load(tmp_path / f) for f in os.listdir(tmp_path)
             if f.startswith("rank-")}
    victims = {int(k.split(":")[0]) for k in kill.split(";")}
    assert set(saved) == set(range(n)) - victims, (
        f"ranks that finished: {sorted(saved)}; mpirun exit {proc.returncode}\n"
        + proc.stderr[-4000:])
    return saved


def simulate_data_parallel(members, lost_from, clip=None):
    """DataParallel over `members` (launched ranks): each step's gradient is
    the mean over the members alive in it (clipped to norm `clip`, if
    given); SGD with momentum."""
    model = train_ft.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for t in range(STEPS):
        alive = [r for r in members if t < lost_from.get(r, STEPS)]
        grads = []
        for r in alive:
            model.zero_grad()
            x, y = train_ft.batch(r, t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *g in zip(model.parameters(), *grads):
            p.grad = sum(g) / len(alive)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach() for p in model.parameters()], \
        [opt.state[p]["momentum_buffer"] for p in model.parameters()]


def assert_close(got, want, what):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def assert_members_match(saved, members, params, momentum, momentum_name="momentum"):
    """Each surviving member's parameters and momentum against the
    simulation's for it: params(r), momentum(r)."""
    for r in members:
        if r in saved:
            assert_close(saved[r]["params"], params(r), f"rank {r}'s parameters")
            assert_close(saved[r]["momentum"], momentum(r), f"rank {r}'s {momentum_name}")


def check_data_parallel(saved, groups, lost_from, clip=None):
    for members in groups:
        params, momentum = simulate_data_parallel(members, lost_from, clip)
        assert_members_match(saved, members, lambda r: params, lambda r: momentum)


def check_replicas(saved, groups, lost_from, algorithm, clip=None):
    """Each group's replicas (postlocalsgd, diloco) by the rule of
    tests/fault_tolerance/ulfm/test_fault_tolerance.py's simulation, over the
    group's ranks."""
    for members in groups:
        index = {r: i for i, r in enumerate(members)}
        streams = dict(zip(range(len(members)), members))
        params, momentum = simulate_replicas(
            len(members), STEPS, {index[r]: s for r, s in lost_from.items() if r in index},
            algorithm, streams=streams, clip=clip)
        assert_members_match(saved, members, lambda r: params[index[r]],
                             lambda r: momentum[index[r]])


def check_groups_recovered(saved, groups, lost_from, mode):
    """Group mode: the groups the loss did not touch never saw it, and each
    touched group's survivors recovered it alone. Job mode: every survivor
    recovered the job; the world's count is the survivors'."""
    n_alive = len(saved)
    for members in groups:
        lost = [r for r in members if r in lost_from]
        for r in members:
            if r not in saved:
                continue
            got = saved[r]
            assert got["steps"] == STEPS
            assert got["group_size"] == len(members) - len(lost)
            if mode == "job":
                assert got["losses"] >= 1 and got["world_sum"] == n_alive, got
                continue
            if not lost:
                assert got["losses"] == 0 and got["recoveries"] == [], \
                    f"rank {r}, in a group the loss did not touch, saw it: {got['recoveries']}"
            else:
                last = got["recoveries"][-1]
                assert (last["size"], last["previous_size"]) == (len(members) - len(lost),
                                                                 len(members)), got
                assert sorted(lost) == sorted(members[i] for rec in got["recoveries"]
                                              for i in rec["lost"]), got


def check_first_group(saved, members, lost_from, algorithm):
    """The survivors of the first group (launched ranks 0..k-1, the data
    streams of test_low_communication.py's and test_decentralized.py's
    simulations) by those simulations."""
    assert members == list(range(len(members)))
    n = len(members)
    if algorithm == "sparseloco":
        params, errors, shared = simulate_sparseloco(n, STEPS, lost_from, 0)
        for r in members:
            if r in saved:
                assert_sparseloco_matches(f"rank {r}", saved[r], saved[min(saved)], params[r],
                                          errors[r], shared)
        return
    if algorithm == "slowmo":     # lost_from: the first step without the data; 3: in sync 3
        params, momentum, _ = simulate_slowmo(n, STEPS, lost_from,
                                              {r: s - 1 for r, s in lost_from.items()})
        assert_members_match(saved, members, lambda r: params[r], lambda r: momentum[r])
        return
    if algorithm in ("noloco", "eager"):
        assert_noloco_matches({r: saved[r] for r in members if r in saved},
                              simulate_noloco(n, STEPS, lost_from, algorithm=algorithm))
        return
    if algorithm == "desloc":
        assert_noloco_matches({r: saved[r] for r in members if r in saved},
                              simulate_desloc(n, STEPS, lost_from))
        return
    if algorithm == "daso":
        params, momentum = simulate_daso(n, STEPS, lost_from)
        assert_members_match(saved, members, lambda r: params, lambda r: momentum[r])
        return
    if algorithm == "qadam":
        params, moments = simulate_qadam(n, STEPS, lost_from)
        assert_members_match(saved, members, lambda r: params, lambda r: moments,
                             "first moment")
        return
    if algorithm in ("decentralized", "lowprecision"):
        models, inner = simulate_dpsgd(n, STEPS, lost_from, "all") \
            if algorithm == "decentralized" else simulate_dcd(n, STEPS, lost_from)
        tol = dict(rtol=1e-5, atol=1e-6 if algorithm == "decentralized" else 1e-5)
        assert_survivors_match({r: saved[r] for r in members if r in saved}, n, None, models,
                               inner, tol)
        return
    params, deltas = simulate_demo(n, STEPS, lost_from)
    for r in members:
        if r in saved:
            for a, b in zip(saved[r]["params"], params):
                np.testing.assert_allclose(a.double().numpy(), b, **TOL,
                                           err_msg=f"rank {r}'s parameters")
            for a, b in zip(saved[r]["momentum"], deltas[r]):
                np.testing.assert_allclose(a.double().numpy(), b, rtol=1e-4, atol=1e-6,
                                           err_msg=f"rank {r}'s momentum")


# (ranks, groups, kill spec, {victim: the first step without its data or
# replica}, algorithm, how the survivors recover, FT_HABITS: AMP's scaler,
# the gradients clipped, DataParallel wrapped twice)
CASES = {
    "DataParallel over a group, habits: a rank lost in backward":
        (4, [[0, 1], [2, 3]], "3:3:backward", {3: 3}, "dp", "group", True),
    "PostLocalSGD over a group, habits: a rank lost at an averaging step":
        (4, [[0, 1, 2], [3]], "1:4:step", {1: 4}, "postlocalsgd", "group", True),
    "DataParallel, a rank of the second group lost in backward":
        (4, [[0, 1], [2, 3]], "3:3:backward", {3: 3}, "dp", "group"),
    "DataParallel, a rank lost in backward, then another inside the group's recovery":
        (4, [[0, 1, 2], [3]], "2:3:backward;1:3:rebuild", {2: 3, 1: 3}, "dp", "group"),
    "non-blocking DataParallel, the group's rank 0 lost before its step":
        (3, [[0], [1, 2]], "1:3:step", {1: 3}, "nonblocking", "group"),
    "PostLocalSGD over a group, a rank lost at an averaging step":
        (4, [[0, 1, 2], [3]], "1:4:step", {1: 4}, "postlocalsgd", "group"),
    "with_bagua's GradientAllReduce over a group, a rank lost in backward":
        (4, [[0, 1, 2], [3]], "0:5:backward", {0: 5}, "gradient_allreduce", "group"),
    "DiLoCo over a group, a rank lost at a sync step":
        (4, [[0, 1], [2, 3]], "2:5:step", {2: 5}, "diloco", "group"),
    "SparseLoCo over a group, a rank lost between syncs":
        (4, [[0, 1, 2], [3]], "1:2:backward", {1: 2}, "sparseloco", "group"),
    "NoLoCo over a group, a rank lost between syncs":
        (4, [[0, 1, 2], [3]], "1:2:backward", {1: 2}, "noloco", "group"),
    "DESLOC over a group, a rank lost before an average":
        (4, [[0, 1, 2], [3]], "2:3:step", {2: 3}, "desloc", "group"),
    "EagerDiLoCo over a group, its rank 0 lost with the all-reduce in flight":
        (4, [[0, 1, 2], [3]], "0:2:backward", {0: 2}, "eager", "group"),
    "DeMo over a group, the group's rank 0 lost in backward":
        (4, [[0, 1, 2], [3]], "0:3:backward", {0: 3}, "demo", "group"),
    "DecentralizedAlgorithm over a group, a rank lost in backward, its exchange in flight":
        (4, [[0, 1, 2], [3]], "1:2:backward", {1: 2}, "decentralized", "group"),
    "LowPrecisionDecentralizedAlgorithm over a group, the group's rank 0 lost before its step":
        (4, [[0, 1, 2], [3]], "0:3:step", {0: 3}, "lowprecision", "group"),
    "QAdam over a group, a rank lost in a step past its warm-up":
        (4, [[0, 1, 2], [3]], "1:5:backward", {1: 5}, "qadam", "group"),
    "SlowMo over a group (a node of 2), one rank lost in a slow step":
        (4, [[0, 1], [2, 3]], "1:3:sync", {1: 4}, "slowmo", "group"),
    "DASO over a group (two nodes of 2), one rank lost in backward":
        (6, [[0, 1, 2, 3], [4, 5]], "1:2:backward", {1: 2}, "daso", "group"),
    "DataParallel, every survivor of the job recovers it":
        (4, [[0, 1], [2, 3]], "2:3:backward", {2: 3}, "dp", "job"),
    "PostLocalSGD over groups, every survivor of the job recovers it":
        (3, [[0, 1], [2]], "0:4:step", {0: 4}, "postlocalsgd", "job"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_loss_in_one_group_recovers_that_group(tmp_path, case):
    n, groups, kill, lost_from, algorithm, mode, habits = (CASES[case] + (False,))[:7]
    env = {"MPIDP_RANKS_PER_NODE": 2} if algorithm in ("slowmo", "daso") else {}
    if habits:
        env["FT_HABITS"] = 1
    saved = run_groups(tmp_path, n, groups, kill, FT_ALGORITHM=algorithm, FT_RECOVER=mode, **env)
    clip = train_ft.CLIP if habits else None
    check_groups_recovered(saved, groups, lost_from, mode)
    if algorithm in ("postlocalsgd", "diloco"):
        check_replicas(saved, groups, lost_from, algorithm, clip)
    elif algorithm in ("sparseloco", "demo", "decentralized", "lowprecision", "qadam",
                       "slowmo", "daso", "noloco", "eager", "desloc"):
        check_first_group(saved, groups[0], lost_from, algorithm)
    else:
        check_data_parallel(saved, groups, lost_from, clip)


def simulate_hierarchical(n, lost_from):
    """HierarchicalModelAverager(groups_ft.HIERARCHY) by torch's rule: after
    local step t, the replicas average over the groups of the largest period
    that divides t (consecutive ranks of that size; the last size is the
    world). A loss keeps each group's survivors together; the averaging it
    interrupted is done over them. Returns each replica's parameters and
    momentum."""
    hierarchy = groups_ft.HIERARCHY
    models = [train_ft.make_model() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    for t in range(STEPS):
        alive = [r for r in range(n) if t < lost_from.get(r, STEPS)]
        for r in alive:
            models[r].zero_grad()
            x, y = train_ft.batch(r, t)
            torch.nn.functional.mse_loss(models[r](x), y).backward()
            opts[r].step()
        period = max((p for p in hierarchy if t % p == 0), default=None)
        if period is None:
            continue
        size = hierarchy[period]
        for first in range(0, n, size):
            group = [r for r in range(first, first + size) if r in alive]
            with torch.no_grad():
                for ps in zip(*(models[r].parameters() for r in group)):
                    mean = sum(p / len(group) for p in ps)
                    for p in ps:
                        p.copy_(mean)
    return ({r: [p.detach() for p in models[r].parameters()] for r in range(n)},
            {r: [opts[r].state[p]["momentum_buffer"] for p in models[r].parameters()]
             for r in range(n)})


# (kill spec, {victim: the first step without its replica})
HIERARCHICAL_CASES = {
    "a rank lost at a first-level averaging step": ("3:2:step", {3: 2}),
    "rank 0 lost in backward of a whole-world averaging step": ("0:4:backward", {0: 4}),
    "a rank lost between averagings, then another at the next": ("1:3:backward;2:4:step",
                                                                 {1: 3, 2: 4}),
}


@pytest.mark.parametrize("case", list(HIERARCHICAL_CASES))
def test_hierarchical_model_averager_keeps_each_groups_survivors(tmp_path, case):
    """Every level's averaging is agreed by every rank, so a loss in any
    group stops the job at one step; recover() makes each group again of
    its survivors and completes the averaging the loss interrupted."""
    kill, lost_from = HIERARCHICAL_CASES[case]
    saved = run_groups(tmp_path, 4, [[0, 1], [2, 3]], kill, FT_ALGORITHM="hierarchical",
                       FT_RECOVER="job")
    params, momentum = simulate_hierarchical(4, lost_from)
    for r, got in saved.items():
        assert got["steps"] == STEPS and got["world_sum"] == len(saved), got
        assert_close(got["params"], params[r], f"rank {r}'s parameters")
        assert_close(got["momentum"], momentum[r], f"rank {r}'s momentum")
