"""NoLoCo against a float64 simulation of every replica (noloco_reference's
NoLoCoSim), at 1-4 ranks: each rank's inner steps take gradients of its own;
after every sync each rank's parameters must equal its simulated θ_r, the
groups drawn alike. Also: replicas of different groups stay apart,
with_bagua's switches to NoLoCo and back, a layer frozen mid-training, a
checkpoint resuming exactly, settings that differ across ranks, bad
arguments."""

import copy

import numpy as np
import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE
from mpidp import MPI
from noloco_reference import NoLoCoSim
from test_diloco import node_means, node_sizes, node_workers
from test_sparseloco import (assert_checkpoint_resumes_exactly, build, grads_for, inner_step,
                             replicas_after)

pytestmark = pytest.mark.ranks3

AUTHORS = dict(lr=0.7, momentum=0.5)       # the authors' outer SGD (their configurations)

CASES = {
    "the authors': pairs": dict(),
    "groups of 3, Nesterov, another seed": dict(group_size=3, seed=5,
                                                outer=dict(lr=0.8, momentum=0.9, nesterov=True)),
}


def noloco(model, inner, settings):
    s = dict(settings)
    outer = torch.optim.SGD(model.parameters(), **s.pop("outer", AUTHORS))
    return mpidp.NoLoCo(model, inner, outer, 3, **s)


def sim_for(model, settings, ranks=SIZE):
    s = dict(settings)
    outer = dict(s.pop("outer", AUTHORS))
    return NoLoCoSim([p.detach().double().numpy() for p in model.parameters()], ranks, **outer,
                     **s)


def replicas_from(theta, model, steps, lr=0.1, skip=()):
    """Every rank's replica after inner SGD steps from its own θ_r (the
    parameters in `skip` without gradients)."""
    return [replicas_after(start, model, steps, lr, skip)[r] for r, start in enumerate(theta)]


def assert_rounds_match(model, opt, sim, syncs, what, first_step=0, first_sync=0, skip=(),
                        scaler=None, tol=None):
    """`syncs` rounds of 3 inner steps from `first_step` (each rank on its
    own gradients, through `scaler` if given), the simulation's round (a
    NoLoCoSim or a sim of its kind: every rank's θ_r) numbered from
    `first_sync` after each, and every rank's parameters its θ_r then."""
    for sync in range(first_sync, first_sync + syncs):
        steps = range(first_step, first_step + 3)
        replicas = replicas_from(sim.theta, model, steps, skip=skip)
        for s in steps:
            inner_step(model, opt, s, skip=skip, scaler=scaler)
        sim.round(replicas, sync)
        assert_at_theta(model, sim, f"{what}, sync {sync}", tol)
        first_step += 3


def assert_node_rounds_match(model, opt, sim, per_node, node, syncs=3):
    """assert_rounds_match for nodes of per_node ranks whose gradients are
    averaged (node_workers): each simulated replica (rank of `sim`) is a
    node's, the mean of its ranks' replicas; this rank's parameters are its
    node's θ after every round."""
    for sync in range(syncs):
        steps = range(3 * sync, 3 * sync + 3)
        replicas = [node_means(replicas_after(theta, model, steps, 0.1), per_node)[n]
                    for n, theta in enumerate(sim.theta)]
        for s in steps:
            inner_step(model, opt, s)
        sim.round(replicas, sync)
        for p, t in zip(model.parameters(), sim.theta[node]):
            np.testing.assert_allclose(p.detach().double().numpy(), t, rtol=2e-5, atol=2e-6,
                                       err_msg=f"nodes of {per_node}, sync {sync}, rank {RANK}")


def assert_at_theta(model, sim, what, tol=None):
    """This rank's parameters are its simulated θ_r."""
    for p, t in zip(model.parameters(), sim.theta[RANK]):
        np.testing.assert_allclose(p.detach().double().numpy(), t,
                                   **(tol or dict(rtol=2e-5, atol=2e-6)),
                                   err_msg=f"{what}, rank {RANK}")


