"""Fault-tolerant mode for the low-communication algorithms (SparseLoCo, DeMo,
Streaming DiLoCo), tested by killing ranks (tests/fault_tolerance/ulfm/train_ft.py):
what every survivor ends with is compared with a simulation of the
surviving replicas written from each rule in docs/fault-tolerance.md:

- SparseLoCo: a sync a rank's death interrupted is redone over the
  survivors from each one's error feedback and replica as they were at its
  send; the lost rank's error feedback leaves with it.
- DeMo: a step in which a rank died is applied by no survivor (momenta and
  step count put back) and done again without it.
- Streaming DiLoCo: a fragment whose outer-gradient allreduce was in flight
  is sent again over the survivors, from the replica it was sent from.
- NoLoCo: a sync a rank's death interrupted is done again over the
  survivors' own draw of groups; the lost rank's θ and outer momentum leave
  with it.
- DES-LOC: an average a rank's death interrupted is taken by no survivor
  and done again over the survivors; the lost rank's replica and Adam
  state leave with it.
- EagerDiLoCo: the last round's all-reduce, in flight through an inner
  phase, is posted again over the survivors (the lost rank's outer
  gradient leaves with it), and a sync the death interrupted is done again.

These run in the fault-tolerance pass (.venv-ft), as test_fault_tolerance.py."""

import copy
import os
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_ft  # noqa: E402
from test_fault_tolerance import launched_ranks_lost, run_job  # noqa: E402
from ef_reference import DeMoSim, MuLoCoSim, SparseLoCoSim  # noqa: E402
from noloco_reference import NoLoCoSim  # noqa: E402
from eager_reference import EagerDiLoCoSim  # noqa: E402
from desloc_reference import DESLOCSim  # noqa: E402

pytestmark = pytest.mark.serial

TOL = dict(rtol=2e-5, atol=2e-6)


def inner_models(n):
    """Every replica's model and inner optimizer (train_ft's SGD)."""
    models = [train_ft.make_model() for _ in range(n)]
    return models, [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]


def gradient(model, rank, t, clip):
    """Rank's gradient of step t's batch at `model`'s weights (FT_HABITS:
    clipped to norm `clip`, as train_ft does after unscaling)."""
    model.zero_grad()
    x, y = train_ft.batch(rank, t)
    torch.nn.functional.mse_loss(model(x), y).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)


def inner_step(model, opt, rank, t, clip=None):
    gradient(model, rank, t, clip)
    opt.step()


def habits(on):
    """The job's variables and the simulation's clip for FT_HABITS (the
    model wrapped twice, AMP's GradScaler, the gradients clipped)."""
    return ({"FT_HABITS": 1}, train_ft.CLIP) if on else ({}, None)


def as_numpy(model):
    return [p.detach().double().numpy() for p in model.parameters()]


def assert_a_step_apart(saved, step):
    """FT_SUSPECT="0:<step>": rank 0 went on from `step`, the others from the
    step after (their round of `step` had begun)."""
    resumed = {r: [x["resumed_at"] for x in got["recoveries"]] for r, got in saved.items()}
    assert resumed == {0: [step], 1: [step + 1], 2: [step + 1]}, resumed


def assert_sparseloco_matches(who, got, first, params, errors, shared):
    """`who`'s saved SparseLoCo state: θ̃ bit-equal to `first`'s, and its
    parameters, error feedback and θ̃ those of the simulation."""
    state = got["sparseloco"]
    for a, b in zip(state["shared"], first["sparseloco"]["shared"]):
        assert torch.equal(a, b), f"{who}'s θ̃ differs from the first survivor's"
    for a, b in zip(got["params"], params):
        np.testing.assert_allclose(a.double().numpy(), b, **TOL, err_msg=f"{who}'s parameters")
    for a, b in zip(state["error"], errors):
        np.testing.assert_allclose(a.double().numpy(), b, **TOL,
                                   err_msg=f"{who}'s error feedback")
    for a, b in zip(state["shared"], shared):
        np.testing.assert_allclose(a.double().numpy(), b, **TOL, err_msg="θ̃")


def assert_grew_back(saved, victim, resumed_at):
    """Every survivor's one recovery lost `victim` and took a replacement
    (rank 3 of 4), and went on from step `resumed_at`."""
    for key, got in saved.items():
        if key != victim:
            assert [(r["size"], r["lost"], r["joined"], r["resumed_at"])
                    for r in got["recoveries"]] == [(4, (victim,), (3,), resumed_at)], \
                got["recoveries"]


def ef_simulation(algorithm, model, n):
    """The simulation of train_ft's SparseLoCo or MuLoCo from `model`."""
    if algorithm == "muloco":
        return MuLoCoSim(as_numpy(model), n, chunk_size=train_ft.EF_CHUNK, **train_ft.MULOCO_OUTER)
    return SparseLoCoSim(as_numpy(model), n, top_k=train_ft.EF_TOP_K,
                         chunk_size=train_ft.EF_CHUNK)


