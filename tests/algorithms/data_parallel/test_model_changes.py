"""Changing the model after a wrapper was set up.

Unfreezing parameters (progressive unfreezing in fine-tuning) or adding new
ones (a new head): every wrapper averages the parameters that were trainable
when it was set up, so such a parameter would train on each rank's own
gradients and the replicas would drift apart with no error (torch DDP lets
that happen). Each wrapper raises instead, naming the parameters and how to
set it up again; following that advice trains like one process again.
Freezing after set-up needs nothing: such parameters get no gradient and are
left alone, as in one process. Converting the model (model.double()) after
DataParallel was set up leaves its gradient buckets in the old dtype: a
clear error, then a new wrapper trains like one process. A tensor outside
the model given to the optimizer would train on each rank's own gradient
(blocking) or never be updated (non-blocking, whose update goes bucket by
bucket): step() raises.

Each rank trains on its own slice of every batch; the reference is one
process on the whole batch (tests/support/dp_reference.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import mpidp
from dp_reference import (RANK, SIZE, assert_params_close, assert_same_on_all_ranks, build,
                          classification_batch, per_node_options, rank_slice, seeded,
                          step_like_one_process)
from test_rewrap import MLP   # l1: 6 -> 16, l2: 16 -> 3


NOT_AVERAGED = ("'{}.weight', '{}.bias' require grad but were not trainable parameters of the "
                "model when {} was set up")
FROZEN = NOT_AVERAGED.replace("{}", "l1", 2)


def batch(gen):
    """A global batch for the MLP (6 inputs, 3 classes) drawn from `gen`."""
    return classification_batch(gen, 4 * SIZE, (6, 3))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def frozen_pair(seed=100):
    """A model with l1 frozen (each rank's own initial values: the wrappers
    adopt rank 0's) and its single-process reference, from `seed`."""
    model, reference = build(MLP, seed + RANK), build(MLP, seed)
    for m in (model, reference):
        m.l1.requires_grad_(False)
    return model, reference


def unfreeze(model, opt):
    model.l1.requires_grad_(True)
    opt.add_param_group({"params": list(model.l1.parameters())})


def wrap(model, opt, blocking):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # "already wrapped" on the second wrapper
        return mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=blocking)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_dataparallel_refuses_an_unfrozen_parameter_and_a_new_wrapper_trains_it(blocking):
    model, reference = frozen_pair()
    opt = mpidp.DataParallelOptimizer(sgd([p for p in model.parameters() if p.requires_grad]))
    ref_opt = sgd([p for p in reference.parameters() if p.requires_grad])
    net = wrap(model, opt, blocking)
    gen = seeded(7)
    for _ in range(2):
        step_like_one_process(net, opt, reference, ref_opt, *batch(gen))
    unfreeze(model, opt.torch_optimizer)
    unfreeze(reference, ref_opt)
    X, Y = classification_batch(gen, 4 * SIZE, (6, 3))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=FROZEN.format("DataParallel")):
        net(rank_slice(X))
    # Refused before anything ran: a non-blocking update still pending was not applied.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    net.eval()
    with torch.no_grad():
        net(rank_slice(X))                    # evaluation does not average: no error
    net.train()
    net = wrap(model, opt, blocking)          # the advice: set DataParallel up again
    step_like_one_process(net, opt, reference, ref_opt, X, Y)
    for _ in range(2):
        step_like_one_process(net, opt, reference, ref_opt, *batch(gen))
    net.synchronize()
    assert_params_close(model, reference, what="after unfreezing and wrapping again")
    assert_same_on_all_ranks(model)
    assert all(p.grad is not None for p in model.l1.parameters())


