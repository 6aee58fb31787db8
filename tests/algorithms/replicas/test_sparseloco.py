"""SparseLoCo against a float64 simulation of every replica (ef_reference),
at 1-4 ranks: each rank's inner SGD steps on gradients of its own, and after
every sync the parameters must be bitwise equal on every rank and equal to
the simulation's θ̃ within float32 rounding, and each rank's error-feedback
buffer equal to the simulation's buffer of that rank.

Also: the dense limit (k = the whole tile, no quantizer, no decay) equals
mpidp.DiLoCo with outer SGD at lr α², the bytes sent equal the payload
formula, a checkpoint resumes exactly, and the habits (a rank reloaded
alone, an outer lr differing by rank, parameters without gradients, a
GradScaler, bad arguments)."""

import copy

import numpy as np
import pytest
import torch

import mpidp
from mpidp import MPI
from dp_reference import RANK, SIZE, assert_same_on_all_ranks, differing_setting, seeded
from ef_reference import SparseLoCoSim

pytestmark = pytest.mark.ranks3


class Net(torch.nn.Module):
    """Tensors of several tilings at chunk 8: 20 x 12 (tiles 5 x 6), 20
    (tiles of 5), 3 x 20 (3 x 5), a prime 7 (tiles of 7) and a 0-d scale."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(12, 20)
        self.l2 = torch.nn.Linear(20, 3)
        self.odd = torch.nn.Parameter(torch.randn(7))
        self.scale = torch.nn.Parameter(torch.tensor(1.5))


def build():
    torch.manual_seed(5)
    return Net()


def grads_for(model, rank, step, skip=()):
    """Gradients drawn from (rank, step): every rank's differ."""
    gen = seeded(1000 * rank + step)
    return [None if i in skip else torch.randn(p.shape, generator=gen)
            for i, p in enumerate(model.parameters())]


def inner_step(model, opt, step, skip=(), scaler=None):
    """One inner step on the loss sum(p * g) (its gradient is g exactly),
    through `scaler` if given."""
    opt.zero_grad()
    loss = sum((p * g).sum() for p, g in zip(model.parameters(), grads_for(model, RANK, step, skip))
               if g is not None)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def replicas_after(sim_shared, model, steps, lr, skip=()):
    """Every rank's replica after inner SGD steps from θ̃ (float64)."""
    out = []
    for r in range(SIZE):
        rep = [t.copy() for t in sim_shared]
        for s in steps:
            for i, g in enumerate(grads_for(model, r, s, skip)):
                if g is not None:
                    rep[i] = rep[i] - lr * g.double().numpy()
        out.append(rep)
    return out


def check_against(model, sl, sim, what):
    assert_same_on_all_ranks(model)
    for p, t in zip(model.parameters(), sim.shared):
        np.testing.assert_allclose(p.detach().double().numpy(), t, rtol=2e-5, atol=2e-6,
                                   err_msg=what)
    for e, t in zip(sl.error, sim.error[RANK]):
        np.testing.assert_allclose(e.double().numpy(), t, rtol=2e-5, atol=2e-6,
                                   err_msg=f"{what}: error feedback of rank {RANK}")


CASES = {
    "paper": dict(lr=1.0, error_decay=0.95, top_k=8, chunk_size=8),
    "plain_mean_all": dict(lr=0.7, error_decay=0.5, top_k=20, chunk_size=8,
                           use_quantization=False, mean="all", weight_decay=0.1),
    "bins_16": dict(lr=1.0, error_decay=0.9, top_k=4, chunk_size=6, quantization_bins=16,
                    quantization_range=4.0),
    "delayed": dict(top_k=8, chunk_size=8, sync_delay=2),
}


