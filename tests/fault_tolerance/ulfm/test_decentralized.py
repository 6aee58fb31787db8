"""Fault-tolerant mode for the decentralized algorithms (Bagua's, and SlowMo's SGP
base), tested by killing
ranks (tests/fault_tolerance/ulfm/train_ft.py): every survivor's replica is
compared with a simulation of the surviving replicas written from the rule
in docs/fault-tolerance.md -- an exchange a rank's death interrupted is
taken by no survivor and done again over the survivors' graph (shift_one
with an odd number of workers: the worker paired with the missing one
keeps its weights); LowPrecisionDecentralizedAlgorithm's copies restart
exact, from every worker's weights, on the survivors' ring.

These run in the fault-tolerance pass (.venv-ft), as test_fault_tolerance.py."""

import copy
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_ft  # noqa: E402
from test_fault_tolerance import emulated_nodes, launched_ranks_lost, run_job  # noqa: E402
from test_low_communication import assert_grew_back, gradient, habits, inner_models  # noqa: E402
from quant_reference import q  # noqa: E402
from mpidp import _C, kernels  # noqa: E402

pytestmark = pytest.mark.serial


def vec(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def put(model, v):
    torch.nn.utils.vector_to_parameters(v.clone(), model.parameters())


def alive_with_gradients(models, t, lost_from, steps, clip):
    """The ranks alive at step t (t < lost_from[r]), each with its gradient
    of step t's batch at its own weights (clipped to norm `clip`, if given)."""
    alive = [r for r in range(len(models)) if t < lost_from.get(r, steps)]
    for r in alive:
        gradient(models[r], r, t, clip)
    return alive


def local_steps(models, inner, t, lost_from, steps, clip):
    """Step t's local step of every rank alive then; those ranks."""
    alive = alive_with_gradients(models, t, lost_from, steps, clip)
    for r in alive:
        inner[r].step()
    return alive


def assert_survivors_match(saved, n, lost_from, models, inner, tol):
    """Every survivor's parameters and momentum are its simulated replica's
    (lost_from None: the ranks lost are checked by the caller)."""
    for rank, got in saved.items():
        if lost_from is not None:
            assert launched_ranks_lost(got["recoveries"], n) == sorted(lost_from), \
                got["recoveries"]
        for a, b in zip(got["params"], models[rank].parameters()):
            torch.testing.assert_close(a, b.detach(), **tol,
                                       msg=lambda m: f"rank {rank}'s parameters: {m}")
        momentum = [inner[rank].state[p]["momentum_buffer"] for p in models[rank].parameters()]
        for a, b in zip(got["momentum"], momentum):
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"rank {rank}'s momentum: {m}")


def simulate_dpsgd(n, steps, lost_from, mode, clip=None):
    """D-PSGD: at step t the ranks alive then (t < lost_from[r]) send their
    weights, take the gradient at them, and step from the average -- over
    all of them, or with this round's shift_one partner among them (the
    partner of the missing worker keeps its own). Returns each replica and
    its momentum."""
    models, inner = inner_models(n)
    for t in range(steps):
        alive = alive_with_gradients(models, t, lost_from, steps, clip)
        sent = {r: vec(models[r]) for r in alive}      # the weights the gradients were taken at
        w = len(alive)
        for i, r in enumerate(alive):
            if mode == "all":
                mixed = sum(sent[a] for a in alive) / w
            else:
                (partner,), _ = _C.graph_peers(_C.GRAPH_SHIFT_ONE, w + w % 2, 1, i, t)
                mixed = sent[r] if partner == w else (sent[r] + sent[alive[partner]]) * 0.5
            with torch.no_grad():
                put(models[r], mixed)
        for r in alive:
            inner[r].step()
    return models, inner


