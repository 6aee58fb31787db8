"""DiLoCo with eager outer updates against a float64 simulation of every
replica (eager_reference's EagerDiLoCoSim), at 1-4 ranks: each rank's inner
steps take gradients of its own; after every sync each rank's parameters
must equal its simulated θ_r (the last round's mean plus its own fresh
outer gradient over R). Also: the bfloat16 wire, AMP's GradScaler, a
layer frozen mid-training, with_bagua's switches to it and back, a
checkpoint resuming exactly and at another number of ranks, settings that
differ across ranks, bad arguments."""

import numpy as np
import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE
from eager_reference import EagerDiLoCoSim
from mpidp import MPI
from test_diloco import node_sizes, node_workers
from test_noloco import (assert_node_rounds_match,
                         assert_own_theta_resumes_at_another_rank_count, assert_rounds_match)
from test_sparseloco import assert_checkpoint_resumes_exactly, build, grads_for, inner_step

pytestmark = pytest.mark.ranks3

DILOCO = dict(lr=0.7, momentum=0.9, nesterov=True)     # DiLoCo's outer SGD

CASES = {
    "DiLoCo's outer SGD": dict(),
    "heavy ball, bfloat16 wire": dict(outer=dict(lr=0.5, momentum=0.5, nesterov=False),
                                      wire_dtype=torch.bfloat16),
}


def eager(model, inner, settings, comm=None):
    s = dict(settings)
    outer = torch.optim.SGD(model.parameters(), **s.pop("outer", DILOCO))
    return mpidp.EagerDiLoCo(model, inner, outer, 3, comm, **s)


def sim_for(model, settings, ranks=SIZE):
    outer = dict(dict(settings).get("outer", DILOCO))
    return EagerDiLoCoSim([p.detach().double().numpy() for p in model.parameters()], ranks,
                          **outer)


def tolerance(settings):
    # bfloat16 rounds each Δ's sum to 8 bits; it enters θ through Ḡ.
    return (dict(rtol=2e-2, atol=2e-3) if settings.get("wire_dtype") is torch.bfloat16
            else dict(rtol=2e-5, atol=2e-6))


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_simulation(case):
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sim = sim_for(model, CASES[case])
    with eager(model, opt, CASES[case]):
        assert_rounds_match(model, opt, sim, 4, case, tol=tolerance(CASES[case]))


@pytest.mark.skipif(SIZE < 2, reason="the replicas differ only with other ranks")
def test_each_rank_steps_with_its_own_fresh_outer_gradient():
    """After the second sync every rank's θ differs from the others' (each
    took its own Δ at 1/R), though all share the first round's mean."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with eager(model, opt, {}):
        for s in range(6):
            inner_step(model, opt, s)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = MPI.COMM_WORLD.allgather(flat)
    assert all(not torch.equal(every[0], other) for other in every[1:])


@pytest.mark.parametrize("per_node", node_sizes())
def test_nodes_as_workers_match_the_simulated_node_replicas(per_node):
    """Eager DiLoCo's workers as emulated nodes of per_node ranks:
    node-local DataParallel averages the node's gradients every step, the
    eager syncs run over one rank per node. Against the simulation with one
    replica per node, whose inner steps take the mean of its ranks'
    gradients (inner SGD: its replica is the mean of theirs)."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with node_workers(per_node, model) as (nodes, mine, cross), \
            eager(model, opt, {}, comm=cross):
        assert_node_rounds_match(model, opt, sim_for(model, {}, ranks=nodes), per_node, mine)


def test_fragments_take_turns_each_with_rounds_of_its_own():
    """Streaming DiLoCo's fragments with eager updates: two fragments,
    sync_every 4, so a turn every 2 steps, alternating. At its turn a
    fragment steps each rank's θ by the eager rule over its own rounds (its
    Δ, its mean) and the replica restarts from it; the other fragment's
    weights go on training. Against one simulation per fragment, every
    rank's replica tracked in float64 at every step."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    ids = [[0, 1], [2, 3]]          # the fragments' parameters
    sims = [EagerDiLoCoSim([params[i].detach().double().numpy() for i in f], SIZE, **DILOCO)
            for f in ids]
    replicas = [[p.detach().double().numpy() for p in params] for _ in range(SIZE)]
    with mpidp.EagerDiLoCo(model, opt, torch.optim.SGD(params, **DILOCO), 4,
                           model_fragments=[model[0], model[1]]):
        for s in range(12):
            for r in range(SIZE):
                for i, g in enumerate(grads_for(model, r, s)):
                    replicas[r][i] = replicas[r][i] - 0.1 * g.double().numpy()
            inner_step(model, opt, s)
            if (s + 1) % 2 == 0:
                f = ((s + 1) // 2 - 1) % 2     # the turns: fragment 0, 1, 0, ...
                theta = sims[f].round([[rep[i] for i in ids[f]] for rep in replicas])
                for r in range(SIZE):
                    for k, i in enumerate(ids[f]):
                        replicas[r][i] = theta[r][k].copy()
            for i, p in enumerate(params):
                np.testing.assert_allclose(p.detach().double().numpy(), replicas[RANK][i],
                                           rtol=2e-5, atol=2e-6,
                                           err_msg=f"step {s}, parameter {i}, rank {RANK}")


def test_grad_scaler_gives_the_same_rounds():
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sim = sim_for(model, {})
    with eager(model, opt, {}):
        assert_rounds_match(model, opt, sim, 3, "GradScaler", scaler=scaler)


def test_a_layer_frozen_mid_training_stays_where_it_is():
    """l1.requires_grad_(False) after two syncs: its θ_r and outer momentum
    stay on every rank while the other layers go on matching the
    simulation."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), **DILOCO)
    sim = sim_for(model, {})
    frozen_ids = {id(p) for p in model.l1.parameters()}
    skip = tuple(i for i, p in enumerate(model.parameters()) if id(p) in frozen_ids)
    with mpidp.EagerDiLoCo(model, opt, outer, 3):
        assert_rounds_match(model, opt, sim, 2, "before the freeze")
        model.l1.requires_grad_(False)
        frozen = [p.detach().clone() for p in model.l1.parameters()]
        momenta = [outer.state[p]["momentum_buffer"].clone() for p in model.l1.parameters()]
        sim.frozen = set(skip)
        assert_rounds_match(model, opt, sim, 2, "l1 frozen", first_step=6, first_sync=2,
                            skip=skip)
    for p, was, m in zip(model.l1.parameters(), frozen, momenta):
        assert torch.equal(p.detach(), was)
        assert torch.equal(outer.state[p]["momentum_buffer"], m)


