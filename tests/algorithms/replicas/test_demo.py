"""DeMo against a float64 simulation of every replica (ef_reference), at 1-4
ranks: each rank's gradients are its own, and after every step the
parameters must be bitwise equal on every rank and equal to the
simulation's within float32 rounding, and each rank's momentum equal to the
simulation's momentum of that rank.

Also: with k = the whole tile the momentum empties every step and DeMo is a
sign step on the mean gradient; data_transmit and data_receive equal the
payload formula; checkpoints resume exactly; the habits (an lr differing by
rank, parameters without gradients, a GradScaler, DataParallel beside it,
bad arguments)."""

import copy

import numpy as np
import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE, assert_same_on_all_ranks, differing_setting, seeded
from ef_reference import DeMoSim

pytestmark = pytest.mark.ranks3


class Net(torch.nn.Module):
    """At chunk 8: 16 x 24 (tiles 8 x 8), 16 (8), 5 x 16 (5 x 8), a prime 11
    (tiles of 11 > 8: width 1) and a 0-d scale."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(24, 16)
        self.l2 = torch.nn.Linear(16, 5, bias=False)
        self.odd = torch.nn.Parameter(torch.randn(11))
        self.scale = torch.nn.Parameter(torch.tensor(0.5))


def build():
    torch.manual_seed(3)
    return Net()


def grads_for(model, rank, step, skip=()):
    gen = seeded(7000 + 100 * rank + step)
    return [None if i in skip else torch.randn(p.shape, generator=gen)
            for i, p in enumerate(model.parameters())]


def backward(model, step, skip=(), scaler=None):
    """The loss sum(p * g): its gradient is g exactly."""
    loss = sum((p * g).sum() for p, g in zip(model.parameters(), grads_for(model, RANK, step, skip))
               if g is not None)
    (loss if scaler is None else scaler.scale(loss)).backward()


def sim_grads(model, step, skip=()):
    return [[None if g is None else g.double().numpy() for g in grads_for(model, r, step, skip)]
            for r in range(SIZE)]


def check_against(model, opt, sim, params, what):
    assert_same_on_all_ranks(model)
    for p, t in zip(model.parameters(), params):
        np.testing.assert_allclose(p.detach().double().numpy(), t, rtol=1e-6, atol=1e-6,
                                   err_msg=what)
    for p, t in zip(model.parameters(), sim.delta[RANK]):
        np.testing.assert_allclose(opt.state[p]["delta"].double().numpy(), t, rtol=1e-4,
                                   atol=1e-6, err_msg=f"{what}: momentum of rank {RANK}")


@pytest.mark.parametrize("topk, decay, wd", [(3, 0.9, 0.0), (10, 0.999, 0.05)])
def test_matches_the_simulation(topk, decay, wd):
    model = build()
    opt = mpidp.DeMo(model.parameters(), lr=0.01, compression_decay=decay,
                     compression_topk=topk, compression_chunk=8, weight_decay=wd)
    params = [p.detach().double().numpy() for p in model.parameters()]
    sim = DeMoSim(params, SIZE, topk=topk, chunk=8, decay=decay)
    for step in range(4):
        opt.zero_grad()
        backward(model, step)
        opt.step()
        params = sim.step(params, sim_grads(model, step), 0.01, wd)
        check_against(model, opt, sim, params, f"step {step}")


def test_every_coefficient_is_a_sign_step_on_the_mean_gradient():
    """k = the whole tile: the momentum empties every step, so
    p ← p - lr·sign(mean_r g_r) whatever the decay."""
    model = build()
    opt = mpidp.DeMo(model.parameters(), lr=0.01, compression_topk=64, compression_chunk=8)
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        backward(model, step)
        opt.step()
        all_grads = [grads_for(model, r, step) for r in range(SIZE)]
        for i, (p, b) in enumerate(zip(model.parameters(), before)):
            mean = torch.stack([g[i] for g in all_grads]).double().mean(0)
            clear = mean.abs() > 1e-4    # a sign rounding cannot flip
            torch.testing.assert_close(p[clear], (b - 0.01 * mean.sign()).float()[clear], rtol=0,
                                       atol=1e-7)
            assert float(opt.state[p]["delta"].abs().max()) < 1e-6


def test_bytes_follow_the_payload_formula():
    model = build()
    opt = mpidp.DeMo(model.parameters(), lr=0.01, compression_topk=5, compression_chunk=8)
    opt.zero_grad()
    backward(model, 0)
    opt.step()
    # (tiles, k, bytes of a slot): the prime 11 in 11 tiles of 1 (k 1) and the
    # 0-d scale (k 1) keep their whole tiles, so send no slots; 16 x 24 in 6
    # tiles of 8 x 8, 16 in 2 tiles of 8, 5 x 16 in 2 tiles of 5 x 8
    layout = [(11, 1, 0), (1, 1, 0), (6, 5, 2), (2, 5, 2), (2, 5, 2)]
    sent = 24 + sum(t * k * (4 + slot) for t, k, slot in layout)
    assert opt.data_transmit == sent
    assert opt.data_receive == SIZE * sent


def test_a_layer_frozen_mid_training_stays_where_it_is():
    """layer.requires_grad_(False) after two steps: DeMo leaves it (and its
    momentum) as torch's optimizers leave a parameter without a gradient,
    the rest follows the simulation; freezing it on one rank only raises on
    every rank."""
    model = build()
    opt = mpidp.DeMo(model.parameters(), lr=0.01, compression_decay=0.9, compression_topk=3,
                     compression_chunk=8, weight_decay=0.05)
    params = [p.detach().double().numpy() for p in model.parameters()]
    sim = DeMoSim(params, SIZE, topk=3, chunk=8, decay=0.9)
    for step in range(5):
        if step == 2:
            model.l1.requires_grad_(False)
            frozen_at = [p.detach().clone() for p in model.l1.parameters()]
            momentum = [opt.state[p]["delta"].clone() for p in model.l1.parameters()]
        frozen = tuple(i for i, p in enumerate(model.parameters()) if not p.requires_grad)
        opt.zero_grad()
        backward(model, step)
        opt.step()
        params = sim.step(params, sim_grads(model, step), 0.01, 0.05, frozen=frozen)
        check_against(model, opt, sim, params, f"step {step}")
    for p, before, m in zip(model.l1.parameters(), frozen_at, momentum):
        assert torch.equal(p.detach(), before)
        assert torch.equal(opt.state[p]["delta"], m)
    if SIZE > 1:
        if RANK == SIZE - 1:
            model.l1.requires_grad_(True)
        opt.zero_grad()
        backward(model, 5)
        with pytest.raises(RuntimeError, match="frozen parameters"):
            opt.step()


def test_parameters_without_gradients_decay_and_send():
    model = build()
    opt = mpidp.DeMo(model.parameters(), lr=0.01, compression_decay=0.9, compression_topk=3,
                     compression_chunk=8)
    params = [p.detach().double().numpy() for p in model.parameters()]
    sim = DeMoSim(params, SIZE, topk=3, chunk=8, decay=0.9)
    for step, skip in enumerate([(), (0, 3), (2,)]):
        opt.zero_grad()
        backward(model, step, skip)
        opt.step()
        params = sim.step(params, sim_grads(model, step, skip), 0.01)
        check_against(model, opt, sim, params, f"step {step}")


def test_grad_scaler_gives_the_same_steps():
    model = build()
    opt = mpidp.DeMo(model.parameters(), lr=0.01, compression_topk=3, compression_chunk=8)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    params = [p.detach().double().numpy() for p in model.parameters()]
    sim = DeMoSim(params, SIZE, topk=3, chunk=8, decay=0.999)
    for step in range(3):
        opt.zero_grad()
        backward(model, step, scaler=scaler)
        scaler.step(opt)
        scaler.update()
        params = sim.step(params, sim_grads(model, step), 0.01)
        check_against(model, opt, sim, params, f"step {step}")


def test_checkpoint_resumes_exactly():
    model = build()
    opt = mpidp.DeMo(model.parameters(), lr=0.01, compression_topk=3, compression_chunk=8)
    for step in range(2):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for step in range(2, 4):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    expected = [p.detach().clone() for p in model.parameters()]
    other = Net()
    other.load_state_dict(saved[0])
    other_opt = mpidp.DeMo(other.parameters(), lr=0.01, compression_topk=3, compression_chunk=8)
    other_opt.load_state_dict(saved[1])
    for step in range(2, 4):
        other_opt.zero_grad()
        backward(other, step)
        other_opt.step()
    for p, q in zip(other.parameters(), expected):
        assert torch.equal(p, q)


def test_an_lr_differing_by_rank_is_refused():
    if SIZE == 1:
        pytest.skip("needs two ranks to differ")
    model = build()
    opt = mpidp.DeMo(model.parameters(), lr=0.01, compression_chunk=8)
    if RANK == SIZE - 1:
        opt.param_groups[0]["lr"] = 0.02
    backward(model, 0)
    with pytest.raises(RuntimeError, match=differing_setting("DeMo", "param group 0: lr", 0.02,
                                                             0.01)):
        opt.step()


def test_a_step_skipped_on_some_ranks_is_refused():
    if SIZE == 1:
        pytest.skip("needs two ranks to differ")
    model = build()
    opt = mpidp.DeMo(model.parameters(), lr=0.01, compression_chunk=8)
    if RANK == SIZE - 1:
        opt.demo_step = 5      # as if it had skipped none of the steps the others skipped
    backward(model, 0)
    with pytest.raises(RuntimeError, match="DeMo: the ranks reached this exchange at different "
                                           "steps"):
        opt.step()


def test_a_second_demo_over_the_same_parameters_replaces_the_first():
    model = build()
    first = mpidp.DeMo(model.parameters(), lr=0.01, compression_topk=3, compression_chunk=8)
    with pytest.warns(UserWarning, match="already stepped by another DeMo"):
        second = mpidp.DeMo(model.parameters(), lr=0.01, compression_topk=3,
                            compression_chunk=8)
    backward(model, 0)
    with pytest.raises(RuntimeError, match="a newer DeMo over the same parameters replaced"):
        first.step()
    params = [p.detach().double().numpy() for p in model.parameters()]
    sim = DeMoSim(params, SIZE, topk=3, chunk=8, decay=0.999)
    second.step()
    params = sim.step(params, sim_grads(model, 0), 0.01)
    check_against(model, second, sim, params, "the second DeMo's step")


def test_data_parallel_beside_it_is_refused():
    model = build()
    net = mpidp.DataParallel(model, blocking_parameter_updates=True)
    opt = mpidp.DeMo(model.parameters(), lr=0.01, compression_chunk=8)
    backward(model, 0)
    with pytest.raises(RuntimeError, match="DeMo: these parameters are also averaged by "
                                           "DataParallel"):
        opt.step()
    net.detach()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(compression_topk=0), ValueError, "compression_topk"),
    (dict(compression_chunk=0), ValueError, "compression_chunk"),
    (dict(compression_chunk=300), ValueError, "compression_chunk"),
    (dict(compression_decay=1.0), ValueError, "compression_decay"),
    (dict(compression_decay=-0.1), ValueError, "compression_decay"),
    (dict(lr=-1.0), ValueError, "lr"),
    (dict(lr="0.1"), TypeError, "lr"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    kwargs = {"lr": 0.01, **kwargs}
    with pytest.raises(error, match=match):
        mpidp.DeMo(build().parameters(), **kwargs)


def test_lr_is_required_and_parameters_must_be_float32():
    with pytest.raises(TypeError):
        mpidp.DeMo(build().parameters())
    with pytest.raises(TypeError, match="float32 CPU"):
        mpidp.DeMo(build().double().parameters(), lr=0.01)