def sim_for(model, settings, ranks=SIZE):
    s = dict(settings)
    s.pop("sync_delay", None)
    bins = 0 if not s.pop("use_quantization", True) else s.pop("quantization_bins", 4)
    spread = s.pop("quantization_range", 6.0)
    return SparseLoCoSim([p.detach().double().numpy() for p in model.parameters()], ranks,
                         bins=bins, spread=spread, **s)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_simulation(case):
    """With sync_delay d, Δ is taken d steps before the turn and the replica's
    last d steps are dropped at it."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sim = sim_for(model, CASES[case])
    delay = CASES[case].get("sync_delay", 0)
    with mpidp.SparseLoCo(model, opt, 3, **CASES[case]) as sl:
        assert len(sl._wire.send) == 1
        for sync in range(3):
            steps = range(3 * sync, 3 * sync + 3)
            replicas = replicas_after(sim.shared, model, steps[:3 - delay], 0.1)
            for s in steps:
                inner_step(model, opt, s)
            sim.round(replicas)
            check_against(model, sl, sim, f"{case}, sync {sync}")


def test_payloads_in_several_buckets_and_a_second_wrapper(monkeypatch):
    """Buckets of at most 100 bytes (three here, one allgather each), and the habit of wrapping twice: the newer SparseLoCo takes
    the model over (the older one detached, with a warning), so each round
    still runs once."""
    monkeypatch.setattr(mpidp._engines.ef_wire, "BUCKET_BYTES", 100)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = dict(top_k=8, chunk_size=8)
    sim = sim_for(model, settings)
    with mpidp.SparseLoCo(model, opt, 2, **settings):
        with pytest.warns(UserWarning, match="already wrapped by another SparseLoCo"):
            inner_sl = mpidp.SparseLoCo(model, opt, 2, **settings).__enter__()
        assert len(inner_sl._wire.send) == 3
        for sync in range(2):
            steps = range(2 * sync, 2 * sync + 2)
            replicas = replicas_after(sim.shared, model, steps, 0.1)
            for s in steps:
                inner_step(model, opt, s)
            sim.round(replicas)
            check_against(model, inner_sl, sim, f"sync {sync}")
        inner_sl.__exit__(None, None, None)


@pytest.mark.parametrize("per_node", [k for k in (1, 2, SIZE) if SIZE % k == 0])
def test_across_emulated_nodes_the_payloads_cross_once_and_land_alike(monkeypatch, per_node):
    """Nodes of per_node ranks (MPIDP_RANKS_PER_NODE): with several nodes of
    several ranks the wire takes the node route (each payload gathered
    across nodes once, then within the node: node_gather.py), elsewhere the
    flat allgather. In three buckets, every rank's payload must land where
    the flat allgather puts it (the mean would not tell: it adds them in
    any order): the gathered bytes are the flat allgather's, and the rounds
    match the simulation."""
    world = MPI.COMM_WORLD
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", str(per_node))
    monkeypatch.setattr(mpidp._engines.ef_wire, "BUCKET_BYTES", 100)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = CASES["paper"]
    sim = sim_for(model, settings)
    with mpidp.SparseLoCo(model, opt, 3, **settings) as sl:
        assert (sl._wire.route is not None) == (1 < per_node < SIZE), per_node
        assert len(sl._wire.send) == 3
        for sync in range(3):
            steps = range(3 * sync, 3 * sync + 3)
            replicas = replicas_after(sim.shared, model, steps, 0.1)
            for s in steps:
                inner_step(model, opt, s)
            sim.round(replicas)
            check_against(model, sl, sim, f"nodes of {per_node}, sync {sync}")
            for b, (send, got) in enumerate(zip(sl._wire.send, sl._wire.gathered)):
                flat = torch.cat([torch.from_numpy(x) for x in world.allgather(send.numpy())])
                assert torch.equal(got, flat), f"sync {sync}, bucket {b}: payloads misplaced"


def test_with_bagua_switches_to_it_after_averaged_gradients():
    """Bagua's interface: two steps of averaged gradients, then SparseLoCo
    from the replicas' common weights, matching the simulation; its state
    is the algorithm state."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = mpidp.with_bagua(model, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
    for s in range(2):
        inner_step(model, opt, s)
    mean = [torch.stack([g[i] for g in (grads_for(model, r, s) for r in range(SIZE) for s in
                                        range(2))]).double().sum(0) / SIZE
            for i in range(len(list(model.parameters())))]
    settings = dict(top_k=8, chunk_size=8)
    sim = sim_for(model, settings)
    assert_same_on_all_ranks(model)
    np.testing.assert_allclose(sim.shared[0], (build().odd.detach().double() - 0.1 * mean[0]).numpy(),
                               rtol=1e-5, atol=1e-6)
    net = mpidp.with_bagua(net, [opt], mpidp.algorithms.SparseLoCoAlgorithm(2, **settings))
    for sync in range(2):
        steps = range(2 + 2 * sync, 4 + 2 * sync)
        replicas = replicas_after(sim.shared, model, steps, 0.1)
        for s in steps:
            inner_step(model, opt, s)
        sim.round(replicas)
        assert_same_on_all_ranks(model)
        for p, t in zip(model.parameters(), sim.shared):
            np.testing.assert_allclose(p.detach().double().numpy(), t, rtol=2e-5, atol=2e-6)
    assert net.bagua_state_dict()["step"] == 4


