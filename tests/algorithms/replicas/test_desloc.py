"""DES-LOC against a simulation of every replica (desloc_reference's
DESLOCSim: torch's Adam on a copy of the model per rank, the averages in
float64), at 1-4 ranks: each rank steps with gradients of its own; after
every step its parameters and Adam moments must equal its simulated
replica's. Also: Local Adam (the three periods equal), AdamW, AMP's
GradScaler with clipping, a layer frozen mid-training, a checkpoint
resuming exactly and at another number of ranks, settings that differ
across ranks, bad arguments."""

import copy

import numpy as np
import pytest
import torch

import mpidp
from desloc_reference import DESLOCSim
from dp_reference import RANK, SIZE
from mpidp import MPI
from test_diloco import node_means, node_sizes, node_workers
from test_sparseloco import Net, build, grads_for, inner_step

pytestmark = pytest.mark.ranks3

TOL = dict(rtol=1e-5, atol=1e-6)

CASES = {
    # periods 2, 3, 4: every combination of averages within 12 steps
    "desynced, Adam": dict(optimizer=(torch.optim.Adam, dict(lr=0.01)),
                           periods=dict(param_every=2, exp_avg_every=3, exp_avg_sq_every=4)),
    "the paper's defaults (3x, 6x), AdamW": dict(
        optimizer=(torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, betas=(0.8, 0.95))),
        periods=dict(param_every=1)),
    "Local Adam (the periods equal)": dict(optimizer=(torch.optim.Adam, dict(lr=0.02)),
                                           periods=dict(param_every=3, exp_avg_every=3,
                                                        exp_avg_sq_every=3)),
}


def periods_of(periods):
    p = periods["param_every"]
    return (p, periods.get("exp_avg_every", 3 * p), periods.get("exp_avg_sq_every", 6 * p))


def make_optimizer(case):
    kind, kwargs = CASES[case]["optimizer"]
    return lambda params: kind(params, **kwargs)


def sim_for(model, case, ranks=SIZE):
    return DESLOCSim(model, ranks, make_optimizer(case), *periods_of(CASES[case]["periods"]))


def desloc(model, opt, case, comm=None):
    return mpidp.DESLOC(model, opt, comm=comm, **CASES[case]["periods"])


def all_grads(model, step, skip=(), ranks=SIZE):
    return [grads_for(model, r, step, skip) for r in range(ranks)]


def check(model, opt, sim, what, rank=RANK):
    mine = sim.replicas[rank]
    for i, (p, q) in enumerate(zip(model.parameters(), mine.parameters())):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), **TOL,
                                   err_msg=f"{what}: parameter {i}, rank {RANK}")
        for key in ("exp_avg", "exp_avg_sq"):
            if p in opt.state:
                np.testing.assert_allclose(opt.state[p][key].numpy(),
                                           sim.optims[rank].state[q][key].numpy(), **TOL,
                                           err_msg=f"{what}: {key} of parameter {i}, rank {RANK}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_simulation(case):
    model = build()
    opt = make_optimizer(case)(model.parameters())
    sim = sim_for(model, case)
    with desloc(model, opt, case):
        for s in range(12):
            inner_step(model, opt, s)
            sim.step(all_grads(model, s))
            check(model, opt, sim, f"{case}, step {s}")


@pytest.mark.parametrize("per_node", node_sizes())
def test_nodes_as_workers_match_the_simulated_node_replicas(per_node):
    """DES-LOC's workers as emulated nodes of per_node ranks: node-local
    DataParallel averages the node's gradients every step, DES-LOC's
    averages run over one rank per node. Against the simulation with one
    replica per node, stepped with the mean of its ranks' gradients."""
    case = "desynced, Adam"
    model = build()
    opt = make_optimizer(case)(model.parameters())
    with node_workers(per_node, model) as (nodes, mine, cross), \
            desloc(model, opt, case, comm=cross):
        sim = sim_for(model, case, ranks=nodes)
        for s in range(12):
            inner_step(model, opt, s)
            sim.step(node_means(all_grads(model, s), per_node))
            check(model, opt, sim, f"nodes of {per_node}, step {s}", rank=mine)


@pytest.mark.skipif(SIZE < 2, reason="the replicas differ only with other ranks")
def test_only_what_is_due_is_averaged():
    """Periods 2, 3, 4: after step 2 (the third) only the first moments are
    the same on every rank; after step 3, the parameters and second
    moments too, the first moments apart again."""
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    world = MPI.COMM_WORLD

    def same(tensors):
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        return all(torch.equal(flat, other) for other in world.allgather(flat))
    with mpidp.DESLOC(model, opt, 2, exp_avg_every=3, exp_avg_sq_every=4):
        for s in range(4):
            inner_step(model, opt, s)
            params = list(model.parameters())
            got = (same(params), same([opt.state[p]["exp_avg"] for p in params]),
                   same([opt.state[p]["exp_avg_sq"] for p in params]))
            assert got == [(False, False, False), (True, False, False), (False, True, False),
                           (True, False, True)][s], f"after step {s}"


def test_grad_scaler_and_clipping_give_the_same_steps():
    """AMP's GradScaler (unscaled, then clipped to norm 1) steps Adam with
    the clipped gradients: the simulation clips the same ones."""
    case = "desynced, Adam"
    model = build()
    opt = make_optimizer(case)(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sim = sim_for(model, case)
    with desloc(model, opt, case):
        for s in range(8):
            opt.zero_grad()
            loss = sum((p * g).sum() for p, g in zip(model.parameters(),
                                                     grads_for(model, RANK, s)))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            grads = []
            for g in all_grads(model, s):
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x)
                                                             for x in g]))
                grads.append([x * torch.clamp(1.0 / (norm + 1e-6), max=1.0) for x in g])
            sim.step(grads)
            check(model, opt, sim, f"step {s}")


