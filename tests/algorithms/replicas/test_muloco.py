"""MuLoCo against a float64 simulation of every replica (ef_reference's
MuLoCoSim), at 1-4 ranks: each rank's inner steps take gradients of its own,
and after every sync the parameters must be bitwise equal on every rank and
equal to the simulation's θ̃ within float32 rounding, and each rank's
error-feedback buffer equal to the simulation's buffer of that rank.

Also: torch.optim.Muon beside AdamW as the inner optimizers (the simulation
steps every replica with torch's own optimizers), the dense payload's bytes,
a checkpoint resuming exactly, an outer lr differing by rank, an inner
optimizer stepped twice, bad arguments, with_bagua's switches to MuLoCo and
back."""

import numpy as np
import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE, assert_same_on_all_ranks, differing_setting
from ef_reference import MuLoCoSim
from test_diloco import node_means, node_sizes, node_workers
from test_sparseloco import (assert_a_layer_frozen_mid_training_stays,
                             assert_checkpoint_resumes_exactly,
                             assert_grad_scaler_gives_the_same_rounds,
                             assert_resumes_at_another_rank_count, build, check_against,
                             grads_for, inner_step, replicas_after)

pytestmark = pytest.mark.ranks3

OUTER = dict(lr=0.8, momentum=0.9, nesterov=True)      # the paper's outer SGD

CASES = {
    "paper: every entry in 2-bit codes": dict(chunk_size=8),
    "top_k, float32 values, heavy-ball": dict(top_k=8, chunk_size=8, quantization_bins=None,
                                              outer=dict(lr=0.7, momentum=0.5)),
    "top_k, 2-bit codes": dict(top_k=20, chunk_size=8, error_decay=0.8),
    "dense, delayed": dict(chunk_size=8, sync_delay=2),
}


def outer_sgd(model, outer=None):
    return torch.optim.SGD(model.parameters(), **(outer or OUTER))


def sim_for(model, settings, ranks=SIZE):
    s = dict(settings)
    s.pop("sync_delay", None)
    outer = dict(s.pop("outer", OUTER))
    outer.setdefault("nesterov", False)
    bins = s.pop("quantization_bins", 4)
    return MuLoCoSim([p.detach().double().numpy() for p in model.parameters()], ranks,
                     bins=bins or 0, **outer, **s)


def muloco(model, inner, settings):
    s = dict(settings)
    return mpidp.MuLoCo(model, inner, outer_sgd(model, s.pop("outer", None)), 3, **s)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_simulation(case):
    """With sync_delay d, Δ is taken d steps before the turn and the replica's
    last d steps are dropped at it."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sim = sim_for(model, CASES[case])
    delay = CASES[case].get("sync_delay", 0)
    with muloco(model, opt, CASES[case]) as mu:
        for sync in range(3):
            steps = range(3 * sync, 3 * sync + 3)
            replicas = replicas_after(sim.shared, model, steps[:3 - delay], 0.1)
            for s in steps:
                inner_step(model, opt, s)
            sim.round(replicas)
            check_against(model, mu, sim, f"{case}, sync {sync}")


@pytest.mark.parametrize("per_node", node_sizes())
def test_nodes_as_workers_match_the_simulated_node_replicas(per_node):
    """MuLoCo's workers as emulated nodes of per_node ranks: node-local
    DataParallel averages the node's gradients every step, MuLoCo syncs over
    one rank per node. Against the simulation with one replica per node
    (inner SGD: its replica is the mean of its ranks'), each node's error
    feedback on every rank of it."""
    case = "paper: every entry in 2-bit codes"
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with node_workers(per_node, model) as (nodes, mine, cross), \
            mpidp.MuLoCo(model, opt, outer_sgd(model), 3, cross, **CASES[case]) as mu:
        sim = sim_for(model, CASES[case], ranks=nodes)
        for sync in range(3):
            steps = range(3 * sync, 3 * sync + 3)
            sim.round(node_means(replicas_after(sim.shared, model, steps, 0.1), per_node))
            for s in steps:
                inner_step(model, opt, s)
            for p, t in zip(model.parameters(), sim.shared):
                np.testing.assert_allclose(p.detach().double().numpy(), t, rtol=2e-5, atol=2e-6,
                                           err_msg=f"nodes of {per_node}, sync {sync}")
            for e, t in zip(mu.error, sim.error[mine]):
                np.testing.assert_allclose(e.double().numpy(), t, rtol=2e-5, atol=2e-6,
                                           err_msg=f"nodes of {per_node}, sync {sync}: error "
                                                   f"feedback of rank {RANK}")


class Matrices(torch.nn.Module):
    """Two weight matrices (Muon's) and a bias and a scale (AdamW's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.a = torch.nn.Parameter(torch.randn(16, 8) / 4)
        self.b = torch.nn.Parameter(torch.randn(8, 12) / 4)
        self.bias = torch.nn.Parameter(torch.randn(12))
        self.scale = torch.nn.Parameter(torch.tensor(1.5))


def muon_and_adamw(model):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=0.05, weight_decay=0.0),
            torch.optim.AdamW(rest, lr=0.01)]