def test_dense_limit_is_diloco_with_outer_sgd_at_lr_squared():
    """k = the whole tile, no quantizer, no decay: θ̃ - α² mean Δ (α is applied
    twice, as in the reference code), which mpidp.DiLoCo computes with outer
    SGD at lr α²."""
    alpha = 0.8
    model, twin = build(), build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    outer = torch.optim.SGD(twin.parameters(), lr=alpha * alpha)
    with mpidp.SparseLoCo(model, opt, 2, lr=alpha, error_decay=0.0, top_k=64, chunk_size=8,
                          use_quantization=False) as sl, \
            mpidp.DiLoCo(twin, twin_opt, outer, 2):
        for s in range(6):
            inner_step(model, opt, s)
            inner_step(twin, twin_opt, s)
            if s % 2 == 1:
                for p, q in zip(model.parameters(), twin.parameters()):
                    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(float(e.abs().max()) == 0.0 for e in sl.error)


def test_bytes_sent_follow_the_payload_formula():
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sl = mpidp.SparseLoCo(model, opt, 2, top_k=8, chunk_size=8)   # 4 bins: 2 bits a code
    # (tiles, k) per tensor: 20x12 in 5x6 tiles (k = round(30/8) = 4), 20 in
    # tiles of 5 (k 1), 3x20 in 3x5 tiles (k = round(15/8) = 2), 3 in 1 tile of
    # 3 (k 1), 7 in 1 tile (k 1), 0-d (k 1: the whole tile, so no slot).
    layout = [(8, 4, 2), (4, 1, 2), (4, 2, 2), (1, 1, 2), (1, 1, 2), (1, 1, 0)]
    payload = sum(4 * 5 + slot * t * k + (t * k * 2 + 7) // 8 for t, k, slot in layout)
    assert sl.bytes_sent == 24 + payload
    params = sum(p.numel() for p in model.parameters())
    assert sl.bytes_sent < 4 * params / 2


def test_parameters_without_gradients_send_their_delta():
    """A parameter the inner optimizer did not step has Δ = 0 this round, and
    its error feedback still decays and sends."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = dict(top_k=8, chunk_size=8)
    sim = sim_for(model, settings)
    with mpidp.SparseLoCo(model, opt, 2, **settings) as sl:
        for sync in range(2):
            skip = (1, 4) if sync == 0 else (0,)
            steps = range(2 * sync, 2 * sync + 2)
            replicas = replicas_after(sim.shared, model, steps, 0.1, skip)
            for s in steps:
                inner_step(model, opt, s, skip)
            sim.round(replicas)
            check_against(model, sl, sim, f"sync {sync}")


def assert_grad_scaler_gives_the_same_rounds(make, sim_of):
    """Inner steps through AMP's GradScaler follow the simulation: a round
    every 2 steps. make(model, opt, sync_every); sim_of(model)."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sim = sim_of(model)
    with make(model, opt, 2) as algo:
        for sync in range(2):
            steps = range(2 * sync, 2 * sync + 2)
            replicas = replicas_after(sim.shared, model, steps, 0.1)
            for s in steps:
                inner_step(model, opt, s, scaler=scaler)
            sim.round(replicas)
            check_against(model, algo, sim, f"sync {sync}")


def test_grad_scaler_gives_the_same_rounds():
    settings = dict(top_k=8, chunk_size=8)
    assert_grad_scaler_gives_the_same_rounds(
        lambda model, opt, every: mpidp.SparseLoCo(model, opt, every, **settings),
        lambda model: sim_for(model, settings))


def assert_checkpoint_resumes_exactly(make, saved_after, until, check_saved):
    """make(model, opt) trained to step `until` equals, bit for bit, the same
    run saved after `saved_after` steps (the algorithm's and the inner
    optimizer's state_dict, checked by check_saved) and resumed on a new
    model and optimizer."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with make(model, opt) as algo:
        for s in range(saved_after):
            inner_step(model, opt, s)
        saved = copy.deepcopy((algo.state_dict(), opt.state_dict()))
        check_saved(saved[0])
        for s in range(saved_after, until):
            inner_step(model, opt, s)
        expected = [p.detach().clone() for p in model.parameters()]
    other = Net()
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    with make(other, other_opt) as resumed:
        resumed.load_state_dict(saved[0])
        other_opt.load_state_dict(saved[1])
        for s in range(saved_after, until):
            inner_step(other, other_opt, s)
    for p, q in zip(other.parameters(), expected):
        assert torch.equal(p, q)


def assert_resumes_at_another_rank_count(make, sim_of, grow):
    """A job of `before` ranks (all but the last, or all) saves one step
    into its second interval of 3; `after` ranks (all, or all but the last)
    resume it: those with a checkpoint load their own, a new rank takes the
    shared state from rank 0's (load_shared_state: its replica at θ̃, its
    error feedback at zero). Two more syncs match the simulation, which
    gains a rank with a zero buffer whose replica starts at the resume, or
    loses the last rank's buffer. make(model, opt, comm), sim_of(model, n)."""
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
    sim.round(replicas_after(sim.shared, build(), range(3), 0.1)[:before])
    shared = world.bcast(mine, root=0)
    replicas = replicas_after(sim.shared, build(), range(3, 6), 0.1)[:after]
    if grow:
        sim.error.append([np.zeros_like(t) for t in sim.shared])
        replicas[-1] = replicas_after(sim.shared, build(), range(4, 6), 0.1)[after - 1]
    else:
        sim.error = sim.error[:after]
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
        for sync, steps in enumerate((range(4, 6), range(6, 9))):
            for s in steps:
                inner_step(model, opt, s)
            sim.round(replicas)
            for p, t in zip(model.parameters(), sim.shared):
                np.testing.assert_allclose(p.detach().double().numpy(), t, rtol=2e-5, atol=2e-6,
                                           err_msg=f"sync {sync} after the resume")
            for e, t in zip(algo.error, sim.error[RANK]):
                np.testing.assert_allclose(e.double().numpy(), t, rtol=2e-5, atol=2e-6,
                                           err_msg=f"sync {sync}: error feedback of rank {RANK}")
            replicas = replicas_after(sim.shared, model, range(6, 9), 0.1)[:after]
    comm.Free()


