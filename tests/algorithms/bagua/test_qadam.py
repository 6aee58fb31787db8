"""QAdam (mpidp.algorithms.QAdamOptimizer / QAdamAlgorithm) at 1-4 ranks.

During the warm-up it must be torch's Adam on the ranks' averaged gradients
(a warm-up longer than training equals Adam exactly: Bagua's
test_qadam_optimizer, ported). After it, against a single-process replica:
each rank's momentum from its own gradient (plus weight decay, which Bagua's
drops), the ranks' momenta averaged by a replica of the 8-bit allreduce --
flat, or with emulated nodes (MPIDP_RANKS_PER_NODE) node first: the node's
float32 mean, each local rank's slice quantized across the nodes -- the
second moment frozen. And the argument checks."""

import copy
import warnings

import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE, differing_setting, differing_steps, rank_slice, seeded
from mpidp.algorithms import QAdamAlgorithm, QAdamOptimizer
from quant_reference import replica_of

pytestmark = pytest.mark.ranks3


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))


def batches(steps):
    gen = seeded(4)
    return [(torch.randn(3 * SIZE, 10, generator=gen), torch.randn(3 * SIZE, 2, generator=gen))
            for _ in range(steps)]


def loss_of(model, x, y, rank):
    return torch.nn.functional.mse_loss(model(rank_slice(x, rank)), rank_slice(y, rank))


def train(model, opt, net, data, each=None):
    for t, (x, y) in enumerate(data):
        opt.zero_grad()
        loss_of(net, x, y, RANK).backward()
        opt.step()
        if each:
            each(t)


def node_sizes():
    return [k for k in range(1, SIZE + 1) if SIZE % k == 0]


def momentum_mean(flats, per_node):
    """The replica of QAdam's momentum average of every rank's `flats`."""
    nodes = SIZE // per_node
    if per_node == 1 or nodes == 1:
        return replica_of(flats, average=True)
    node_means = [sum(flats[n * per_node:(n + 1) * per_node]) * (1.0 / per_node)
                  for n in range(nodes)]
    n = flats[0].numel()
    counts = [n // per_node + (1 if r < n % per_node else 0) for r in range(per_node)]
    slices = torch.split(torch.arange(n), counts)
    return torch.cat([replica_of([m[s] for m in node_means], average=True) for s in slices])


def wrap(model, opt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # hierarchical on one node: flat
        return mpidp.with_bagua(model, [opt], QAdamAlgorithm(opt))


def test_a_warmup_longer_than_training_is_torch_adam_on_the_averaged_gradients():
    model, reference = build(), build()
    opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=100, weight_decay=0.01)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01, weight_decay=0.01)
    data = batches(6)

    def compare(t):
        x, y = data[t]
        ref_opt.zero_grad()
        for r in range(SIZE):
            (loss_of(reference, x, y, r) / SIZE).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=lambda m: f"step {t}: {m}")

    train(model, opt, wrap(model, opt), data, compare)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("per_node", node_sizes())