def simulate_sparseloco(n, steps, lost_from, delay, clip=None, algorithm="sparseloco"):
    """Every replica trains with its own inner SGD; after inner step t the
    replicas of the ranks alive then send ((t + 1) % PERIOD == PERIOD -
    delay), and at (t + 1) % PERIOD == 0 the ranks alive then take the
    round over what they sent (each with its own error feedback) and
    restart from θ̃. Rank r is alive in the steps before lost_from[r].
    Returns each rank's parameters and error feedback, and θ̃. algorithm:
    "muloco" for MuLoCo's round (MuLoCoSim)."""
    period = train_ft.PERIOD
    models, inner = inner_models(n)
    sim = ef_simulation(algorithm, models[0], n)
    errors = dict(enumerate(sim.error))
    sent = {}
    for t in range(steps):
        alive = [r for r in range(n) if t < lost_from.get(r, steps)]
        for r in alive:
            inner_step(models[r], inner[r], r, t, clip)
        if (t + 1) % period == (period - delay) % period:
            sent = {r: as_numpy(models[r]) for r in alive}
        if (t + 1) % period == 0:
            sim.error = [errors[r] for r in alive]
            shared = sim.round([sent[r] for r in alive])
            errors.update(zip(alive, sim.error))
            with torch.no_grad():
                for r in alive:
                    for p, s in zip(models[r].parameters(), shared):
                        p.copy_(torch.from_numpy(s))
    return {r: as_numpy(models[r]) for r in range(n)}, errors, sim.shared


# (ranks, kill spec, {victim: the first step without it}, sync_delay,
# FT_SUSPECT, FT_HABITS, the environment beside); syncs after inner steps 1, 3, 5 and 7 (with
# sync_delay 1 each sent a step before).
SPARSELOCO_CASES = {
    "habits (wrapped twice, AMP, clipped): a rank lost between syncs, then rank 0 with the "
    "allgather in flight": (4, "1:2:backward;0:5:outer", {1: 2, 0: 5}, 0, "", True),
    "two ranks at once with the allgather in flight, leaving one":
        (3, "0,2:3:outer", {0: 3, 2: 3}, 0),
    "sync_delay: a rank lost between the send and its turn (its payload sent)":
        (3, "1:3:backward", {1: 3}, 1),
    "sync_delay: at the turn, then another in the recovery's agreement":
        (4, "3:5:outer;2:5:agreement", {3: 5, 2: 5}, 1),
    # Rank 0 takes an error for a failure before step 3's forward, with its
    # send of step 2 in flight, while the others are in step 3's turn: a
    # step apart, every rank redoes the sync (none was lost).
    "sync_delay: the ranks a step apart when the loss is found":
        (3, "", {}, 1, "0:3"),
    # 2 emulated nodes of 2: the wire's node route (node_gather.py) until the
    # loss, the flat allgather over the 3 survivors (their nodes uneven).
    "nodes of 2: a rank lost with the gather across nodes in flight":
        (4, "2:3:outer", {2: 3}, 0, "", False, {"MPIDP_RANKS_PER_NODE": 2}),
}


# MuLoCo recovers by SparseLoCo's rule (its outer optimizer's state, equal
# on every survivor, stays): a loss in the inner phase and one in the sync.
MULOCO_CASES = {
    "habits: a rank lost in backward, then rank 0 with the allgather in flight":
        (4, "1:2:backward;0:5:outer", {1: 2, 0: 5}, 0, "", True),
    "sync_delay: at the turn, then another in the recovery's agreement":
        (4, "3:5:outer;2:5:agreement", {3: 5, 2: 5}, 1),
}


@pytest.mark.parametrize("algorithm, case", [("sparseloco", c) for c in SPARSELOCO_CASES]
                         + [("muloco", c) for c in MULOCO_CASES])
def test_sparseloco_survivors_match_the_simulation(tmp_path, algorithm, case):
    cases = SPARSELOCO_CASES if algorithm == "sparseloco" else MULOCO_CASES
    given = cases[case]
    n, kill, lost_from, delay, suspect, with_habits, extra = \
        given + ("", False, {})[len(given) - 4:]
    env, clip = habits(with_habits)
    env.update(extra)
    saved = run_job(tmp_path, n, kill, FT_ALGORITHM=algorithm, FT_SYNC_DELAY=delay,
                    FT_SUSPECT=suspect, **env)
    if suspect:
        assert_a_step_apart(saved, int(suspect[2:]))
    params, errors, shared = simulate_sparseloco(n, 8, lost_from, delay, clip, algorithm)
    for rank, got in saved.items():
        assert launched_ranks_lost(got["recoveries"], n) == sorted(lost_from), got["recoveries"]
        assert_sparseloco_matches(f"rank {rank}", got, saved[min(saved)], params[rank],
                                  errors[rank], shared)