def assert_own_theta_resumes_at_another_rank_count(make, sim_of, grow):
    """A job of N-1 ranks (or N) saves one step into its second interval of
    3; N (or N-1) resume: those with a checkpoint load their own, a new
    rank takes rank 0's (load_shared_state: its θ_r as its θ and replica).
    Two more syncs match the simulation, which gains a copy of rank 0
    (join()) or loses the last rank (leave()). make(model, opt, comm); sim_of(model,
    ranks): a sim with every rank's θ_r (NoLoCoSim and its kind)."""
    world = MPI.COMM_WORLD
    before, after = (SIZE - 1, SIZE) if grow else (SIZE, SIZE - 1)
    sim = sim_of(build(), before)
    mine = None
    comm = world.Split(0 if RANK < before else MPI.UNDEFINED, RANK)
    if comm != MPI.COMM_NULL:
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with make(model, opt, comm) as algo:
            for s in range(4):
                inner_step(model, opt, s)
            mine = copy.deepcopy(algo.state_dict())
        comm.Free()
    sim.round(replicas_from(sim.theta, build(), range(3)), 0)
    shared = world.bcast(mine, root=0)
    if grow:
        sim.join()
    else:
        sim.leave(after)
    replicas = replicas_from(sim.theta, build(), range(3, 6))
    if grow:      # the new rank's replica: from θ_r at the resume, the step it missed not taken
        replicas[-1] = replicas_from(sim.theta, build(), range(4, 6))[after - 1]
    comm = world.Split(0 if RANK < after else MPI.UNDEFINED, RANK)
    if comm == MPI.COMM_NULL:
        return
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with make(model, opt, comm) as algo:
        if mine is not None:
            algo.load_state_dict(mine)
        else:
            algo.load_shared_state(shared)
        for s in range(4, 6):
            inner_step(model, opt, s)
        sim.round(replicas, 1)
        assert_at_theta(model, sim, "the first sync after the resume")
        assert_rounds_match(model, opt, sim, 1, "after the resume", first_step=6, first_sync=2)
    comm.Free()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_simulation(case):
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sim = sim_for(model, CASES[case])
    with noloco(model, opt, CASES[case]):
        assert_rounds_match(model, opt, sim, 4, case)


@pytest.mark.parametrize("per_node", node_sizes())
def test_nodes_as_workers_match_the_simulated_node_replicas(per_node):
    """NoLoCo's workers as emulated nodes of per_node ranks: node-local
    DataParallel averages the node's gradients every step, NoLoCo's groups
    are drawn over one rank per node. Against the simulation with one
    replica per node (inner SGD: its replica is the mean of its ranks')."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), **AUTHORS)
    with node_workers(per_node, model) as (nodes, mine, cross), \
            mpidp.NoLoCo(model, opt, outer, 3, cross):
        assert_node_rounds_match(model, opt, sim_for(model, {}, ranks=nodes), per_node, mine)


@pytest.mark.skipif(SIZE != 4, reason="two groups of two: 4 ranks")
def test_the_groups_replicas_stay_apart():
    """No global mean: with pairs at 4 ranks, each sync's two pairs end on
    different weights, and both members of a pair on the same."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sim = sim_for(model, {})
    with noloco(model, opt, {}):
        for s in range(3):
            inner_step(model, opt, s)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = MPI.COMM_WORLD.allgather(flat)
    pairs = sim.groups(4, 0)
    assert len(pairs) == 2
    for a, b in pairs:
        assert torch.equal(every[a], every[b])
    assert not torch.equal(every[pairs[0][0]], every[pairs[1][0]])