def test_with_bagua_switches_to_it_and_back():
    """Bagua's interface: two steps of averaged gradients, then
    EagerDiLoCoAlgorithm from the replicas' common weights for two syncs,
    then averaged gradients again from rank 0's replica (a switch gives
    every rank rank 0's; the last round's all-reduce is completed and
    dropped)."""
    model = build()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    net = mpidp.with_bagua(model, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
    for s in range(2):
        inner_step(model, opt, s)
    sim = sim_for(model, {})
    net = mpidp.with_bagua(net, [opt], mpidp.algorithms.EagerDiLoCoAlgorithm(
        torch.optim.SGD(params, **DILOCO), 3))
    assert_rounds_match(model, opt, sim, 2, "EagerDiLoCoAlgorithm", first_step=2)
    net = mpidp.with_bagua(net, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
    inner_step(model, opt, 8)
    mean = [sum(grads_for(model, r, 8)[i].double().numpy() for r in range(SIZE)) / SIZE
            for i in range(len(params))]
    for p, t, g in zip(params, sim.theta[0], mean):
        np.testing.assert_allclose(p.detach().double().numpy(), t - 0.1 * g, rtol=2e-5,
                                   atol=2e-6, err_msg="averaged gradients after EagerDiLoCo")


@pytest.mark.parametrize("saved_after", [3, 4], ids=["at a sync", "inside an interval"])
def test_checkpoint_resumes_exactly(saved_after):
    """This rank's θ_r and outer momentum, its last Δ and the last round's
    mean (its all-reduce completed by the save)."""
    def check_saved(state):
        assert state["outer_optimizer"]["state"] and state["eager"][0]["rounds"] == 1
    assert_checkpoint_resumes_exactly(lambda model, opt: eager(model, opt, {}), saved_after, 10,
                                      check_saved)


@pytest.mark.skipif(SIZE < 2, reason="needs a job of another size to resume")
@pytest.mark.parametrize("grow", [True, False], ids=["one rank more", "one rank fewer"])
def test_a_job_resumes_at_another_number_of_ranks(grow):
    """load_shared_state: a new rank takes rank 0's θ (as its θ and
    replica), outer momentum, step and the saved round's mean, with no Δ of
    its own; the simulation gains a copy of rank 0 with a zero Δ (or loses
    the last rank's, the saved mean kept: its all-reduce completed before
    the save)."""
    assert_own_theta_resumes_at_another_rank_count(
        lambda model, opt, comm: eager(model, opt, {}, comm),
        lambda model, n: sim_for(model, {}, n), grow)


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that disagree")
def test_settings_that_differ_across_ranks_are_refused_on_every_rank():
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="wire_dtype"):
        eager(model, opt, dict(wire_dtype=None if RANK == 0 else torch.bfloat16))


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that disagree")
def test_an_outer_lr_that_differs_across_ranks_is_refused_at_the_sync():
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="lr = 0.7 on rank 1"):
        with eager(model, opt, dict(outer=dict(DILOCO, lr=0.7 if RANK else 0.6))):
            for s in range(3):
                inner_step(model, opt, s)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(wire_dtype=torch.int8), ValueError, "wire_dtype"),
    (dict(sync_buffers=1), TypeError, "sync_buffers: expected a bool"),
    (dict(model_fragments=torch.nn.Linear(2, 2)), TypeError, "model_fragments: expected a list"),
    (dict(fragment_sync_delay=1), TypeError, "fragment_sync_delay"),
    (dict(fragment_update_alpha=0.5), TypeError, "fragment_update_alpha"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        mpidp.EagerDiLoCo(model, opt, torch.optim.SGD(model.parameters(), lr=0.7), 3, **kwargs)


def test_a_state_dict_of_plain_diloco_is_refused():
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), **DILOCO)
    with mpidp.DiLoCo(model, opt, outer, 3) as plain:
        state = plain.state_dict()
    with eager(model, opt, {}) as algo:
        with pytest.raises(ValueError, match="not an EagerDiLoCo's state_dict"):
            algo.load_state_dict(state)