def simulate_dcd(n, steps, lost_from, clip=None, replaced=None):
    """DCD-PSGD on the ring of the ranks alive at step t: after each local
    step, d = x - x^ + (x^_l + x^ + x^_r) / 3 - x^ is quantized (the
    reference quantizer), every copy takes the same decoded bytes and x =
    x^ (codes decoded by the reference path). At the first step of a smaller ring, before its exchange, every
    copy restarts from its owner's weights. replaced=(victim, step): the
    victim dies after that step's backward; the survivors step, and a
    replacement joins last in the ring with the new rank 0's weights and
    momentum (it takes no step of its own there)."""
    models, inner = inner_models(n)
    start = vec(models[0])
    copies = {r: [start.clone(), start.clone(), start.clone()] for r in range(n)}  # l, own, r
    ring = list(range(n))
    for t in range(steps):
        if replaced is not None and t >= replaced[1]:
            victim = replaced[0]
            survivors = [r for r in range(n) if r != victim]
            alive = local_steps(models, inner, t, {victim: t} if t == replaced[1] else {},
                                steps, clip)
            if t == replaced[1]:
                put(models[victim], vec(models[survivors[0]]))
                inner[victim].load_state_dict(copy.deepcopy(inner[survivors[0]].state_dict()))
            alive = survivors + [victim]
        else:
            alive = local_steps(models, inner, t, lost_from, steps, clip)
        w = len(alive)
        if alive != ring:
            ring = alive
            for i, r in enumerate(alive):
                copies[r] = [vec(models[alive[(i - 1) % w]]), vec(models[r]),
                             vec(models[alive[(i + 1) % w]])]
        if w == 1:
            continue
        sent = {}
        for r in alive:
            left, own, right = copies[r]
            sent[r] = q(vec(models[r]) - own + (left + own + right) / 3 - own)
        for i, r in enumerate(alive):
            left, own, right = copies[r]
            for x_hat, owner in ((own, r), (left, alive[(i - 1) % w]),
                                 (right, alive[(i + 1) % w])):
                kernels.dequantize8(x_hat, sent[owner], accumulate=True, path="ref")
            with torch.no_grad():
                put(models[r], own)
    return models, inner


