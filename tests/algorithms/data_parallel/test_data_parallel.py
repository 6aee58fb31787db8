"""Blocking DataParallel against a single-process reference.

Rank-agnostic: at 1, 2 and 4 ranks each rank trains on its own slice of every
global batch, starting from a different random init (DataParallel must adopt
rank 0's); a single process trains the same model on whole batches. After
every backward the averaged gradients must equal the reference's (including
which are None), and after every step the parameters must too."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import mpidp
from dp_reference import (DEVICE, MLP, RANK, SIZE, assert_params_close, assert_same_on_all_ranks,
                          build, cross_entropy, data_parallel_and_reference, on_device, rank_slice,
                          reference_step, seeded, sgd)

# --- models ------------------------------------------------------------------


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(1, 6, 3)
        self.c2 = torch.nn.Conv2d(6, 8, 3)
        self.fc = torch.nn.Linear(8 * 2 * 2, 4)

    def forward(self, x, **_):
        x = F.max_pool2d(torch.relu(self.c1(x)), 2)
        x = F.adaptive_avg_pool2d(torch.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


class ManySmall(torch.nn.Module):
    """500 parameter tensors: 250 small linear branches summed."""

    def __init__(self):
        super().__init__()
        self.branches = torch.nn.ModuleList(torch.nn.Linear(10, 4) for _ in range(250))

    def forward(self, x, **_):
        return sum(b(x) for b in self.branches) / 50


class Tied(torch.nn.Module):
    """One block applied twice, and an output layer sharing the input weight."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(10, 16)
        self.block = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, **_):
        h = torch.tanh(self.block(torch.tanh(self.block(torch.relu(self.inp(x))))))
        back = F.linear(h, self.inp.weight.t())          # tied to inp.weight: (N, 10)
        return self.head(h) + back[:, :4]