def new_head(model):
    torch.manual_seed(50)                     # the same new head on every rank
    model.l2 = torch.nn.Linear(16, 3)
    return list(model.l2.parameters())


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_dataparallel_refuses_a_parameter_added_after_set_up(blocking):
    """A new head (model.l2 = nn.Linear(...)) after wrapping: refused, then
    trained like one process by a new wrapper."""
    model, reference = build(MLP, 400 + RANK), build(MLP, 400)
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    ref_opt = sgd(reference.parameters())
    net = wrap(model, opt, blocking)
    gen = seeded(14)
    step_like_one_process(net, opt, reference, ref_opt, *batch(gen))
    net.synchronize()
    opt.torch_optimizer.add_param_group({"params": new_head(model)})
    ref_opt.add_param_group({"params": new_head(reference)})
    X, Y = classification_batch(gen, 4 * SIZE, (6, 3))
    with pytest.raises(RuntimeError, match=NOT_AVERAGED.format("l2", "l2", "DataParallel")):
        net(rank_slice(X))
    net = wrap(model, opt, blocking)
    step_like_one_process(net, opt, reference, ref_opt, X, Y)
    step_like_one_process(net, opt, reference, ref_opt, *batch(gen))
    net.synchronize()
    assert_params_close(model, reference, what="after a new head and wrapping again")
    assert_same_on_all_ranks(model)


def test_a_frozen_parameter_added_after_set_up_is_watched_too():
    model = build(MLP, 500 + RANK)
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    net = wrap(model, opt, True)
    head = new_head(model)
    model.l2.requires_grad_(False)
    x, y = classification_batch(seeded(15), 4 * SIZE, (6, 3))
    train_step(net, opt, x, y)                # frozen: nothing to average, no error
    model.l2.requires_grad_(True)
    opt.torch_optimizer.add_param_group({"params": head})
    with pytest.raises(RuntimeError, match=NOT_AVERAGED.format("l2", "l2", "DataParallel")):
        net(rank_slice(x))


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_dataparallel_freezing_later_trains_like_one_process(blocking):
    """Parameters frozen after set-up keep their values and get no gradient,
    momentum and weight decay included, as in one process."""
    model, reference = build(MLP, 200 + RANK), build(MLP, 200)
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    ref_opt = sgd(reference.parameters())
    net = wrap(model, opt, blocking)
    gen = seeded(8)
    for step in range(4):
        if step == 2:
            for m in (model, reference):
                m.l1.requires_grad_(False)
        step_like_one_process(net, opt, reference, ref_opt, *batch(gen))
    net.synchronize()
    assert_params_close(model, reference, what="after freezing l1 at step 2")
    assert_same_on_all_ranks(model)


def test_trainable_from_the_start_and_added_to_the_optimizer_later():
    """The other way the error names: the parameters stay trainable, out of
    the optimizer until they should train."""
    model, reference = build(MLP, 300 + RANK), build(MLP, 300)
    opt = mpidp.DataParallelOptimizer(sgd(model.l2.parameters()))
    ref_opt = sgd(reference.l2.parameters())
    net = wrap(model, opt, True)
    gen = seeded(9)
    for step in range(4):
        if step == 2:
            opt.torch_optimizer.add_param_group({"params": list(model.l1.parameters())})
            ref_opt.add_param_group({"params": list(reference.l1.parameters())})
        step_like_one_process(net, opt, reference, ref_opt, *batch(gen))
    assert_params_close(model, reference, what="after adding l1 to the optimizer at step 2")
    assert_same_on_all_ranks(model)