# (algorithm, FT_PEERS, ranks, kill spec, {victim: the first step whose exchange
# goes without it}, FT_HABITS: wrapped twice, AMP, the gradients clipped)
CASES = {
    "all, habits: a rank lost in backward, its exchange in flight, then rank 0 after one":
        ("decentralized", "all", 4, "1:2:backward;0:5:step", {1: 2, 0: 6}, True),
    "shift_one: two ranks lost in one recovery (the second in its agreement)":
        ("decentralized", "shift_one", 4, "2:3:backward;1:3:agreement", {2: 3, 1: 3}),
    "shift_one: three workers after rank 0 between steps":
        ("decentralized", "shift_one", 4, "0:2:between", {0: 3}),
    "shift_one: three workers after a loss with the exchange in flight (its round redone)":
        ("decentralized", "shift_one", 4, "1:4:backward", {1: 4}),
    "low precision: a ring of 3 after a loss, then of 2 after rank 0 between steps":
        ("lowprecision", "", 4, "3:2:backward;0:5:between", {3: 2, 0: 6}),
    "low precision, habits: a rank lost before its step, leaving two":
        ("lowprecision", "", 3, "1:3:step", {1: 3}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decentralized_survivors_match_the_simulation(tmp_path, case):
    algorithm, peers, n, kill, lost_from, with_habits = (CASES[case] + (False,))[:6]
    env, clip = habits(with_habits)
    saved = run_job(tmp_path, n, kill, FT_ALGORITHM=algorithm, FT_PEERS=peers or "all", **env)
    if algorithm == "decentralized":
        models, inner = simulate_dpsgd(n, 8, lost_from, peers, clip)
        tol = dict(rtol=1e-5, atol=1e-6)
    else:
        models, inner = simulate_dcd(n, 8, lost_from, clip)
        tol = dict(rtol=1e-5, atol=1e-5)    # 8-bit codes of near-equal sums
    assert_survivors_match(saved, n, lost_from, models, inner, tol)


def simulate_sgp(n, steps, lost_from, clip=None, joins=None, per_node=1):
    """SlowMo's SGP base over emulated nodes of `per_node` ranks: each node's
    ranks average their gradients (clipped to norm `clip`, if given) and
    step; then the nodes alive gossip by push-sum (the parameters hold x / y;
    uniform mixing over DynamicDirectedExponentialGraph among the nodes'
    first ranks, in the world's order, at round t) and every rank takes its
    node's result; every 2 PERIOD steps the slow step runs on the ranks'
    mean (slowmo_memory_efficient, the default, takes the world mean) and
    they take θ. Where the nodes alive hold different numbers of ranks,
    every rank is a node of its own until the job grows back. At the first
    step of other nodes every push-sum weight becomes 1 and the graph is
    made over them (round kept). joins: {rank: (step, source)}, a
    replacement in rank's place from `step` on, last in the world's order,
    holding rank `source`'s replica and momentum then. Returns each replica
    and its momentum."""
    from mpidp.gossip import DynamicDirectedExponentialGraph
    models, inner = inner_models(n)
    theta = vec(models[0])
    u = torch.zeros_like(theta)
    ring, order, joins, alone = None, list(range(n)), joins or {}, False
    for t in range(steps):
        grew = False
        for r, (at, source) in joins.items():
            if t == at:
                put(models[r], vec(models[source]))
                inner[r].load_state_dict(copy.deepcopy(inner[source].state_dict()))
                order = [q for q in order if q != r] + [r]
                grew = True
        lost = {r: s for r, s in lost_from.items() if t < joins.get(r, (steps,))[0]}
        alive = [r for r in order if t < lost.get(r, steps)]
        nodes, alone = emulated_nodes(alive, per_node, alone, grew)
        for node in nodes:
            grads = []
            for r in node:
                gradient(models[r], r, t, None)
                grads.append([p.grad.clone() for p in models[r].parameters()])
            for r in node:
                for p, g in zip(models[r].parameters(), zip(*grads)):
                    p.grad = sum(g) / len(node)
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(models[r].parameters(), clip)
                inner[r].step()
        masters = [node[0] for node in nodes]
        if masters != ring:
            ring, weight = masters, {r: 1.0 for r in masters}
        w = len(masters)
        sent = {r: torch.cat([vec(models[r]) * weight[r],
                              torch.tensor([weight[r]], dtype=torch.float32)]) * 0.5
                for r in masters}
        for i, node in enumerate(nodes):
            graph = DynamicDirectedExponentialGraph(i, w)
            graph.round = t
            _, inp = graph.worker_peers()
            mixed = sent[node[0]].clone()
            for j in inp:
                mixed += sent[masters[j]]
            weight[node[0]] = float(mixed[-1])
            x = mixed[:-1] / mixed[-1] if mixed[-1] != 1.0 else mixed[:-1]
            for r in node:
                with torch.no_grad():
                    put(models[r], x)
        if (t + 1) % (2 * train_ft.PERIOD) == 0:
            x = sum(vec(models[r]) for r in alive) / len(alive)
            u = u * train_ft.SLOW_MOMENTUM + (theta - x) / 0.05
            theta = theta - train_ft.SLOW_LR * 0.05 * u
            for r in alive:
                with torch.no_grad():
                    put(models[r], theta)
    return models, inner


# (kill spec, {victim: the first step whose gossip goes without it}, FT_HABITS),
# 4 ranks, nodes of 1.
SGP_CASES = {
    "habits (wrapped twice, AMP, clipped): a rank lost in backward, then rank 0 before its "
    "gossip": ("3:2:backward;0:5:sync", {3: 2, 0: 5}, True),
    "a rank lost before a slow step's gossip, then another in the recovery's agreement":
        ("1:3:sync;2:3:agreement", {1: 3, 2: 3}),
}


@pytest.mark.parametrize("case", list(SGP_CASES))
def test_sgp_survivors_match_the_simulation(tmp_path, case):
    kill, lost_from, with_habits = (SGP_CASES[case] + (False,))[:3]
    env, clip = habits(with_habits)
    saved = run_job(tmp_path, 4, kill, FT_ALGORITHM="slowmo", FT_SGP=1, MPIDP_RANKS_PER_NODE=1,
                    **env)
    models, inner = simulate_sgp(4, 8, lost_from, clip)
    tol = dict(rtol=1e-5, atol=1e-6)
    assert_survivors_match(saved, 4, lost_from, models, inner, tol)


def test_sgp_grows_back_from_rank_0s_replica(tmp_path):
    """recover(replace=True) under SlowMo's SGP base, every rank a node,
    rank 1 lost in step 3's backward: the survivors' local step stands and
    the gossip (and slow step) the loss cut short is done again over them
    alone; then the replacement takes rank 0's replica, momentum, θ, u and
    gossip round, the graph is made over the four nodes again (the
    replacement last) and every push-sum weight is 1."""
    saved = run_job(tmp_path, 4, "1:3:backward", expect=range(4), FT_ALGORITHM="slowmo",
                    FT_SGP=1, MPIDP_RANKS_PER_NODE=1, FT_REPLACE=1)
    models, inner = simulate_sgp(4, 8, {1: 3}, joins={1: (4, 0)})
    assert_grew_back(saved, 1, 4)
    assert_survivors_match(saved, 4, None, models, inner, dict(rtol=1e-5, atol=1e-6))


def test_sgp_with_the_programs_own_graph_grows_back_into_the_lost_ranks_node(tmp_path):
    """SGP over nodes of 2 with a graph object the script builds itself (for
    the node it computes from its rank): rank 1 lost in step 3's backward,
    the step is done again by all four -- the replacement, spawned as rank
    3 so that its script builds the graph for node 1, takes rank 1's place
    in node 0 with rank 0's replica and gossips over the survivors' graph
    (the class, built for its node) -- as the simulation of the nodes'
    gossip says."""
    saved = run_job(tmp_path, 4, "1:3:backward", expect=range(4), FT_ALGORITHM="slowmo",
                    FT_SGP=1, FT_SGP_GRAPH=1, MPIDP_RANKS_PER_NODE=2, FT_REPLACE=1)
    models, inner = simulate_sgp(4, 8, {1: 3}, joins={1: (3, 0)}, per_node=2)
    assert_grew_back(saved, 1, 3)
    assert_survivors_match(saved, 4, None, models, inner, dict(rtol=1e-5, atol=1e-6))


def simulate_dpsgd_growing_back(n, steps, victim, kill_step, mode):
    """D-PSGD over every rank (simulate_dpsgd's rule), where rank `victim`
    dies in step `kill_step`'s backward, with that step's exchange posted:
    no rank takes it nor steps; a replacement joins with the new rank 0's
    replica and momentum, and the step is done again by all, the
    replacement on the victim's data, last in the world's order."""
    models, inner = inner_models(n)
    order = list(range(n))
    for t in range(steps):
        if t == kill_step:
            donor = min(set(range(n)) - {victim})
            put(models[victim], vec(models[donor]))
            inner[victim].load_state_dict(copy.deepcopy(inner[donor].state_dict()))
            order = [r for r in range(n) if r != victim] + [victim]
        alive = alive_with_gradients(models, t, {}, steps, None)
        sent = {r: vec(models[r]) for r in alive}
        for i, r in enumerate(order):
            if mode == "all":
                mixed = sum(sent[a] for a in order) / n
            else:
                (partner,), _ = _C.graph_peers(_C.GRAPH_SHIFT_ONE, n, 1, i, t)
                mixed = (sent[r] + sent[order[partner]]) * 0.5
            with torch.no_grad():
                put(models[r], mixed)
        for r in alive:
            inner[r].step()
    return models, inner


@pytest.mark.parametrize("mode", ["all", "shift_one", "low precision"])
def test_decentralized_grows_back_from_rank_0s_replica(tmp_path, mode):
    """recover(replace=True) under DecentralizedAlgorithm: each survivor
    keeps its replica and momentum, the replacement takes rank 0's
    (with_bagua's set-up, run again, and share_state) and the step count;
    the exchange the loss cut short is done again by all four. Low
    precision: the survivors' optimizer step stands, the replacement joins
    the ring with rank 0's weights after it, every copy restarts exact, and
    the exchange is done again."""
    if mode == "low precision":
        saved = run_job(tmp_path, 4, "2:3:step", expect=range(4), FT_ALGORITHM="lowprecision",
                        FT_REPLACE=1)
        models, inner = simulate_dcd(4, 8, {}, replaced=(2, 3))
        tol = dict(rtol=1e-5, atol=1e-5)    # 8-bit codes of near-equal sums
        resumed = 4     # the survivors' step 3 stands; its exchange is redone in recover()
    else:
        saved = run_job(tmp_path, 4, "2:3:backward", expect=range(4),
                        FT_ALGORITHM="decentralized", FT_PEERS=mode, FT_REPLACE=1)
        models, inner = simulate_dpsgd_growing_back(4, 8, 2, 3, mode)
        tol = dict(rtol=1e-5, atol=1e-6)
        resumed = 3
    assert_grew_back(saved, 2, resumed)
    assert_survivors_match(saved, 4, None, models, inner, tol)