def step_all(model, inners, rank, step):
    for opt in inners:
        opt.zero_grad()
    loss = sum((p * g).sum() for p, g in zip(model.parameters(), grads_for(model, rank, step)))
    loss.backward()
    for opt in inners:
        opt.step()


def test_muon_and_adamw_as_the_inner_optimizers():
    """The paper's inner optimizers: the round runs once both stepped. The
    simulation steps a replica per rank with torch's Muon and AdamW of its
    own, from θ̃ at every sync."""
    model = Matrices()
    inners = muon_and_adamw(model)
    sim = MuLoCoSim([p.detach().double().numpy() for p in model.parameters()], SIZE, chunk_size=8)
    replicas = [Matrices() for _ in range(SIZE)]
    replica_inners = [muon_and_adamw(m) for m in replicas]
    with mpidp.MuLoCo(model, inners, outer_sgd(model), 3, chunk_size=8) as mu:
        for sync in range(3):
            for r, m in enumerate(replicas):
                with torch.no_grad():
                    for p, t in zip(m.parameters(), sim.shared):
                        p.copy_(torch.as_tensor(t, dtype=torch.float32))
                for s in range(3 * sync, 3 * sync + 3):
                    step_all(m, replica_inners[r], r, s)
            for s in range(3 * sync, 3 * sync + 3):
                step_all(model, inners, RANK, s)
            sim.round([[p.detach().double().numpy() for p in m.parameters()] for m in replicas])
            check_against(model, mu, sim, f"sync {sync}")


def test_an_inner_optimizer_stepped_twice_in_one_step_is_refused():
    model = Matrices()
    inners = muon_and_adamw(model)
    with mpidp.MuLoCo(model, inners, outer_sgd(model), 3, chunk_size=8):
        step_all(model, inners, RANK, 0)
        inners[0].step()
        with pytest.raises(RuntimeError, match=r"inner_optimizer\[0\] stepped again before "
                                               r"inner_optimizer\[1\] stepped"):
            inners[0].step()


def test_with_bagua_switches_to_it_and_back():
    """Bagua's interface, two inner optimizers (each holding half the
    parameters, as Muon beside AdamW would): two steps of averaged gradients,
    then MuLoCoAlgorithm from the replicas' common weights for two syncs
    (matching the simulation, whose error feedback starts at zero), then
    averaged gradients again from θ̃."""
    model = build()
    params = list(model.parameters())
    inners = [torch.optim.SGD(params[:1], lr=0.1), torch.optim.SGD(params[1:], lr=0.1)]

    def step(s):
        for opt in inners:
            opt.zero_grad()
        sum((p * g).sum() for p, g in zip(params, grads_for(model, RANK, s))).backward()
        for opt in inners:
            opt.step()

    def mean_step(shared, s):
        g = [sum(grads_for(model, r, s)[i].double().numpy() for r in range(SIZE)) / SIZE
             for i in range(len(params))]
        return [t - 0.1 * gi for t, gi in zip(shared, g)]

    def check(want, what):
        assert_same_on_all_ranks(model)
        for p, t in zip(params, want):
            np.testing.assert_allclose(p.detach().double().numpy(), t, rtol=2e-5, atol=2e-6,
                                       err_msg=what)

    net = mpidp.with_bagua(model, inners, mpidp.algorithms.GradientAllReduceAlgorithm())
    want = [p.detach().double().numpy() for p in params]
    for s in range(2):
        step(s)
        want = mean_step(want, s)
    check(want, "averaged gradients")
    settings = dict(chunk_size=8)
    sim = sim_for(model, settings)
    net = mpidp.with_bagua(net, inners, mpidp.algorithms.MuLoCoAlgorithm(outer_sgd(model), 3,
                                                                          **settings))
    for sync in range(2):
        steps = range(2 + 3 * sync, 5 + 3 * sync)
        replicas = replicas_after(sim.shared, model, steps, 0.1)
        for s in steps:
            step(s)
        sim.round(replicas)
        check(sim.shared, f"MuLoCo, sync {sync}")
    assert net.bagua_state_dict()["step"] == 6
    net = mpidp.with_bagua(net, inners, mpidp.algorithms.GradientAllReduceAlgorithm())
    step(8)
    check(mean_step(sim.shared, 8), "averaged gradients after MuLoCo")