def test_a_layer_frozen_mid_training_stays_where_it_is():
    """l1.requires_grad_(False) after 4 steps: its parameters and moments
    are averaged no more (each rank keeps its own), and the other layers go
    on matching the simulation."""
    case = "desynced, Adam"
    model = build()
    opt = make_optimizer(case)(model.parameters())
    sim = sim_for(model, case)
    frozen_ids = {id(p) for p in model.l1.parameters()}
    skip = tuple(i for i, p in enumerate(model.parameters()) if id(p) in frozen_ids)
    with desloc(model, opt, case):
        for s in range(4):
            inner_step(model, opt, s)
            sim.step(all_grads(model, s))
        model.l1.requires_grad_(False)
        sim.frozen = set(skip)
        for r in sim.replicas:
            r.l1.requires_grad_(False)
        kept = [p.detach().clone() for p in model.l1.parameters()]
        moments = [opt.state[p]["exp_avg"].clone() for p in model.l1.parameters()]
        for s in range(4, 12):
            inner_step(model, opt, s, skip=skip)
            sim.step(all_grads(model, s, skip))
            check(model, opt, sim, f"step {s}, l1 frozen")
    for p, was, m in zip(model.l1.parameters(), kept, moments):
        assert torch.equal(p.detach(), was)
        assert torch.equal(opt.state[p]["exp_avg"], m)


