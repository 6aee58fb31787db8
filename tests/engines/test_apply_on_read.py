"""Non-blocking DataParallel: parameters read between optimizer.step() and the
next forward see the update of that step.

step() only marks the update as due; every read through the module's API
before the forward that would apply it (an EMA, a regulariser built from
model.parameters(), a model method reading a parameter, named_parameters,
state_dict, attribute access) must see the applied update. Each test trains
the wrapped model and a one-process reference side by side on different data
per rank and compares what the habit reads at every step."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel

from dp_reference import (SIZE, assert_params_close, assert_same_on_all_ranks,
                          classification_batch, data_parallel_and_reference, rank_slice,
                          reference_step, seeded)
from dp_reference import MLP, sgd

pytestmark = pytest.mark.ranks3


class Scaled(torch.nn.Module):
    """An MLP with a top-level parameter that a method reads before any
    submodule runs (only=True: that parameter is the model's only one)."""

    def __init__(self, only=False):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([1.5]))
        self.body = None if only else MLP()

    def penalty(self):
        return (self.scale - 1).pow(2).sum()

    def forward(self, x, **_):
        out = self.body(x) if self.body is not None else x[:, :4]
        return out * self.scale


def nonblocking(make_model=MLP, seed=100):
    model, net, opt, reference, ref_opt = data_parallel_and_reference(make_model, sgd, seed,
                                                                      False)
    assert not net.blocking_parameter_updates
    return model, net, opt, reference, ref_opt


def train(net, opt, reference, ref_opt, steps, after_step=None, loss_extra=None, seed=1):
    """`steps` steps of both; after_step(t) runs after both optimizers
    stepped (the wrapped model's update is then still pending), and
    loss_extra(model) is added to each rank's loss (and to each slice loss of
    the reference) before backward, computed before the forward."""
    g = seeded(seed)
    for t in range(steps):
        X, Y = classification_batch(g, 4 * SIZE)
        opt.zero_grad()
        ref_opt.zero_grad()
        extra = loss_extra(net.module) if loss_extra else 0.0
        (F.cross_entropy(net(rank_slice(X)), rank_slice(Y)) + extra).backward()

        def ref_loss(model, x, y, _rank=None):
            return F.cross_entropy(model(x), y) + (loss_extra(model) if loss_extra else 0.0)
        reference_step(reference, X, Y, ref_loss)
        opt.step()
        ref_opt.step()
        if after_step is not None:
            after_step(t)


def test_an_averaged_model_updated_after_each_step_follows_the_reference():
    model, net, opt, reference, ref_opt = nonblocking()
    ema, ref_ema = AveragedModel(model), AveragedModel(reference)

    def update(t):
        ema.update_parameters(model)
        ref_ema.update_parameters(reference)
        assert_params_close(ema.module, ref_ema.module, what=f"EMA after step {t}")

    train(net, opt, reference, ref_opt, 4, after_step=update)
    assert_same_on_all_ranks(ema.module)


@pytest.mark.parametrize("penalty", ["ewc", "l2"])
def test_a_regulariser_built_from_parameters_before_the_forward_trains_like_one_process(penalty):
    """An EWC-style ((p - p0)^2) or plain p.pow(2) penalty over
    model.parameters(), computed before the forward (the L2 one used to hit
    torch's in-place error on some ranks only)."""
    model, net, opt, reference, ref_opt = nonblocking()
    anchor = [p.detach().clone() for p in reference.parameters()]

    def extra(m):
        if penalty == "ewc":
            return 0.1 * sum(((p - q) ** 2).sum() for p, q in zip(m.parameters(), anchor))
        return 1e-2 * sum(p.pow(2).sum() for p in m.parameters())

    train(net, opt, reference, ref_opt, 4, loss_extra=extra,
          after_step=lambda t: assert_params_close(model, reference, what=f"step {t}"))
    assert_same_on_all_ranks(model)


@pytest.mark.parametrize("only", [False, True], ids=["with-submodules", "only-parameter"])
def test_a_method_reading_a_top_level_parameter_sees_the_update(only):
    """Such a read happens before any layer's forward applies anything; with
    the top-level parameter alone, the update used to be never applied and
    the next step() said it was called twice."""
    model, net, opt, reference, ref_opt = nonblocking(lambda: Scaled(only))
    readings = []

    def read(t):
        mine, theirs = model.penalty(), reference.penalty()
        readings.append(mine.item())
        assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-7), f"step {t}"

    train(net, opt, reference, ref_opt, 4, after_step=read)
    assert len(set(readings)) == 4      # the parameter moved at every step
    assert_params_close(model, reference)


@pytest.mark.parametrize("read", ["named_parameters", "parameters", "state_dict", "attribute",
                                  "getattr", "inner_state_dict_of_a_layer"])
def test_every_read_through_the_module_api_sees_the_update(read):
    model, net, opt, reference, ref_opt = nonblocking()

    def values(m):
        if read == "named_parameters":
            return [p.detach().clone() for _, p in m.named_parameters()]
        if read == "parameters":
            return [p.detach().clone() for p in m.parameters()]
        if read == "state_dict":
            return [v.clone() for v in m.state_dict().values()]
        if read == "attribute":
            return [m.l2.weight.detach().clone()]
        if read == "getattr":
            return [getattr(m.l3, "bias").detach().clone()]
        return [v.clone() for v in m.l1.state_dict().values()]

    def compare(t):
        for mine, theirs in zip(values(model), values(reference)):
            assert torch.allclose(mine, theirs, rtol=1e-4, atol=2e-5), f"{read} after step {t}"

    train(net, opt, reference, ref_opt, 3, after_step=compare)


def test_zero_grad_of_the_wrapper_keeps_the_update_pending_and_training_exact():
    """Clearing gradients reads no values: net.zero_grad() between step() and
    the forward leaves the update to the forward (its overlap kept)."""
    model, net, opt, reference, ref_opt = nonblocking()
    pending = []

    def clear(t):
        net.zero_grad()
        pending.append(opt.update_next)

    train(net, opt, reference, ref_opt, 3, after_step=clear)
    assert pending == [True] * 3
    net.synchronize()
    assert_params_close(model, reference)


def test_a_copy_of_the_model_taken_after_a_step_holds_that_step():
    """copy.deepcopy reads every parameter (a best-model snapshot)."""
    model, net, opt, reference, ref_opt = nonblocking()
    snapshots = []
    train(net, opt, reference, ref_opt, 3,
          after_step=lambda t: snapshots.append((copy.deepcopy(model),
                                                 copy.deepcopy(reference))))
    for t, (mine, theirs) in enumerate(snapshots):
        assert_params_close(mine, theirs, what=f"copy after step {t}")
        assert type(mine.l1.__dict__["_parameters"]) is dict, "the copy carries mpidp's dict"
