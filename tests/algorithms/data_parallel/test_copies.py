"""Whole-model saves and deep copies after wrapping, for every algorithm.

torch.save(model) used to fail with "cannot pickle 'weakref.ReferenceType'"
(and a rank-0-only save aborted the job), and copy.deepcopy(model) carried
mpidp's hooks, so the copy's forward drove the original wrapper. Now the
inner model pickles and copies as if mpidp had never touched it, and a
wrapper pickles and copies as a WrapperCopy of its model (evaluation and
inference; a training forward raises). Each test trains a while, copies on
rank 0 alone, trains the copy there alone (a copy that still communicated
would hang or desynchronise the job), and checks that training of the
original goes on as before."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import mpidp
from dp_reference import (RANK, SIZE, assert_params_close, assert_same_on_all_ranks, build,
                          classification_batch, rank_slice, seeded, train_like_one_process)
from test_data_parallel import MLP, sgd

pytestmark = pytest.mark.ranks3


def make_dp(mode):
    model = build(MLP, 100 + RANK)
    if mode == "ddp-style":
        opt = sgd(model.parameters())
        return model, mpidp.DataParallel(model), opt
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    return model, mpidp.DataParallel(model, optimizer=opt,
                                     blocking_parameter_updates=mode == "blocking"), opt


def make_daso(_):
    model = build(MLP, 100 + RANK)
    daso = mpidp.DASO(sgd(model.parameters()), total_epochs=2, warmup_epochs=1)
    daso.last_batch = 100
    return model, mpidp.DataParallelMultiGPU(model, daso), daso


def make_slowmo(_):
    model = build(MLP, 100 + RANK)
    net = mpidp.SlowMoDistributedDataParallel(model, localsgd_frequency=2)
    return model, net, sgd(net.parameters())


def make_bagua(algorithm):
    model = build(MLP, 100 + RANK)
    opt = sgd(model.parameters())
    return model, mpidp.with_bagua(model, [opt], getattr(mpidp.algorithms, algorithm)()), opt


FAMILY = [(make_dp, "blocking"), (make_dp, "non-blocking"), (make_dp, "ddp-style"),
          (make_daso, None), (make_slowmo, None),
          (make_bagua, "GradientAllReduceAlgorithm"), (make_bagua, "ByteGradAlgorithm"),
          (make_bagua, "DecentralizedAlgorithm"),
          (make_bagua, "LowPrecisionDecentralizedAlgorithm")]
IDS = [f"{make.__name__[5:]}-{arg}" if arg else make.__name__[5:] for make, arg in FAMILY]


def train_steps(net, opt, steps, g):
    for _ in range(steps):
        X, Y = classification_batch(g, 4 * SIZE)
        opt.zero_grad()
        F.cross_entropy(net(rank_slice(X)), rank_slice(Y)).backward()
        opt.step()
        if isinstance(net, mpidp.SlowMoDistributedDataParallel):
            net.perform_slowmo(opt)


def saved_and_loaded(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def assert_plain(model, what):
    """Nothing of mpidp on `model` and its submodules: no hook, no dict of
    mpidp's, no instance-level __getstate__."""
    for name, m in model.named_modules():
        assert type(m.__dict__["_parameters"]) is dict, f"{what}: {name}._parameters"
        assert "__getstate__" not in m.__dict__, f"{what}: {name}.__getstate__"
        for attr, value in m.__dict__.items():
            if "hooks" in attr and isinstance(value, dict):
                assert not value, f"{what}: {name}.{attr} = {dict(value)}"


def train_alone(copied, x):
    """One plain local step of `copied`, checked against the same step by
    hand: nothing averaged, nothing sent."""
    expected = copy.deepcopy(copied)
    for m, lr in ((copied, 0.1), (expected, 0.1)):
        m.zero_grad()
        F.cross_entropy(m(x), torch.zeros(len(x), dtype=torch.long)).backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= lr * p.grad
    assert_params_close(copied, expected, atol=0, rtol=0, what="copy trained alone")


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
@pytest.mark.parametrize("make, arg", FAMILY, ids=IDS)
def test_the_model_saves_and_copies_as_plain_torch_and_stays_apart(make, arg, how):
    model, net, opt = make(arg)
    g = seeded(4)
    train_steps(net, opt, 2, g)
    if RANK == 0:
        copied = saved_and_loaded(model) if how == "torch.save" else copy.deepcopy(model)
        assert type(copied) is MLP
        assert_plain(copied, "copy of the model")
        assert_params_close(copied, model, atol=0, rtol=0, what="copy")
        train_alone(copied, torch.randn(3, 10))
    train_steps(net, opt, 2, g)
    if isinstance(net, mpidp.DataParallel):
        net.synchronize()
    if arg not in ("DecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithm") \
            and make is not make_slowmo:
        assert_same_on_all_ranks(model)


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
@pytest.mark.parametrize("make, arg", FAMILY, ids=IDS)
def test_a_wrapper_saves_and_copies_as_a_wrapper_copy_for_evaluation(make, arg, how):
    model, net, opt = make(arg)
    train_steps(net, opt, 2, seeded(5))
    if RANK == 0:
        copied = saved_and_loaded(net) if how == "torch.save" else copy.deepcopy(net)
        assert isinstance(copied, mpidp.WrapperCopy) and copied.copy_of == type(net).__name__
        assert_plain(copied.module, "copy of the wrapper")
        assert_params_close(copied.module, model, atol=0, rtol=0, what="wrapper copy")
        x = torch.randn(3, 10)
        with torch.no_grad():   # the original's training forward is collective
            expected = model(x)
            assert torch.equal(copied(x), expected)
        copied.eval()
        assert torch.equal(copied(x), expected)
        copied.train()
        with pytest.raises(RuntimeError, match=rf"copy of a mpidp\.{type(net).__name__}.*"
                                               r"wrapping its model again"):
            copied(x)
        assert set(copied.state_dict()) == {f"module.{k}" for k in model.state_dict()}
    train_steps(net, opt, 1, seeded(6))


def test_a_copy_of_the_inner_model_trains_like_one_process_when_wrapped_again():
    """The copy is a model like any other: DataParallel(copy) trains it like
    one process, and the original's wrapper is left as it was."""
    model, net, opt = make_dp("non-blocking")
    train_steps(net, opt, 2, seeded(7))
    twin = copy.deepcopy(model)
    reference = copy.deepcopy(twin)
    twin_opt = mpidp.DataParallelOptimizer(sgd(twin.parameters()))
    twin_net = mpidp.DataParallel(twin, optimizer=twin_opt)
    train_like_one_process(twin_net, twin_opt, twin, reference, sgd(reference.parameters()),
                           lambda m, x, y, _r=None: F.cross_entropy(m(x), y), (10, 4), seed=8)
    train_steps(net, opt, 1, seeded(9))
    net.synchronize()
    assert_same_on_all_ranks(model)