def test_bytes_sent_are_two_bits_an_entry():
    """Dense 2-bit payloads carry no slots: per tensor μ, 4 lookup values and
    the codes."""
    model = build()
    mu = muloco(model, torch.optim.SGD(model.parameters(), lr=0.1), dict(chunk_size=8))
    payload = sum(4 * 5 + (p.numel() * 2 + 7) // 8 for p in model.parameters())
    assert mu.bytes_sent == 24 + payload
    top = muloco(model, torch.optim.SGD(model.parameters(), lr=0.1),
                 dict(chunk_size=8, top_k=8, quantization_bins=None))
    assert top.bytes_sent < 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("delay", [0, 1])
def test_checkpoint_resumes_exactly(delay):
    """Saved after step 4 of syncs every 3 (the outer momentum holds a sync),
    with sync_delay 1 a sync in flight."""
    def check_saved(state):
        assert (state["in_flight"] is not None) == (delay == 1)
        assert state["outer_optimizer"]["state"]
    assert_checkpoint_resumes_exactly(
        lambda model, opt: muloco(model, opt, dict(chunk_size=8, sync_delay=delay)), 5, 9,
        check_saved)


@pytest.mark.skipif(SIZE < 2, reason="needs a job of another size to resume")
@pytest.mark.parametrize("grow", [True, False], ids=["one rank more", "one rank fewer"])
def test_resumes_at_another_rank_count(grow):
    """SparseLoCo's rule; the outer optimizer's momentum goes on from the
    saved state on every rank, the new one too."""
    settings = dict(chunk_size=8)
    assert_resumes_at_another_rank_count(
        lambda model, opt, comm: mpidp.MuLoCo(model, opt, outer_sgd(model), 3, comm, **settings),
        lambda model, n: sim_for(model, settings, n), grow)


def test_grad_scaler_gives_the_same_rounds():
    """AMP's GradScaler around the inner steps (its unscaled gradients are
    what the simulation's replicas take)."""
    settings = dict(chunk_size=8)
    assert_grad_scaler_gives_the_same_rounds(
        lambda model, opt, every: mpidp.MuLoCo(model, opt, outer_sgd(model), every, **settings),
        lambda model: sim_for(model, settings))


def test_a_layer_frozen_mid_training_stays_where_it_is():
    """layer.requires_grad_(False) after a sync: no outer step for it (θ̃,
    its outer momentum and error buffer stay) and the rest follows the
    simulation; frozen on one rank only, every rank raises at the next
    sync."""
    settings = dict(top_k=20, chunk_size=8)
    assert_a_layer_frozen_mid_training_stays(lambda model, opt: muloco(model, opt, settings),
                                             lambda model: sim_for(model, settings))


def test_an_outer_lr_differing_by_rank_is_refused():
    if SIZE == 1:
        pytest.skip("needs two ranks to differ")
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with muloco(model, opt, dict(chunk_size=8)) as mu:
        if RANK == SIZE - 1:
            mu.outer_optimizer.param_groups[0]["lr"] = 0.5
        with pytest.raises(RuntimeError,
                           match=differing_setting("MuLoCo", "param group 0: lr", 0.5, 0.8)):
            for s in range(3):
                inner_step(model, opt, s)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(top_k=0), ValueError, "top_k"),
    (dict(quantization_bins=1), ValueError, "quantization_bins"),
    (dict(error_decay=1.5), ValueError, "error_decay"),
    (dict(sync_delay=3), ValueError, "sync_delay"),
    (dict(outer="first layer only"), ValueError, "outer_optimizer: expected exactly"),
    (dict(outer="not an optimizer"), TypeError, "outer_optimizer"),
    (dict(inner=[]), ValueError, "inner_optimizer"),
    (dict(inner="shared"), ValueError, "share parameters"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    model = build()
    kwargs = dict(kwargs)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = outer_sgd(model)
    what = kwargs.pop("outer", None)
    if what == "first layer only":
        outer = torch.optim.SGD(model.l1.parameters(), lr=0.8)
    elif what is not None:
        outer = what
    which = kwargs.pop("inner", None)
    if which == "shared":
        inner = [inner, torch.optim.SGD(model.l1.parameters(), lr=0.1)]
    elif which is not None:
        inner = which
    with pytest.raises(error, match=match):
        mpidp.MuLoCo(model, inner, outer, 3, **kwargs)