def test_after_the_warmup_every_step_matches_the_replica(per_node, weight_decay, monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", str(per_node))
    model, replica = build(), build()
    warmup, lr, (b1, b2), eps = 3, 0.02, (0.9, 0.999), 1e-8
    opt = QAdamOptimizer(model.parameters(), lr=lr, warmup_steps=warmup, weight_decay=weight_decay)
    ref_opt = torch.optim.Adam(replica.parameters(), lr=lr, weight_decay=weight_decay)
    params = list(replica.parameters())
    data = batches(8)
    state = {}

    def compare(t):
        x, y = data[t]
        if t < warmup:                          # torch's Adam on the averaged gradient
            ref_opt.zero_grad()
            for r in range(SIZE):
                (loss_of(replica, x, y, r) / SIZE).backward()
            ref_opt.step()
            if t == warmup - 1:
                state.update(m=[ref_opt.state[p]["exp_avg"].clone() for p in params],
                             v=[ref_opt.state[p]["exp_avg_sq"].clone() for p in params])
        else:                                   # each rank's own momentum, averaged in 8 bits
            step = t + 1
            flats = []
            for r in range(SIZE):
                grads = torch.autograd.grad(loss_of(replica, x, y, r), params)
                flats.append(torch.cat([
                    (m * b1 + (g + weight_decay * p.detach()) * (1 - b1)).reshape(-1)
                    for m, g, p in zip(state["m"], grads, params)]))
            mean = momentum_mean(flats, per_node)
            offset = 0
            with torch.no_grad():
                for k, p in enumerate(params):
                    state["m"][k] = mean[offset:offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
                    denom = (state["v"][k] / (1 - b2 ** step)).sqrt() + eps
                    p.addcdiv_(state["m"][k], denom, value=-lr / (1 - b1 ** step))
        for p, q in zip(model.parameters(), params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {t}: {m}")

    net = wrap(model, opt)
    assert (net.bagua_driver.hierarchy is not None) == (per_node > 1 and SIZE // per_node > 1)
    train(model, opt, net, data, compare)
    assert opt.param_groups[0]["qadam_step"] == 8


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that differs")
def test_an_optimizer_state_loaded_on_one_rank_alone_is_an_error_on_every_rank():
    """Past the warm-up, a rank that went back to step 3 would average its
    momentum with the others' and step with its own count and second moment:
    the models would drift apart with no error. Every rank raises instead."""
    model = build()
    opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
    net = wrap(model, opt)
    data = batches(8)
    train(model, opt, net, data[:3])
    saved = copy.deepcopy(opt.state_dict())
    train(model, opt, net, data[3:5])
    if RANK == SIZE - 1:
        opt.load_state_dict(saved)
    with pytest.raises(RuntimeError, match=differing_steps("QAdamOptimizer", 4, 6)):
        train(model, opt, net, data[5:])


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that differs")
def test_an_lr_that_differs_across_ranks_is_an_error_past_the_warmup():
    """Past the warm-up every rank applies the same averaged momentum: with
    another lr on one rank the models would drift apart with no error."""
    model = build()
    opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
    net = wrap(model, opt)
    data = batches(5)
    train(model, opt, net, data[:2])
    if RANK == SIZE - 1:
        opt.param_groups[0]["lr"] = 0.02
    with pytest.raises(RuntimeError, match=differing_setting("QAdamOptimizer", "param group 0: lr",
                                                             0.02, 0.01)):
        train(model, opt, net, data[2:])


def test_bad_arguments_and_misuse_are_named():
    model = build()
    with pytest.raises(TypeError, match="q_adam_optimizer: expected an mpidp.algorithms.QAdamOptimizer"):
        QAdamAlgorithm(torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match="warmup_steps"):
        QAdamOptimizer(model.parameters(), warmup_steps=0)
    opt = QAdamOptimizer(model.parameters(), warmup_steps=1)
    other = QAdamOptimizer(model.parameters(), warmup_steps=1)
    with pytest.raises(ValueError, match="optimizers: expected them to include"):
        mpidp.with_bagua(model, [other], QAdamAlgorithm(opt))
    x = torch.randn(2, 10)
    for _ in range(2):                              # the second step is past the warm-up
        opt.zero_grad()
        model(x).sum().backward()
        if opt.param_groups[0]["qadam_step"] == 0:
            opt.step()
        else:
            with pytest.raises(RuntimeError, match="past its warm-up"):
                opt.step()


def test_hierarchical_momentum_on_a_single_node_warns_and_averages_flat(monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", str(SIZE))     # one node
    model = build()
    opt = QAdamOptimizer(model.parameters(), warmup_steps=1)
    for group in opt.param_groups:                             # as if resumed past the warm-up
        group["qadam_step"] = 1
    with pytest.warns(UserWarning, match="QAdamAlgorithm: hierarchical=True cannot help"):
        net = mpidp.with_bagua(model, [opt], QAdamAlgorithm(opt))
    assert net.bagua_driver.hierarchy is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mpidp.with_bagua(net, [opt], QAdamAlgorithm(opt, hierarchical=False))