class Branchy(torch.nn.Module):
    """`extra` is used only in some steps and on some ranks; `never` never."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(10, 16)
        self.out = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(16, 4)
        self.never = torch.nn.Linear(16, 4)

    def forward(self, x, use_extra=False, **_):
        h = torch.relu(self.body(x))
        y = self.out(h)
        return y + self.extra(h) if use_extra else y


def frozen_mlp():
    m = MLP()
    m.l1.requires_grad_(False)
    return m


# --- the comparison ------------------------------------------------------------


def ce_loss(model, x, y, rank, step):
    return F.cross_entropy(model(x), y)


def branchy_loss(model, x, y, rank, step):
    # Rank-dependent use: on some steps only even ranks touch `extra`.
    use = (step % 3 == 0) or (step % 3 == 1 and rank % 2 == 0)
    return F.cross_entropy(model(x, use_extra=use), y)


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def assert_grads_match(model, reference, step):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert (p.grad is None) == (q.grad is None), (
            f"step {step}: {name}.grad is {'None' if p.grad is None else 'set'} here, "
            f"{'None' if q.grad is None else 'set'} in the reference")
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), (
                f"step {step}: {name}.grad differs by {(p.grad - q.grad).abs().max().item():.3g}")


def train_and_compare(make_model, make_opt=sgd, loss_fn=ce_loss, x_shape=(10,), steps=4,
                      per_rank=6, zero_grad="none", accumulate=1, seed=0):
    model = build(make_model, seed=100 + RANK)      # every rank starts different
    reference = build(make_model, seed=100)         # ... and rank 0's is the one kept
    dp_opt = mpidp.DataParallelOptimizer(make_opt([p for p in model.parameters() if p.requires_grad]))
    net = mpidp.DataParallel(model, optimizer=dp_opt, blocking_parameter_updates=True)
    ref_opt = make_opt([p for p in reference.parameters() if p.requires_grad])
    assert_params_close(model, reference, atol=0, rtol=0, what="after construction")
    g = seeded(seed)
    n = per_rank * SIZE
    for step in range(steps):
        if zero_grad in ("none", "zeros"):
            dp_opt.zero_grad(set_to_none=zero_grad == "none")
            ref_opt.zero_grad(set_to_none=zero_grad == "none")
        for micro in range(accumulate):
            X, Y = on_device(torch.randn(n, *x_shape, generator=g),
                             torch.randint(0, 4, (n,), generator=g))
            loss = loss_fn(net, rank_slice(X), rank_slice(Y), RANK, step)
            if zero_grad == "after_forward" and micro == 0:
                dp_opt.zero_grad()
                ref_opt.zero_grad()
            loss.backward()
            reference_step(reference, X, Y, lambda m, x, y, r: loss_fn(m, x, y, r, step))
        assert_grads_match(model, reference, step)
        dp_opt.step()
        ref_opt.step()
        assert_params_close(model, reference, what=f"step {step}")
    assert_same_on_all_ranks(model)
    return net


def train_with_habits(habit, blocking=True, steps=4, per_rank=6):
    """DataParallel with what users do between backward and step -- gradient
    clipping, or AMP's GradScaler (scale, unscale_, clip, step, update) --
    against one process doing the same on the whole batch. Non-blocking mode
    needs the averaged gradients in .grad first: optimizer.synchronize() for
    clipping (Horovod's pattern), and GradScaler through the
    DataParallelOptimizer, which synchronizes by itself."""
    model, net, dp_opt, reference, ref_opt = data_parallel_and_reference(MLP, sgd, 100, blocking)
    scalers = [torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 10) for _ in range(2)] \
        if habit.startswith("amp") else None
    # Blocking mode may hand the torch optimizer to the scaler; non-blocking
    # mode needs the wrapper (it is what knows the gradients are not in yet).
    scaled_opt = dp_opt.torch_optimizer if blocking else dp_opt
    g = seeded(1)
    n = per_rank * SIZE
    for step in range(steps):
        X, Y = on_device(torch.randn(n, 10, generator=g), torch.randint(0, 4, (n,), generator=g))
        dp_opt.zero_grad()
        ref_opt.zero_grad()
        loss = F.cross_entropy(net(rank_slice(X)), rank_slice(Y))
        ref_loss = sum(F.cross_entropy(reference(rank_slice(X, r, SIZE)), rank_slice(Y, r, SIZE))
                       for r in range(SIZE)) / SIZE
        if scalers:
            scalers[0].scale(loss).backward()
            scalers[1].scale(ref_loss).backward()
        else:
            loss.backward()
            ref_loss.backward()
            if not blocking:
                dp_opt.synchronize()
        if habit != "amp-step-only":
            if scalers:
                scalers[0].unscale_(scaled_opt)
                scalers[1].unscale_(ref_opt)
            assert_grads_match(model, reference, step)
            # A norm far below the gradients' own: clipping changes every step.
            norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05) for m in (model, reference)]
            assert torch.allclose(norms[0], norms[1], rtol=1e-4), norms
        if scalers:
            scalers[0].step(scaled_opt)
            scalers[1].step(ref_opt)
            for sc in scalers:
                sc.update()
        else:
            dp_opt.step()
            ref_opt.step()
        assert_params_close(model, reference, what=f"{habit}, step {step}")
    assert_same_on_all_ranks(model)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
@pytest.mark.parametrize("habit", ["clip", "amp", "amp-step-only"])
def test_clipping_and_grad_scaler_between_backward_and_step(habit, blocking):
    train_with_habits(habit, blocking)


def nonblocking_after_backward(scaler=None):
    model = build(MLP, 100 + RANK)
    dp_opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=dp_opt, blocking_parameter_updates=False)
    x, y = on_device(torch.randn(4, 10), torch.randint(0, 4, (4,)))
    loss = F.cross_entropy(net(x), y)
    (scaler.scale(loss) if scaler else loss).backward()
    return model, dp_opt


def test_nonblocking_edit_without_synchronize_raises_instead_of_being_lost():
    model, dp_opt = nonblocking_after_backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # on the zeros .grad holds now
    with pytest.raises(RuntimeError, match=r"changed in place between backward\(\) and "
                                           r"optimizer.step\(\).*optimizer.synchronize\(\)"):
        dp_opt.step()


def test_nonblocking_stepping_the_torch_optimizer_directly_raises():
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=4.0)
    model, dp_opt = nonblocking_after_backward(scaler)
    with pytest.raises(RuntimeError, match=r"torch optimizer was stepped directly.*scaler.step\(dp_opt\)"):
        scaler.step(dp_opt.torch_optimizer)


@pytest.mark.parametrize("make_opt", [sgd, adam], ids=["sgd-momentum", "adam"])
def test_mlp(make_opt):
    train_and_compare(MLP, make_opt)


@pytest.mark.parametrize("make_opt", [sgd, adam], ids=["sgd-momentum", "adam"])
def test_cnn(make_opt):
    train_and_compare(CNN, make_opt, x_shape=(1, 12, 12))


def test_500_small_parameter_tensors():
    net = train_and_compare(ManySmall, steps=3)
    assert len(list(net.parameters())) == 500


def test_frozen_parameters_stay_frozen_and_equal():
    net = train_and_compare(frozen_mlp)
    frozen = build(frozen_mlp, seed=100)  # rank 0's init: broadcast, never updated
    assert torch.equal(net.module.l1.weight, frozen.l1.weight)
    assert net.module.l1.weight.grad is None


def test_tied_parameters():
    train_and_compare(Tied)


@pytest.mark.parametrize("zero_grad", ["none", "zeros", "after_forward"])
def test_parameter_unused_in_some_steps_and_ranks(zero_grad):
    net = train_and_compare(Branchy, loss_fn=branchy_loss, steps=6, zero_grad=zero_grad)
    if zero_grad != "zeros":
        assert net.module.never.weight.grad is None


@pytest.mark.parametrize("zero_grad", ["none", "zeros", "after_forward"])
def test_zero_grad_modes(zero_grad):
    train_and_compare(MLP, zero_grad=zero_grad)


@pytest.mark.parametrize("make_opt", [sgd, adam], ids=["sgd-momentum", "adam"])
def test_gradient_accumulation(make_opt):
    train_and_compare(MLP, make_opt, accumulate=3)


def test_without_optimizer_gradients_are_averaged():
    model = build(MLP, seed=7 + RANK)
    reference = build(MLP, seed=7)
    net = mpidp.DataParallel(model, blocking_parameter_updates=True)
    X, Y = on_device(torch.randn(4 * SIZE, 10, generator=seeded(3)),
                     torch.randint(0, 4, (4 * SIZE,), generator=seeded(4)))
    F.cross_entropy(net(rank_slice(X)), rank_slice(Y)).backward()
    reference_step(reference, X, Y, cross_entropy)
    assert_grads_match(model, reference, 0)


def test_ddp_style_wrapping_chooses_the_mode_without_a_warning():
    """DataParallel(model) with no optimizer (torch DDP's habit) is blocking,
    silently; with one DataParallelOptimizer it is non-blocking (Heat's
    default); asking for non-blocking where it cannot work still warns."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net = mpidp.DataParallel(build(MLP, seed=7))
    assert net.blocking_parameter_updates
    model = build(MLP, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net = mpidp.DataParallel(model, optimizer=mpidp.DataParallelOptimizer(sgd(model.parameters())))
    assert not net.blocking_parameter_updates
    with pytest.warns(UserWarning, match="falling back to blocking"):
        net = mpidp.DataParallel(build(MLP, seed=7), blocking_parameter_updates=False)
    assert net.blocking_parameter_updates


def test_construction_keeps_rank0_values_and_rng():
    """No re-seeding and no reset_parameters(): rank 0's (e.g. loaded) values
    are what every rank ends with, and the user's RNG stream is untouched."""
    model = build(MLP, seed=11 + RANK)
    with torch.no_grad():
        model.l1.weight.fill_(0.5)  # as if loaded from a checkpoint
        if RANK != 0:
            model.l1.weight.fill_(-1.0)
    torch.manual_seed(1234)
    mpidp.DataParallel(model, blocking_parameter_updates=True)
    after = torch.rand(3)
    torch.manual_seed(1234)
    assert torch.equal(after, torch.rand(3)), "DataParallel consumed or reset the RNG"
    assert torch.all(model.l1.weight == 0.5)
    assert_same_on_all_ranks(model)


@pytest.mark.parametrize("features", [5, 3])
def test_buffers_are_broadcast(features):
    # 3 features: an odd number of float32 values precedes the int64 counter.
    model = torch.nn.Sequential(torch.nn.Linear(2, features), torch.nn.BatchNorm1d(features))
    model[1].running_mean.fill_(float(RANK))
    model[1].num_batches_tracked.fill_(10 + RANK)
    mpidp.DataParallel(model, blocking_parameter_updates=True)
    assert torch.all(model[1].running_mean == 0.0)
    assert model[1].num_batches_tracked.item() == 10


def test_sparse_embedding_gradients_are_averaged_dense():
    """nn.Embedding(sparse=True) gives sparse gradients; the buckets are
    dense, so they are averaged as dense tensors (torch DDP's result)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    net = mpidp.DataParallel(emb, blocking_parameter_updates=True)
    for step in range(2):
        net(torch.tensor([(RANK + step) % 10, 7])).sum().backward()
        mean = torch.zeros(10, 3)
        for r in range(SIZE):
            mean[(r + step) % 10] += 1.0 / SIZE
            mean[7] += 1.0 / SIZE
        torch.testing.assert_close(emb.weight.grad, mean)
        assert not emb.weight.grad.is_sparse
        emb.zero_grad()          # step 1: .grad None, so the sparse gradient is adopted
