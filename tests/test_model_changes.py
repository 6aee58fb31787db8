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
clear error, then a new wrapper trains like one process. A tensor given to
a non-blocking DataParallel's optimizer after set-up would never be updated
(the update goes bucket by bucket): step() raises.

Each rank trains on its own slice of every batch; the reference is one
process on the whole batch (tests/dp_reference.py).
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


def test_nonblocking_refuses_a_tensor_given_to_the_optimizer_after_set_up():
    """Non-blocking updates are applied bucket by bucket: a tensor outside
    the model given to the optimizer later (a learnable temperature) would
    never be updated, so step() raises; blocking mode steps it."""
    for blocking in (False, True):
        model = build(MLP, 800 + RANK)
        opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
        net = wrap(model, opt, blocking)
        scale = torch.ones(1, requires_grad=True)
        opt.torch_optimizer.add_param_group({"params": [scale]})
        x, y = classification_batch(seeded(20), 4 * SIZE, (6, 3))
        opt.zero_grad()
        F.cross_entropy(net(rank_slice(x)) * scale, rank_slice(y)).backward()
        if blocking:
            opt.step()
            assert scale.item() != 1.0
        else:
            with pytest.raises(RuntimeError, match="holds 1 tensor\\(s\\) that are not parameters "
                                                   "DataParallel averages"):
                opt.step()