@pytest.mark.skipif(SIZE < 2, reason="needs a job of another size to resume")
@pytest.mark.parametrize("grow", [True, False], ids=["one rank more", "one rank fewer"])
def test_resumes_at_another_rank_count(grow):
    settings = dict(top_k=8, chunk_size=8)
    assert_resumes_at_another_rank_count(
        lambda model, opt, comm: mpidp.SparseLoCo(model, opt, 3, comm, **settings),
        lambda model, n: sim_for(model, settings, n), grow)


@pytest.mark.parametrize("delay", [0, 1])
def test_checkpoint_resumes_exactly(delay):
    """Saved after step 3 of syncs every 2: with sync_delay 1 the second sync
    is in flight (sent after step 3, due after step 4)."""
    def check_saved(state):
        assert (state["in_flight"] is not None) == (delay == 1)
    assert_checkpoint_resumes_exactly(
        lambda model, opt: mpidp.SparseLoCo(model, opt, 2, top_k=8, chunk_size=8,
                                            sync_delay=delay), 3, 6, check_saved)


def test_a_rank_reloaded_alone_is_refused():
    if SIZE == 1:
        pytest.skip("needs two ranks to differ")
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mpidp.SparseLoCo(model, opt, 2, top_k=8, chunk_size=8) as sl:
        for s in range(2):
            inner_step(model, opt, s)
        early = sl.state_dict()
        for s in range(2, 4):
            inner_step(model, opt, s)
        if RANK == SIZE - 1:
            sl.load_state_dict(early)      # back to step 2 alone
        with pytest.raises(RuntimeError, match=r"SparseLoCo: the ranks reached this exchange at "
                           rf"different steps \(rank\(s\) \[{SIZE - 1}\] at step 4"):
            for s in range(4, 8):
                inner_step(model, opt, s)