def simulate_demo(n, steps, lost_from, clip=None):
    """DeMo over the ranks alive at each step (rank r's batch counts in the
    steps before lost_from[r]): every rank's gradient at the shared
    parameters goes into its own momentum, and the sign of their sparse
    mean steps the parameters. Returns the parameters and each rank's
    momentum."""
    model = train_ft.make_model()
    params = as_numpy(model)
    sim = DeMoSim(params, n, topk=3, chunk=train_ft.EF_CHUNK, decay=train_ft.DEMO_DECAY)
    deltas = dict(enumerate(sim.delta))
    for t in range(steps):
        alive = [r for r in range(n) if t < lost_from.get(r, steps)]
        grads = []
        for r in alive:
            with torch.no_grad():
                for p, v in zip(model.parameters(), params):
                    p.copy_(torch.from_numpy(v))
            gradient(model, r, t, clip)
            grads.append([p.grad.double().numpy() for p in model.parameters()])
        sim.delta = [deltas[r] for r in alive]
        params = sim.step(params, grads, train_ft.DEMO_LR)
        deltas.update(zip(alive, sim.delta))
    return params, deltas


# (ranks, kill spec, {victim: the first step without it}, FT_HABITS)
DEMO_CASES = {
    "habits (two DeMos, AMP, clipped): a rank lost in backward, then rank 0 with the "
    "allgather in flight": (4, "1:2:backward;0:5:outer", {1: 2, 0: 5}, True),
    "between two steps, then another inside the survivors' shrink, leaving one":
        (3, "2:3:between;1:4:shrink", {2: 4, 1: 4}),
}


@pytest.mark.parametrize("case", list(DEMO_CASES))
def test_demo_survivors_match_the_simulation(tmp_path, case):
    n, kill, lost_from, with_habits = (DEMO_CASES[case] + (False,))[:4]
    env, clip = habits(with_habits)
    saved = run_job(tmp_path, n, kill, FT_ALGORITHM="demo", **env)
    params, deltas = simulate_demo(n, 8, lost_from, clip)
    first = saved[min(saved)]
    for rank, got in saved.items():
        assert launched_ranks_lost(got["recoveries"], n) == sorted(lost_from), got["recoveries"]
        for a, b in zip(got["params"], first["params"]):
            assert torch.equal(a, b), f"rank {rank}'s parameters differ from rank {min(saved)}'s"
        for a, b in zip(got["params"], params):
            np.testing.assert_allclose(a.double().numpy(), b, **TOL, err_msg="parameters")
        for a, b in zip(got["momentum"], deltas[rank]):
            np.testing.assert_allclose(a.double().numpy(), b, rtol=1e-4, atol=1e-6,
                                       err_msg=f"rank {rank}'s momentum")


def take_turn(theta, outer, layer, fragment, sent, models):
    """A fragment's turn: θ's parameters in the fragment's layers (layer[i]:
    parameter i's) take the outer step on θ minus the mean of `sent` (the
    replicas sent, each a parameter list), and every model of `models`
    takes them."""
    with torch.no_grad():
        for i, th in enumerate(theta.parameters()):
            th.grad = th - sum(x[i] for x in sent) / len(sent) if layer[i] in fragment else None
        outer.step()
        for m in models:
            for i, (p, th) in enumerate(zip(m.parameters(), theta.parameters())):
                if layer[i] in fragment:
                    p.copy_(th)


def assert_diloco_matches(who, got, params, momentum):
    """`who`'s saved parameters and outer momentum are the simulation's."""
    for a, b in zip(got["params"], params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{who}'s parameters: {m}")
    for a, b in zip(got["momentum"], momentum):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"the outer momentum of {who}: {m}")