def test_with_bagua_switches_to_it_and_back():
    """Bagua's interface: two steps of averaged gradients, DESLOCAlgorithm
    for six steps against the simulation (from the replicas' common weights
    and Adam state), then averaged gradients again from rank 0's replica and
    Adam state (with_bagua gives every rank rank 0's)."""
    model = build()
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=0.01)
    net = mpidp.with_bagua(model, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
    for s in range(2):
        inner_step(model, opt, s)
    sim = DESLOCSim(model, SIZE, lambda ps: torch.optim.Adam(ps, lr=0.01), 2, 3, 4)
    for o in sim.optims:
        o.load_state_dict(copy.deepcopy(opt.state_dict()))
    net = mpidp.with_bagua(net, [opt], mpidp.algorithms.DESLOCAlgorithm(
        2, exp_avg_every=3, exp_avg_sq_every=4))
    for s in range(2, 8):
        inner_step(model, opt, s)
        sim.step(all_grads(model, s))
        check(model, opt, sim, f"step {s} under DESLOCAlgorithm")
    net = mpidp.with_bagua(net, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
    inner_step(model, opt, 8)
    mean = [sum(g[i] for g in all_grads(model, 8)) / SIZE for i in range(len(params))]
    sim.step([mean] * SIZE)     # replica 0 stepped with the mean gradient
    check(model, opt, sim, "averaged gradients after DESLOCAlgorithm", rank=0)


@pytest.mark.parametrize("saved_after", [4, 5], ids=["at an average", "between averages"])
def test_checkpoint_resumes_exactly(saved_after):
    """The model, Adam's state and DESLOC's step saved after `saved_after`
    steps and loaded into new ones go on bit for bit as the run that
    never stopped."""
    case = "desynced, Adam"
    model = build()
    opt = make_optimizer(case)(model.parameters())
    with desloc(model, opt, case) as algo:
        for s in range(saved_after):
            inner_step(model, opt, s)
        saved = copy.deepcopy((model.state_dict(), opt.state_dict(), algo.state_dict()))
        assert saved[2]["step"] == saved_after
        for s in range(saved_after, 12):
            inner_step(model, opt, s)
    other = Net()
    other.load_state_dict(saved[0])
    other_opt = make_optimizer(case)(other.parameters())
    other_opt.load_state_dict(saved[1])
    with desloc(other, other_opt, case) as resumed:
        resumed.load_state_dict(saved[2])
        for s in range(saved_after, 12):
            inner_step(other, other_opt, s)
    for p, q in zip(other.parameters(), model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.skipif(SIZE < 2, reason="needs a job of another size to resume")
@pytest.mark.parametrize("grow", [True, False], ids=["one rank more", "one rank fewer"])
def test_a_job_resumes_at_another_number_of_ranks(grow):
    """A job of N-1 ranks (or N) saves after 5 steps; N (or N-1) resume it:
    each rank with a checkpoint loads its own, a new rank loads rank 0's
    (model, Adam, step). The next 7 steps match the simulation, which gains
    a copy of rank 0's replica (or loses the last rank's)."""
    case = "desynced, Adam"
    world = MPI.COMM_WORLD
    before, after = (SIZE - 1, SIZE) if grow else (SIZE, SIZE - 1)
    sim = sim_for(build(), case, before)
    for s in range(5):
        sim.step(all_grads(build(), s, ranks=before))
    mine = None
    comm = world.Split(0 if RANK < before else MPI.UNDEFINED, RANK)
    if comm != MPI.COMM_NULL:
        model = build()
        opt = make_optimizer(case)(model.parameters())
        with desloc(model, opt, case, comm) as algo:
            for s in range(5):
                inner_step(model, opt, s)
            mine = copy.deepcopy((model.state_dict(), opt.state_dict(), algo.state_dict()))
        comm.Free()
    first = world.bcast(mine, root=0)
    if grow:
        sim.join()
    else:
        sim.drop(after)
    comm = world.Split(0 if RANK < after else MPI.UNDEFINED, RANK)
    if comm == MPI.COMM_NULL:
        return
    saved = mine if mine is not None else first
    model = Net()
    model.load_state_dict(saved[0])
    opt = make_optimizer(case)(model.parameters())
    opt.load_state_dict(saved[1])
    with desloc(model, opt, case, comm) as algo:
        algo.load_state_dict(saved[2])
        for s in range(5, 12):
            inner_step(model, opt, s)
            sim.step(all_grads(model, s, ranks=after))
            check(model, opt, sim, f"step {s} after the resume")
    comm.Free()


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that disagree")
def test_periods_that_differ_across_ranks_are_refused_on_every_rank():
    model = build()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="exp_avg_sq_every"):
        mpidp.DESLOC(model, opt, 2, exp_avg_sq_every=8 if RANK == 0 else 12)


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that disagree")
def test_an_adam_lr_that_differs_across_ranks_is_refused_at_the_average():
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=0.01 if RANK == 0 else 0.02)
    with pytest.raises(RuntimeError, match="lr = 0.02 on rank 1"):
        with mpidp.DESLOC(model, opt, 2):
            for s in range(2):
                inner_step(model, opt, s)


def test_a_checkpoint_of_other_periods_is_refused():
    model = build()
    opt = torch.optim.Adam(model.parameters())
    with mpidp.DESLOC(model, opt, 2) as algo:
        state = algo.state_dict()
    with mpidp.DESLOC(model, opt, 4) as algo:
        with pytest.raises(ValueError, match="saved with the periods"):
            algo.load_state_dict(state)


@pytest.mark.parametrize("make, error, match", [
    (lambda m: mpidp.DESLOC(m, torch.optim.SGD(m.parameters(), lr=0.1), 2), TypeError,
     "optimizer: expected a torch.optim.Adam or AdamW"),
    (lambda m: mpidp.DESLOC(m, torch.optim.Adam(m.parameters(), amsgrad=True), 2), ValueError,
     "optimizer: amsgrad"),
    (lambda m: mpidp.DESLOC(m, torch.optim.Adam(m.parameters()), 0), ValueError,
     "param_every: expected an int >= 1"),
    (lambda m: mpidp.DESLOC(m, torch.optim.Adam(m.parameters()), 2, exp_avg_every=0),
     ValueError, "exp_avg_every: expected an int >= 1"),
    (lambda m: mpidp.DESLOC(m, torch.optim.Adam(m.parameters()), 2, exp_avg_sq_every="6"),
     TypeError, "exp_avg_sq_every: expected an int"),
    (lambda m: mpidp.DESLOC(object(), torch.optim.Adam(m.parameters()), 2), TypeError,
     "model: expected a torch.nn.Module"),
])
def test_bad_arguments_are_named(make, error, match):
    with pytest.raises(error, match=match):
        make(build())