def test_with_bagua_switches_to_it_and_back():
    """Bagua's interface: two steps of averaged gradients, NoLoCoAlgorithm
    from the replicas' common weights for two syncs (its draws numbered from
    the switch), then averaged gradients again from rank 0's replica (a
    switch gives every rank rank 0's)."""
    model = build()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    net = mpidp.with_bagua(model, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
    for s in range(2):
        inner_step(model, opt, s)
    sim = NoLoCoSim([p.detach().double().numpy() for p in params], SIZE, **AUTHORS)
    net = mpidp.with_bagua(net, [opt], mpidp.algorithms.NoLoCoAlgorithm(
        torch.optim.SGD(params, **AUTHORS), 3))
    assert_rounds_match(model, opt, sim, 2, "NoLoCoAlgorithm", first_step=2)
    net = mpidp.with_bagua(net, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
    inner_step(model, opt, 8)
    mean = [sum(grads_for(model, r, 8)[i].double().numpy() for r in range(SIZE)) / SIZE
            for i in range(len(params))]
    for p, t, g in zip(params, sim.theta[0], mean):
        np.testing.assert_allclose(p.detach().double().numpy(), t - 0.1 * g, rtol=2e-5,
                                   atol=2e-6, err_msg="averaged gradients after NoLoCo")


def test_checkpoint_resumes_exactly():
    """Saved after step 4 of syncs every 3: this rank's θ_r and outer momentum."""
    def check_saved(state):
        assert state["outer_optimizer"]["state"]
    assert_checkpoint_resumes_exactly(lambda model, opt: noloco(model, opt, {}), 4, 9,
                                      check_saved)


def test_a_layer_frozen_mid_training_stays_where_it_is():
    """l1.requires_grad_(False) after two syncs: its θ_r and outer momentum
    stay on every rank while the other layers go on matching the simulation
    of the rest (the frozen layer's replica is θ_r, so its group mean leaves
    the other layers' untouched)."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), **AUTHORS)
    sim = sim_for(model, {})
    frozen_ids = {id(p) for p in model.l1.parameters()}
    skip = tuple(i for i, p in enumerate(model.parameters()) if id(p) in frozen_ids)
    with mpidp.NoLoCo(model, opt, outer, 3):
        for s in range(6):
            inner_step(model, opt, s)
        sim.round(replicas_from(sim.theta, model, range(3)), 0)
        sim.round(replicas_from(sim.theta, model, range(3, 6)), 1)
        model.l1.requires_grad_(False)
        frozen = [p.detach().clone() for p in model.l1.parameters()]
        momenta = [outer.state[p]["momentum_buffer"].clone() for p in model.l1.parameters()]
        for s in range(6, 9):
            inner_step(model, opt, s, skip=skip)
        replicas = replicas_from(sim.theta, model, range(6, 9), skip=skip)
        kept = [[t[i].copy() for i in skip] for t in sim.theta]
        kept_buf = [[b[i].copy() for i in skip] for b in sim.buf]
        sim.round(replicas, 2)
    for r in range(SIZE):        # the simulation's frozen layer: no outer step
        for j, i in enumerate(skip):
            sim.theta[r][i], sim.buf[r][i] = kept[r][j], kept_buf[r][j]
    for p, t in zip(model.parameters(), sim.theta[RANK]):
        np.testing.assert_allclose(p.detach().double().numpy(), t, rtol=2e-5, atol=2e-6)
    for p, was, m in zip(model.l1.parameters(), frozen, momenta):
        assert torch.equal(p.detach(), was)
        assert torch.equal(outer.state[p]["momentum_buffer"], m)


@pytest.mark.skipif(SIZE < 2, reason="needs a job of another size to resume")
@pytest.mark.parametrize("grow", [True, False], ids=["one rank more", "one rank fewer"])
def test_a_job_resumes_at_another_number_of_ranks(grow):
    """DiLoCo's load_shared_state: a new rank takes rank 0's θ_r, outer
    momentum and step, its replica at θ_r; the groups are drawn over the
    new size."""
    assert_own_theta_resumes_at_another_rank_count(
        lambda model, opt, comm: mpidp.NoLoCo(
            model, opt, torch.optim.SGD(model.parameters(), **AUTHORS), 3, comm),
        lambda model, n: NoLoCoSim([p.detach().double().numpy() for p in model.parameters()], n,
                                   **AUTHORS), grow)


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that disagree")
def test_settings_that_differ_across_ranks_are_refused_on_every_rank():
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="group_size"):
        noloco(model, opt, dict(group_size=2 if RANK == 0 else 3))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(group_size=1), ValueError, "group_size: expected an int >= 2"),
    (dict(group_size=33), ValueError, r"group_size: expected 2 \.\. 32"),
    (dict(group_size="2"), TypeError, "group_size: expected an int"),
    (dict(seed=-1), ValueError, "seed: expected an int >= 0"),
    (dict(model_fragments=None), TypeError, "model_fragments"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        mpidp.NoLoCo(model, opt, torch.optim.SGD(model.parameters(), lr=0.7), 3, **kwargs)