def simulate_streaming_diloco(n, steps, lost_from, clip=None):
    """Streaming DiLoCo by its rule: train_ft.FRAGMENTS take turns, one every
    PERIOD steps; after inner step t, t % PERIOD == 0, the replicas of the
    ranks alive then send fragment f = t // PERIOD % len(FRAGMENTS); after
    step t + 1 the ranks alive then take the outer step of f on θ minus the
    mean of what they sent, and take θ's f. Returns each rank's parameters
    and the outer momentum."""
    period, fragments = train_ft.PERIOD, train_ft.FRAGMENTS
    models, inner = inner_models(n)
    theta = train_ft.make_model()
    outer = torch.optim.SGD(theta.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    layer = [i for i, m in enumerate(theta) for _ in m.parameters()]   # each parameter's
    sent = {}
    for t in range(steps):
        alive = [r for r in range(n) if t < lost_from.get(r, steps)]
        for r in alive:
            inner_step(models[r], inner[r], r, t, clip)
        f = fragments[t // period % len(fragments)]
        if t % period == 0:
            sent = {r: [p.detach().clone() for p in models[r].parameters()] for r in alive}
            continue
        take_turn(theta, outer, layer, f, [sent[r] for r in alive], [models[r] for r in alive])
    return ({r: [p.detach() for p in models[r].parameters()] for r in range(n)},
            [outer.state[p]["momentum_buffer"] for p in theta.parameters()])


# (ranks, kill spec, {victim: the first step without it}, FT_SUSPECT,
# FT_HABITS); fragment 0
# sent after steps 0 and 4 and applied after 1 and 5, fragment 1 after 2 and 6
# and applied after 3 and 7.
STREAMING_CASES = {
    "a rank lost between a fragment's send and its turn (its part sent)":
        (3, "2:3:backward", {2: 3}, ""),
    "habits (wrapped twice, AMP, clipped): at a turn, then another in the recovery's agreement":
        (4, "1:5:outer;3:5:agreement", {1: 5, 3: 5}, "", True),
    "rank 0 after its send, then another inside the survivors' shrink":
        (4, "0:2:between;2:3:shrink", {0: 3, 2: 3}, ""),
    # Rank 0 takes an error for a failure before step 4's forward while the
    # others are in step 4's hook (fragment 0's send): a step apart, every
    # rank sends it (none was lost).
    "the ranks a step apart when the loss is found": (3, "", {}, "0:4"),
}


@pytest.mark.parametrize("case", list(STREAMING_CASES))
def test_streaming_diloco_survivors_match_the_simulation(tmp_path, case):
    n, kill, lost_from, suspect, with_habits = (STREAMING_CASES[case] + (False,))[:5]
    env, clip = habits(with_habits)
    saved = run_job(tmp_path, n, kill, FT_ALGORITHM="diloco", FT_FRAGMENTS=1,
                    FT_SUSPECT=suspect, **env)
    if suspect:
        assert_a_step_apart(saved, int(suspect[2:]))
    params, momentum = simulate_streaming_diloco(n, 8, lost_from, clip)
    for rank, got in saved.items():
        assert launched_ranks_lost(got["recoveries"], n) == sorted(lost_from), got["recoveries"]
        assert_diloco_matches(f"rank {rank}", got, params[rank], momentum)


def simulate_diloco_growing_back(n, steps, victim, kill_step, fragments, delay):
    """DiLoCo (Streaming DiLoCo with several fragments) by its rule, and by
    its rule for growing back: fragment i of `fragments` (layers) has its
    turn after inner step t, (t + 1) % PERIOD == 0 and t // PERIOD % len ==
    i, sent `delay` steps before. Rank `victim` dies in inner step
    `kill_step`, a turn, which no survivor applies (their inner step stands);
    a replacement joins, and every replica goes back to θ and to the step
    after the last turn applied, each survivor's inner optimizer as it is,
    the replacement's the new rank 0's; it trains on the victim's data. Returns
    every rank's parameters and the outer momentum."""
    period = train_ft.PERIOD
    models, inner = inner_models(n)
    theta = train_ft.make_model()
    outer = torch.optim.SGD(theta.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    layer = [i for i, m in enumerate(theta) for _ in m.parameters()]   # each parameter's
    sent = {}

    def fragment(t):
        return t // period % len(fragments)

    def train(t, ranks):
        for r in ranks:
            inner_step(models[r], inner[r], r, t)
        if (t + 1 + delay) % period == 0:
            sent[fragment(t + delay)] = {r: [p.detach().clone() for p in models[r].parameters()]
                                         for r in ranks}
        if (t + 1) % period == 0:
            take_turn(theta, outer, layer, fragments[fragment(t)],
                      list(sent[fragment(t)].values()), [models[r] for r in ranks])

    assert (kill_step + 1) % period == 0, "the kill must be at a turn"
    for t in range(kill_step):
        train(t, range(n))
    for r in range(n):
        if r != victim:
            inner_step(models[r], inner[r], r, kill_step)
    models[victim] = train_ft.make_model()
    inner[victim] = torch.optim.SGD(models[victim].parameters(), lr=0.05, momentum=0.9)
    # Rank 0's, a copy (as share_state's pickle makes): load_state_dict would
    # otherwise keep rank 0's very momentum tensors.
    inner[victim].load_state_dict(copy.deepcopy(inner[min(set(range(n)) - {victim})].state_dict()))
    with torch.no_grad():
        for m in models:
            for p, th in zip(m.parameters(), theta.parameters()):
                p.copy_(th)
    for t in range(kill_step + 1 - period, steps):      # from the step after the last turn
        train(t, range(n))
    return ({r: [p.detach() for p in models[r].parameters()] for r in range(n)},
            [outer.state[p]["momentum_buffer"] for p in theta.parameters()])


# (FT_FRAGMENTS, kill spec, victim, step), 4 ranks, recover(replace=True).
GROWING_CASES = {
    "DiLoCo: a rank lost in backward at a turn": ("", "2:3:backward", 2, 3),
    "Streaming DiLoCo: rank 0 lost at a turn with the allreduce posted": ("1", "0:5:outer", 0, 5),
}


@pytest.mark.parametrize("case", list(GROWING_CASES))
def test_diloco_grows_back_from_theta_at_the_last_turn(tmp_path, case):
    """recover(replace=True) under DiLoCo: the replacement takes θ (set-up),
    the step and the outer optimizer (DiLoCo's own), the inner optimizer
    (share_state); every replica goes back to θ at the step after the last
    turn applied, and the job ends as the simulation of that rule."""
    fragments, kill, victim, kill_step = GROWING_CASES[case]
    saved = run_job(tmp_path, 4, kill, expect=range(4), FT_ALGORITHM="diloco",
                    FT_FRAGMENTS=fragments, FT_REPLACE=1)
    params, momentum = simulate_diloco_growing_back(
        4, 8, victim, kill_step, train_ft.FRAGMENTS if fragments else [[0, 2, 4]],
        1 if fragments else 0)
    assert_grew_back(saved, victim, kill_step + 1 - train_ft.PERIOD)
    for key, got in saved.items():
        assert_diloco_matches(f"stream {key}", got, params[key], momentum)


def simulate_sparseloco_growing_back(n, steps, victim, kill_step, delay, algorithm="sparseloco"):
    """SparseLoCo by its rule (as simulate_sparseloco, every rank alive), and
    by its rule for growing back: rank `victim` dies at the sync after inner
    step `kill_step`, which no survivor applies; the survivors' inner steps
    since the last sync stand in their inner optimizers; a replacement
    joins, and every replica goes back to θ̃, every rank to the step after
    the last sync, each survivor's error feedback to what it was then, the
    replacement's to zero, its inner optimizer the new rank 0's; it trains
    on the victim's data (MuLoCo: the outer momentum stays, rank 0's on the
    replacement). Returns each rank's parameters and error feedback, and
    θ̃."""
    period = train_ft.PERIOD
    assert (kill_step + 1) % period == 0, "the kill must be at a sync"
    models, inner = inner_models(n)
    sim = ef_simulation(algorithm, models[0], n)
    sent = {}

    def restart_from_shared():
        with torch.no_grad():
            for m in models:
                for p, s in zip(m.parameters(), sim.shared):
                    p.copy_(torch.from_numpy(s))

    def train(t):
        for r in range(n):
            inner_step(models[r], inner[r], r, t)
        if (t + 1) % period == (period - delay) % period:
            sent.update({r: as_numpy(models[r]) for r in range(n)})
        if (t + 1) % period == 0:
            sim.round([sent[r] for r in range(n)])
            restart_from_shared()

    resume = kill_step + 1 - period
    for t in range(resume):
        train(t)
    for t in range(resume, kill_step + 1):
        for r in set(range(n)) - {victim}:
            inner_step(models[r], inner[r], r, t)
    models[victim] = train_ft.make_model()
    inner[victim] = torch.optim.SGD(models[victim].parameters(), lr=0.05, momentum=0.9)
    inner[victim].load_state_dict(copy.deepcopy(inner[min(set(range(n)) - {victim})].state_dict()))
    sim.error[victim] = [np.zeros_like(e) for e in sim.error[victim]]
    restart_from_shared()
    for t in range(resume, steps):
        train(t)
    return {r: as_numpy(models[r]) for r in range(n)}, dict(enumerate(sim.error)), sim.shared


# (FT_SYNC_DELAY, kill spec, victim, step), 4 ranks, recover(replace=True).
SPARSELOCO_GROWING_CASES = {
    "sync_delay: rank 0 lost at a turn, its payload sent a step before": (1, "0:5:outer", 0, 5),
}


@pytest.mark.parametrize("algorithm", ["sparseloco", "muloco"])
@pytest.mark.parametrize("case", list(SPARSELOCO_GROWING_CASES))
def test_sparseloco_grows_back_from_the_last_sync(tmp_path, case, algorithm):
    """recover(replace=True) under SparseLoCo and MuLoCo: the replacement
    takes θ̃ (set-up), the step (SparseLoCo's own), MuLoCo's outer optimizer
    and the inner optimizer (share_state), its error feedback zero; every
    rank goes back to θ̃ at the last sync, and the job ends as the
    simulation of that rule."""
    delay, kill, victim, kill_step = SPARSELOCO_GROWING_CASES[case]
    saved = run_job(tmp_path, 4, kill, expect=range(4), FT_ALGORITHM=algorithm,
                    FT_SYNC_DELAY=delay, FT_REPLACE=1)
    params, errors, shared = simulate_sparseloco_growing_back(4, 8, victim, kill_step, delay,
                                                              algorithm)
    assert_grew_back(saved, victim, kill_step + 1 - train_ft.PERIOD)
    for key, got in saved.items():
        assert_sparseloco_matches(f"stream {key}", got, saved[0], params[key], errors[key],
                                  shared)


def simulate_demo_growing_back(n, steps, victim, kill_step):
    """DeMo by its rule over every rank, and by its rule for growing back:
    rank `victim` dies in step `kill_step`, which no rank applies; a
    replacement joins and takes the new rank 0's DeMo state (momenta and
    step count: the loop shares the optimizer's state_dict), and the step
    is done again by all, the replacement on the victim's data. Returns the
    parameters and each rank's momentum."""
    model = train_ft.make_model()
    params = as_numpy(model)
    sim = DeMoSim(params, n, topk=3, chunk=train_ft.EF_CHUNK, decay=train_ft.DEMO_DECAY)
    for t in range(steps):
        if t == kill_step:
            sim.delta[victim] = copy.deepcopy(sim.delta[min(set(range(n)) - {victim})])
        grads = []
        for r in range(n):
            with torch.no_grad():
                for p, v in zip(model.parameters(), params):
                    p.copy_(torch.from_numpy(v))
            gradient(model, r, t, None)
            grads.append([p.grad.double().numpy() for p in model.parameters()])
        params = sim.step(params, grads, train_ft.DEMO_LR)
    return params, dict(enumerate(sim.delta))


# (kill spec, victim, step), 4 ranks, recover(replace=True).
DEMO_GROWING_CASES = {
    "a rank lost with the allgather in flight": ("1:3:outer", 1, 3),
}


@pytest.mark.parametrize("case", list(DEMO_GROWING_CASES))
def test_demo_grows_back_with_the_step_redone_by_all(tmp_path, case):
    """recover(replace=True) under DeMo: the replacement takes the
    parameters and step count (DeMo's set-up) and rank 0's momenta (the
    loop's share_state); the step cut short is done again by all four."""
    kill, victim, kill_step = DEMO_GROWING_CASES[case]
    saved = run_job(tmp_path, 4, kill, expect=range(4), FT_ALGORITHM="demo", FT_REPLACE=1)
    params, deltas = simulate_demo_growing_back(4, 8, victim, kill_step)
    assert_grew_back(saved, victim, kill_step)
    for key, got in saved.items():
        for a, b in zip(got["params"], saved[0]["params"]):
            assert torch.equal(a, b), f"stream {key}'s parameters differ from stream 0's"
        for a, b in zip(got["params"], params):
            np.testing.assert_allclose(a.double().numpy(), b, **TOL, err_msg="parameters")
        for a, b in zip(got["momentum"], deltas[key]):
            np.testing.assert_allclose(a.double().numpy(), b, rtol=1e-4, atol=1e-6,
                                       err_msg=f"stream {key}'s momentum")


def own_theta_sync(sim, models, order, t):
    """Sync t // PERIOD over the replicas of the streams in `order` (the
    communicator's ranks, in its order): each restarts from its new θ."""
    theta = sim.round([as_numpy(models[r]) for r in order], t // train_ft.PERIOD)
    with torch.no_grad():
        for r, th in zip(order, theta):
            for p, v in zip(models[r].parameters(), th):
                p.copy_(torch.from_numpy(v))


class FragmentTurns:
    """An own-θ simulation per fragment (train_ft's FT_FRAGMENTS: the
    parameters of its FRAGMENTS' layers), sync k being fragment k % n's
    turn; the rest of each replica goes on as it is."""

    def __init__(self, make, init, n):
        model = train_ft.make_model()
        index = {id(p): i for i, p in enumerate(model.parameters())}
        self.ids = [[index[id(p)] for layer in f for p in model[layer].parameters()]
                    for f in train_ft.FRAGMENTS]
        self.sims = [make([init[i] for i in f], n) for f in self.ids]

    def round(self, replicas, number):
        f = number % len(self.ids)
        theta = self.sims[f].round([[x[i] for i in self.ids[f]] for x in replicas], number)
        out = [list(x) for x in replicas]
        for r, mine in enumerate(theta):
            for k, i in enumerate(self.ids[f]):
                out[r][i] = mine[k]
        return out

    def drop(self, rank: int) -> None:
        for sim in self.sims:
            sim.drop(rank)

    @property
    def buf(self):
        """Each rank's outer momentum, in the model's parameter order."""
        ranks = len(self.sims[0].buf)
        out = [[None] * sum(map(len, self.ids)) for _ in range(ranks)]
        for f, sim in zip(self.ids, self.sims):
            for r in range(ranks):
                for k, i in enumerate(f):
                    out[r][i] = sim.buf[r][k]
        return out


def eager_sim(init, n):
    return EagerDiLoCoSim(init, n, lr=0.7, momentum=0.9, nesterov=True)


# The simulations of the algorithms whose θ is each rank's own, by train_ft's name.
OWN_THETA_SIMS = {
    "noloco": lambda init, n: NoLoCoSim(init, n, **train_ft.NOLOCO_OUTER),
    "eager": eager_sim,
    "eager fragments": lambda init, n: FragmentTurns(eager_sim, init, n),
}


def simulate_noloco(n, steps, lost_from, clip=None, algorithm="noloco"):
    """NoLoCo (or eager DiLoCo) by its rule over the survivors: each rank's
    inner steps on its own stream; at the sync after inner step t, (t + 1)
    % PERIOD == 0, the ranks alive then (in launched order, as the shrunk
    communicator numbers them) draw that sync's groups, and each steps its
    own θ; a rank lost before a sync leaves with its θ and outer momentum
    (eager DiLoCo: and its outer gradient, the last round's mean taken
    again over the survivors). Returns {launched rank: (parameters, outer
    momentum)}."""
    models, inner = inner_models(n)
    sim = OWN_THETA_SIMS[algorithm](as_numpy(models[0]), n)
    alive = list(range(n))
    for t in range(steps):
        for r in alive:
            if t < lost_from.get(r, steps):
                inner_step(models[r], inner[r], r, t, clip)
        if (t + 1) % train_ft.PERIOD == 0:
            for r in [r for r in alive if lost_from.get(r, steps) <= t]:
                sim.drop(alive.index(r))
                alive.remove(r)
            own_theta_sync(sim, models, alive, t)
    return {r: (as_numpy(models[r]), sim.buf[i]) for i, r in enumerate(alive)}


def assert_noloco_matches(saved, expected):
    for key, got in saved.items():
        params, momentum = expected[key]
        for a, b in zip(got["params"], params):
            np.testing.assert_allclose(a.double().numpy(), b, **TOL,
                                       err_msg=f"stream {key}'s parameters")
        for a, b in zip(got["momentum"], momentum):
            np.testing.assert_allclose(a.double().numpy(), b, **TOL,
                                       err_msg=f"stream {key}'s outer momentum")


# (kill spec, {victim: the first step whose sync goes without it}, FT_HABITS), 4 ranks.
NOLOCO_CASES = {
    "a rank lost between syncs, then rank 0 with its exchange posted":
        ("1:2:backward;0:5:outer", {1: 2, 0: 5}, False),
    "habits: two ranks lost at once at a sync step": ("0,3:3:step", {0: 3, 3: 3}, True),
    "a rank lost in backward, then another in the survivors' agreement":
        ("3:3:backward;1:3:agreement", {3: 3, 1: 3}, False),
}


@pytest.mark.parametrize("case", list(NOLOCO_CASES))
def test_noloco_survivors_match_the_simulation(tmp_path, case):
    kill, lost_from, on = NOLOCO_CASES[case]
    env, clip = habits(on)
    saved = run_job(tmp_path, 4, kill, FT_ALGORITHM="noloco", **env)
    for key, got in saved.items():
        assert launched_ranks_lost(got["recoveries"], 4) == sorted(lost_from), got["recoveries"]
    assert_noloco_matches(saved, simulate_noloco(4, 8, lost_from, clip))


def simulate_noloco_growing_back(n, steps, victim, kill_step, algorithm="noloco"):
    """NoLoCo by its rule for growing back: rank `victim` dies at the sync
    after inner step `kill_step`, which no survivor applies; the survivors'
    inner steps since the last sync stand in their inner optimizers; a
    replacement joins as the last rank, trains on the victim's data from
    rank 0's θ, outer momentum and inner optimizer; every survivor goes back
    to its own θ at the step after the last sync."""
    period = train_ft.PERIOD
    assert (kill_step + 1) % period == 0, "the kill must be at a sync"
    models, inner = inner_models(n)
    sim = OWN_THETA_SIMS[algorithm](as_numpy(models[0]), n)
    order = list(range(n))
    resume = kill_step + 1 - period
    for t in range(resume):
        for r in order:
            inner_step(models[r], inner[r], r, t)
        if (t + 1) % period == 0:
            own_theta_sync(sim, models, order, t)
    for t in range(resume, kill_step + 1):
        for r in set(order) - {victim}:
            inner_step(models[r], inner[r], r, t)
    sim.drop(order.index(victim))
    order.remove(victim)
    order.append(victim)
    sim.join()
    models[victim] = train_ft.make_model()
    inner[victim] = torch.optim.SGD(models[victim].parameters(), lr=0.05, momentum=0.9)
    inner[victim].load_state_dict(copy.deepcopy(inner[order[0]].state_dict()))
    with torch.no_grad():
        for r, th in zip(order, sim.theta):
            for p, v in zip(models[r].parameters(), th):
                p.copy_(torch.from_numpy(v))
    for t in range(resume, steps):
        for r in order:
            inner_step(models[r], inner[r], r, t)
        if (t + 1) % period == 0:
            own_theta_sync(sim, models, order, t)
    return {r: (as_numpy(models[r]), sim.buf[i]) for i, r in enumerate(order)}


def test_noloco_grows_back_with_each_survivor_keeping_its_weights(tmp_path):
    """recover(replace=True) under NoLoCo: rank 0 lost with its exchange
    posted at the sync after step 5; the replacement takes rank 0's θ
    (set-up), the step and outer optimizer (NoLoCo's own) and the inner
    optimizer (share_state); each survivor goes back to its own θ at the
    step after the last sync, and the four draw pairs again."""
    saved = run_job(tmp_path, 4, "0:5:outer", expect=range(4), FT_ALGORITHM="noloco",
                    FT_REPLACE=1)
    assert_grew_back(saved, 0, 5 + 1 - train_ft.PERIOD)
    assert_noloco_matches(saved, simulate_noloco_growing_back(4, 8, 0, 5))


# (kill spec, {victim: the first step whose sync goes without it}, FT_HABITS), 4 ranks.
EAGER_CASES = {
    "a rank lost in an inner phase, the all-reduce in flight; then rank 0 before its wait":
        ("1:2:backward;0:5:outer", {1: 2, 0: 5}, False),
    "habits: two ranks lost at once at a sync step": ("0,3:3:step", {0: 3, 3: 3}, True),
    "rank 0 lost at a sync, then rank 3 before the survivors' redo of it":
        ("0:3:step;3:4:forward", {0: 3, 3: 3}, False),
    "a rank lost between steps, then another in the survivors' agreement":
        ("2:4:between;1:5:agreement", {2: 5, 1: 5}, False),
    "fragments: a rank lost with a fragment's all-reduce in flight, another at the next turn":
        ("1:2:backward;3:5:step", {1: 2, 3: 5}, False, True),
}


@pytest.mark.parametrize("case", list(EAGER_CASES))
def test_eager_diloco_survivors_match_the_simulation(tmp_path, case):
    kill, lost_from, on, fragments = EAGER_CASES[case] + (False,) * (4 - len(EAGER_CASES[case]))
    env, clip = habits(on)
    if fragments:
        env["FT_FRAGMENTS"] = 1
    saved = run_job(tmp_path, 4, kill, FT_ALGORITHM="eager", **env)
    for key, got in saved.items():
        assert launched_ranks_lost(got["recoveries"], 4) == sorted(lost_from), got["recoveries"]
    assert_noloco_matches(saved, simulate_noloco(4, 8, lost_from, clip,
                                                 "eager fragments" if fragments else "eager"))


def test_eager_diloco_grows_back_with_each_survivor_keeping_its_weights(tmp_path):
    """recover(replace=True) under EagerDiLoCo: rank 0 lost before its sync
    after step 5 waits for the last round's all-reduce; the replacement
    takes rank 0's θ (set-up), the step and outer optimizer, no outer
    gradient of its own; each survivor keeps its θ and outer gradient, the
    last round's mean is taken over the survivors, and all four go back to
    the step after the last sync."""
    saved = run_job(tmp_path, 4, "0:5:outer", expect=range(4), FT_ALGORITHM="eager",
                    FT_REPLACE=1)
    assert_grew_back(saved, 0, 5 + 1 - train_ft.PERIOD)
    assert_noloco_matches(saved, simulate_noloco_growing_back(4, 8, 0, 5, "eager"))


def desloc_simulation(n):
    return DESLOCSim(train_ft.make_model(), n,
                     lambda params: torch.optim.Adam(params, lr=train_ft.DESLOC_LR),
                     *train_ft.DESLOC_PERIODS)


def desloc_step(sim, ranks, streams, t, clip=None):
    """Step t of the replicas `ranks` (positions in the simulation), each on
    its data stream, then the averages due over them."""
    for r in ranks:
        gradient(sim.replicas[r], streams[r], t, clip)
        sim.optims[r].step()
    sim.steps += 1
    sim.average(ranks)


def simulate_desloc(n, steps, lost_from, clip=None):
    """DES-LOC by its rule over the survivors: every replica steps with its
    own Adam on its own stream; after step t the ranks alive then (rank r
    before lost_from[r]) average what is due. Returns {launched rank:
    (parameters, first moments)}."""
    sim = desloc_simulation(n)
    for t in range(steps):
        desloc_step(sim, [r for r in range(n) if t < lost_from.get(r, steps)], range(n), t,
                    clip)
    return {r: ([p.detach().double().numpy() for p in sim.replicas[r].parameters()],
                [sim.optims[r].state[p]["exp_avg"] for p in sim.replicas[r].parameters()])
            for r in range(n) if r not in lost_from}


def simulate_desloc_growing_back(n, steps, victim, kill_step):
    """DES-LOC by its rule for growing back: rank `victim` dies before its
    step `kill_step`; the survivors take that step, and the average after
    it is done by them and a replacement (the last rank, on the victim's
    stream) that starts from rank 0's replica and Adam state as they were
    after that step."""
    sim = desloc_simulation(n)
    for t in range(kill_step):
        desloc_step(sim, range(n), range(n), t)
    order = [r for r in range(n) if r != victim]
    for r in order:
        gradient(sim.replicas[r], r, kill_step, None)
        sim.optims[r].step()
    sim.drop(victim)
    sim.join()
    sim.steps += 1
    streams = order + [victim]
    sim.average(range(n))
    for t in range(kill_step + 1, steps):
        desloc_step(sim, range(n), streams, t)
    return {s: ([p.detach().double().numpy() for p in sim.replicas[i].parameters()],
                [sim.optims[i].state[p]["exp_avg"] for p in sim.replicas[i].parameters()])
            for i, s in enumerate(streams)}


# (kill spec, {victim: the first step it does not take}, FT_HABITS), 4 ranks.
DESLOC_CASES = {
    "a rank lost in backward between averages, then rank 0 before its step":
        ("1:2:backward;0:5:step", {1: 2, 0: 5}, False),
    "habits: two ranks lost at once before an average": ("0,3:3:step", {0: 3, 3: 3}, True),
    "a rank lost in backward, then another in the survivors' agreement":
        ("3:3:backward;1:3:agreement", {3: 3, 1: 3}, False),
}


@pytest.mark.parametrize("case", list(DESLOC_CASES))
def test_desloc_survivors_match_the_simulation(tmp_path, case):
    kill, lost_from, on = DESLOC_CASES[case]
    env, clip = habits(on)
    saved = run_job(tmp_path, 4, kill, FT_ALGORITHM="desloc", **env)
    for key, got in saved.items():
        assert launched_ranks_lost(got["recoveries"], 4) == sorted(lost_from), got["recoveries"]
    assert_noloco_matches(saved, simulate_desloc(4, 8, lost_from, clip))


def test_desloc_grows_back_with_a_copy_of_rank_0(tmp_path):
    """recover(replace=True) under DES-LOC: rank 0 lost before its step 3
    (the average after it due); each survivor keeps its replica and Adam
    state, the replacement takes rank 0's (set-up, share_state), and all
    four take that average."""
    saved = run_job(tmp_path, 4, "0:3:step", expect=range(4), FT_ALGORITHM="desloc",
                    FT_REPLACE=1)
    assert_grew_back(saved, 0, 4)
    assert_noloco_matches(saved, simulate_desloc_growing_back(4, 8, 0, 3))