def test_shared_weights_differing_by_rank_are_refused():
    if SIZE == 1:
        pytest.skip("needs two ranks to differ")
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mpidp.SparseLoCo(model, opt, 2, top_k=8, chunk_size=8) as sl:
        if RANK == SIZE - 1:
            with torch.no_grad():
                sl.shared[-1][0] += 1.0
        with pytest.raises(RuntimeError, match=r"shared weights differ across ranks: rank\(s\) "
                           rf"\[{SIZE - 1}\]"):
            for s in range(2):
                inner_step(model, opt, s)


def test_an_outer_lr_differing_by_rank_is_refused():
    if SIZE == 1:
        pytest.skip("needs two ranks to differ")
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mpidp.SparseLoCo(model, opt, 2, top_k=8, chunk_size=8) as sl:
        if RANK == SIZE - 1:
            sl.lr = 0.5
        with pytest.raises(RuntimeError, match=differing_setting("SparseLoCo", "lr", 0.5, 1.0)):
            for s in range(2):
                inner_step(model, opt, s)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(top_k=0), ValueError, "top_k"),
    (dict(chunk_size=300), ValueError, "chunk_size"),
    (dict(quantization_bins=1), ValueError, "quantization_bins"),
    (dict(quantization_bins=257), ValueError, "quantization_bins"),
    (dict(quantization_range=0.0), ValueError, "quantization_range"),
    (dict(error_decay=1.5), ValueError, "error_decay"),
    (dict(mean="median"), ValueError, "mean"),
    (dict(use_quantization=1), TypeError, "use_quantization"),
    (dict(sync_every=0), ValueError, "sync_every"),
    (dict(sync_delay=2), ValueError, "sync_delay"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = dict(kwargs)
    sync_every = kwargs.pop("sync_every", 2)
    with pytest.raises(error, match=match):
        mpidp.SparseLoCo(model, opt, sync_every, **kwargs)


def test_non_float32_parameters_are_refused():
    model = build().double()
    with pytest.raises(TypeError, match="float32 CPU"):
        mpidp.SparseLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)


def test_a_layer_frozen_mid_training_stays_where_it_is():
    """layer.requires_grad_(False) after a sync: SparseLoCo gives it no outer
    step (θ̃ stays, its error buffer is kept), as torch's optimizers leave a
    parameter without a gradient, and the rest follows the simulation;
    freezing it on one rank only raises on every rank at the next sync."""
    settings = CASES["plain_mean_all"]
    assert_a_layer_frozen_mid_training_stays(
        lambda model, opt: mpidp.SparseLoCo(model, opt, 3, **settings),
        lambda model: sim_for(model, settings))


def assert_a_layer_frozen_mid_training_stays(make, sim_of):
    """make(model, opt) syncing every 3 steps, against sim_of(model)."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sim = sim_of(model)
    with make(model, opt) as sl:
        for sync in range(3):
            if sync == 1:
                model.l1.requires_grad_(False)
                frozen_at = [p.detach().clone() for p in model.l1.parameters()]
                frozen_errors = [e for p, e in zip(sl.params, sl.error) if not p.requires_grad]
                errors = [e.clone() for e in frozen_errors]
            frozen = [i for i, p in enumerate(model.parameters()) if not p.requires_grad]
            steps = range(3 * sync, 3 * sync + 3)
            replicas = replicas_after(sim.shared, model, steps, 0.1)
            for replica in replicas:       # a frozen parameter's inner steps do not move it
                for i in frozen:
                    replica[i] = sim.shared[i].copy()
            for s in steps:
                inner_step(model, opt, s)
            sim.round(replicas, frozen=frozen)
            check_against(model, sl, sim, f"sync {sync}")
        for p, before in zip(model.l1.parameters(), frozen_at):
            assert torch.equal(p.detach(), before)
        for e, before in zip(frozen_errors, errors):
            assert torch.equal(e, before)
        if SIZE > 1:
            if RANK == SIZE - 1:
                model.l1.requires_grad_(True)
            with pytest.raises(RuntimeError, match="frozen parameters"):
                for s in range(9, 12):
                    inner_step(model, opt, s)