def train_step(net, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(net(rank_slice(x)), rank_slice(y)).backward()
    opt.step()


def test_with_bagua_refuses_and_switching_again_sets_it_up():
    model, _ = frozen_pair()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    algorithm = mpidp.algorithms.DecentralizedAlgorithm(hierarchical=False)
    net = mpidp.with_bagua(model, [opt], algorithm)
    gen = seeded(10)
    train_step(net, opt, *classification_batch(gen, 4 * SIZE, (6, 3)))
    unfreeze(model, opt)
    x, y = classification_batch(gen, 4 * SIZE, (6, 3))
    with pytest.raises(RuntimeError, match=FROZEN.format("with_bagua")):
        net(rank_slice(x))
    net = mpidp.with_bagua(net, [opt], algorithm)
    train_step(net, opt, x, y)
    assert all(p.grad is not None for p in model.l1.parameters())


def test_slowmo_refuses_an_unfrozen_parameter():
    model, _ = frozen_pair()
    net = mpidp.SlowMoDistributedDataParallel(model, nprocs_per_node=1, slowmo_momentum=0.5,
                                              localsgd_frequency=2)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    gen = seeded(11)
    x, y = classification_batch(gen, 4 * SIZE, (6, 3))
    train_step(net, opt, x, y)
    net.perform_slowmo(opt)
    unfreeze(model, opt)
    with pytest.raises(RuntimeError, match=FROZEN.format("SlowMoDistributedDataParallel")):
        net(rank_slice(x))


def test_diloco_refuses_an_unfrozen_parameter_at_the_inner_step():
    model, _ = frozen_pair()
    trainable = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.SGD(trainable, lr=0.1)
    outer = torch.optim.SGD(trainable, lr=0.7, momentum=0.9, nesterov=True)
    gen = seeded(12)
    with mpidp.DiLoCo(model, inner, outer, sync_every=2):
        train_step(model, inner, *classification_batch(gen, 4 * SIZE, (6, 3)))
        unfreeze(model, inner)
        with pytest.raises(RuntimeError, match=FROZEN.format("DiLoCo")):
            train_step(model, inner, *classification_batch(gen, 4 * SIZE, (6, 3)))


@pytest.mark.parametrize("per_node", per_node_options())
def test_daso_refuses_an_unfrozen_parameter_at_step(per_node, monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", str(per_node))
    model, _ = frozen_pair()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    daso = mpidp.DASO(opt, total_epochs=4, warmup_epochs=1, cooldown_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # one rank per node: no node-local DDP
        net = mpidp.DataParallelMultiGPU(model, daso)
    daso.last_batch = 3
    gen = seeded(13)
    x, y = classification_batch(gen, 4 * SIZE, (6, 3))
    train_step(net, daso, x, y)
    unfreeze(model, opt)
    daso.zero_grad()
    F.cross_entropy(net(rank_slice(x)), rank_slice(y)).backward()
    with pytest.raises(RuntimeError, match=FROZEN.format("DASO")):
        daso.step()
    # The advice: a new DataParallelMultiGPU calls set_model again; the
    # epoch's last batch then averages every rank's l1 too.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = mpidp.DataParallelMultiGPU(model, daso)
    l1_before = model.l1.weight.detach().clone()
    for _ in range(3):
        train_step(net, daso, *classification_batch(gen, 4 * SIZE, (6, 3)))
    assert not torch.equal(model.l1.weight, l1_before)
    assert_same_on_all_ranks(model)


def test_converting_the_model_after_wrapping_is_named_and_a_new_wrapper_trains_it():
    model, reference = build(MLP, 600 + RANK), build(MLP, 600)
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    net = wrap(model, opt, True)
    model.double()
    reference.double()
    ref_opt = sgd(reference.parameters())
    X, Y = classification_batch(seeded(16), 4 * SIZE, (6, 3))
    with pytest.raises(RuntimeError, match="parameter 'l1.weight' \\(and 3 more\\) is now "
                                           "torch.float64 on cpu, but DataParallel was set up "
                                           "with torch.float32"):
        net(rank_slice(X).double())
    net = wrap(model, opt, True)
    gen = seeded(17)
    for _ in range(2):
        X, Y = classification_batch(gen, 4 * SIZE, (6, 3))
        step_like_one_process(net, opt, reference, ref_opt, X.double(), Y)
    assert_params_close(model, reference, what="after model.double() and wrapping again")
    assert_same_on_all_ranks(model)


class Scaled(torch.nn.Module):
    """MLP whose logits are multiplied by a learnable temperature: a
    parameter of the model when `own` (averaged), else a tensor outside it."""

    def __init__(self, own=True):
        super().__init__()
        self.mlp = MLP()
        temperature = torch.ones(1, requires_grad=True)
        if own:
            self.temperature = torch.nn.Parameter(temperature)
        else:
            self.outside = [temperature]

    def forward(self, x):
        t = self.temperature if hasattr(self, "temperature") else self.outside[0]
        return self.mlp(x) * t


@pytest.mark.parametrize("how", ["blocking", "non-blocking", "plain-optimizer"])
def test_a_tensor_outside_the_model_in_the_optimizer_is_refused(how):
    """A learnable tensor outside the model, given to the optimizer after
    set-up: non-blocking mode would never update it (its step goes bucket by
    bucket); blocking mode, and a plain torch optimizer stepped directly,
    used to step it on each rank's own gradient (the ranks drifted 5.7e-3
    apart in a few steps). Every mode raises at step(), before any update."""
    torch.manual_seed(800 + RANK)
    model = Scaled(own=False)
    temperature = model.outside[0]
    if how == "plain-optimizer":
        opt = sgd(model.parameters())
        net = mpidp.DataParallel(model)
    else:
        opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
        net = wrap(model, opt, how == "blocking")
    (opt if how == "plain-optimizer" else opt.torch_optimizer).add_param_group(
        {"params": [temperature]})
    before = [p.detach().clone() for p in model.parameters()]
    x, y = classification_batch(seeded(20), 4 * SIZE, (6, 3))
    opt.zero_grad()
    F.cross_entropy(net(rank_slice(x)), rank_slice(y)).backward()
    words = ("holds tensor\\(s\\) that are not parameters DataParallel averages"
             if how == "non-blocking" else
             "steps tensor\\(s\\) with gradients that are not parameters of the wrapped "
             "model \\(param group 1 \\[0\\] \\(shape \\[1\\]\\)\\)")
    with pytest.raises(RuntimeError, match=words):
        opt.step()
    assert temperature.item() == 1.0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_the_same_temperature_as_a_parameter_of_the_model_trains_like_one_process(blocking):
    """The error's advice: a parameter of the model is averaged."""
    torch.manual_seed(801)
    reference = Scaled(own=True)
    model = Scaled(own=True)
    model.load_state_dict(reference.state_dict())
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    net = wrap(model, opt, blocking)
    ref_opt = sgd(reference.parameters())
    gen = seeded(21)
    for _ in range(4):
        x, y = classification_batch(gen, 4 * SIZE, (6, 3))
        step_like_one_process(net, opt, reference, ref_opt, x, y)
    net.synchronize()
    assert model.temperature.item() != 1.0
    assert_params_close(model, reference)
    assert_same_on_all_ranks(model)


def test_add_param_group_of_the_dataparallel_optimizer_trains_like_one_process():
    """Fine-tuning's habit: the head trains from the start, the body's
    layer is added to the optimizer later with add_param_group (torch's
    optimizers have it; DataParallelOptimizer had none)."""
    torch.manual_seed(802)
    reference = MLP()
    model = MLP()
    model.load_state_dict(reference.state_dict())
    opt = mpidp.DataParallelOptimizer(sgd(model.l2.parameters()))
    net = mpidp.DataParallel(model, optimizer=opt)
    ref_opt = sgd(reference.l2.parameters())
    gen = seeded(22)
    for step in range(5):
        if step == 2:
            opt.add_param_group({"params": list(model.l1.parameters()), "lr": 0.02})
            ref_opt.add_param_group({"params": list(reference.l1.parameters()), "lr": 0.02})
            assert len(opt.param_groups) == 2 and opt.defaults == ref_opt.defaults
        x, y = classification_batch(gen, 4 * SIZE, (6, 3))
        step_like_one_process(net, opt, reference, ref_opt, x, y)
    net.synchronize()
    assert_params_close(model, reference)
    assert_same_on_all_ranks(model)
