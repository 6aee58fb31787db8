"""Habits of torch DDP users, against single-process references, at 1-4 ranks:
buffers broadcast from rank 0 before every training forward (BatchNorm
statistics cannot drift apart), and no_sync() for gradient accumulation, in
both of DataParallel's modes."""

import copy

import pytest
import torch
import torch.nn.functional as F

import mpidp
from dp_reference import (SIZE, BNNet, assert_params_close, assert_same_on_all_ranks, build,
                          classification_batch, cross_entropy, data_parallel_and_reference,
                          on_device, rank_slice, reference_step, seeded, step_like_one_process)
from mpidp import MPI
from test_data_parallel import MLP, sgd


def rank0s(tensors):
    """Rank 0's values of `tensors` (copies)."""
    return [torch.from_numpy(MPI.COMM_WORLD.bcast(t.detach().cpu().numpy(), root=0)).to(t.device)
            for t in tensors]


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("blocking", [True, False])
def test_buffers_follow_rank0_before_every_training_forward(broadcast, blocking):
    """With broadcast_buffers (the default) each training forward starts from
    rank 0's running statistics and updates them with this rank's batch; without
    it each rank keeps its own chain. Checked after every step against a copy
    of the module that starts each forward from those statistics."""
    model = build(BNNet, seed=3)
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=blocking,
                             broadcast_buffers=broadcast)
    g = seeded(9)
    for step in range(4):
        X = on_device(torch.randn(4 * SIZE, 6, generator=g) * (1 + step))
        Y = on_device(torch.randint(0, 3, (4 * SIZE,), generator=g))
        buffers = list(model.buffers())
        start = rank0s(buffers) if broadcast else [b.detach().clone() for b in buffers]
        net.synchronize()  # the pending update (non-blocking) is applied before we copy
        expected = copy.deepcopy(model).train()
        for b, v in zip(expected.buffers(), start):
            b.copy_(v)
        with torch.no_grad():
            expected(rank_slice(X))
        opt.zero_grad()
        F.cross_entropy(net(rank_slice(X)), rank_slice(Y)).backward()
        opt.step()
        for (name, mine), want in zip(model.named_buffers(), expected.buffers()):
            assert torch.allclose(mine, want, atol=1e-6), f"step {step}: buffer {name}"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_two_forwards_before_one_backward_with_batchnorm(blocking):
    """torch DDP runs this (a model applied to two views of a batch, one
    loss); mpidp's buffer broadcast before the second forward bumped the
    running statistics' version on the receiving ranks only, and their
    backward failed with torch's in-place error. Against a simulation of
    every rank's replica (BatchNorm in training normalises with each rank's
    own batch, so there is no one-process equivalent): the update uses the
    mean over ranks of each replica's gradient."""
    model = build(BNNet, seed=4)
    reference = copy.deepcopy(model)
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=blocking)
    ref_opt = sgd(reference.parameters())
    g = seeded(10)
    for step in range(3):
        X1, X2 = (on_device(torch.randn(4 * SIZE, 6, generator=g)) for _ in range(2))
        Y = on_device(torch.randint(0, 3, (4 * SIZE,), generator=g))
        opt.zero_grad()
        (F.cross_entropy(net(rank_slice(X1)), rank_slice(Y))
         + F.cross_entropy(net(rank_slice(X2)), rank_slice(Y))).backward()
        opt.step()
        ref_opt.zero_grad()
        for r in range(SIZE):
            replica = copy.deepcopy(reference)
            loss = (F.cross_entropy(replica(rank_slice(X1, r)), rank_slice(Y, r))
                    + F.cross_entropy(replica(rank_slice(X2, r)), rank_slice(Y, r)))
            for p, q in zip(reference.parameters(),
                            torch.autograd.grad(loss, list(replica.parameters()))):
                p.grad = q / SIZE if p.grad is None else p.grad + q / SIZE
        ref_opt.step()
    net.synchronize()
    assert_params_close(model, reference)
    assert_same_on_all_ranks(model)


def test_broadcast_buffers_must_be_a_bool():
    with pytest.raises(TypeError, match="broadcast_buffers: expected a bool"):
        mpidp.DataParallel(build(BNNet, 0), broadcast_buffers="yes")


@pytest.mark.parametrize("blocking", [True, False])
def test_no_sync_accumulates_locally_then_averages_the_sum(blocking):
    """Three micro-batches, the first two inside no_sync(): the update equals
    one single-process step on the accumulated gradients of all ranks."""
    model, net, opt, reference, ref_opt = data_parallel_and_reference(MLP, sgd, 11, blocking)
    g = seeded(4)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        batches = [classification_batch(g, 2 * SIZE) for _ in range(3)]
        with net.no_sync():
            for X, Y in batches[:2]:
                F.cross_entropy(net(rank_slice(X)), rank_slice(Y)).backward()
            # Nothing was averaged: each rank holds its own sum (ranks' data differ).
            own = MPI.COMM_WORLD.allgather(model.l1.weight.grad.detach().cpu())
            assert SIZE == 1 or not all(torch.equal(own[0], g) for g in own[1:])
        X, Y = batches[2]
        F.cross_entropy(net(rank_slice(X)), rank_slice(Y)).backward()
        for X, Y in batches:
            reference_step(reference, X, Y, cross_entropy)
        opt.step()
        ref_opt.step()
        net.synchronize()
        assert_params_close(model, reference, what=f"step {step}")
    assert_same_on_all_ranks(model)


class Gated(torch.nn.Module):
    """`extra` takes part only when asked: a parameter whose gradient comes
    from the no_sync micro-batches alone."""
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(5, 3)
        self.extra = torch.nn.Linear(5, 3)

    def forward(self, x, use_extra):
        out = self.body(x)
        return out + self.extra(x) if use_extra else out


@pytest.mark.parametrize("blocking", [True, False])
def test_no_sync_keeps_gradients_of_parameters_the_last_backward_misses(blocking):
    """`extra` gets gradients inside no_sync only: its accumulated gradient is
    still averaged (not dropped, not zero with weight decay applied)."""
    model, net, opt, reference, ref_opt = data_parallel_and_reference(
        Gated, lambda params: torch.optim.SGD(params, lr=0.5, weight_decay=0.1), 2, blocking)
    g = seeded(8)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        X1, X2 = (on_device(torch.randn(2 * SIZE, 5, generator=g)) for _ in range(2))
        with net.no_sync():
            net(rank_slice(X1), True).pow(2).mean().backward()
        net(rank_slice(X2), False).pow(2).mean().backward()
        reference_step(reference, X1, X1, lambda m, x, y, r: m(x, True).pow(2).mean())
        reference_step(reference, X2, X2, lambda m, x, y, r: m(x, False).pow(2).mean())
        opt.step()
        ref_opt.step()
        net.synchronize()
        assert_params_close(model, reference, what=f"step {step}")


@pytest.mark.parametrize("blocking", [True, False])
def test_no_sync_accumulation_then_clipping_matches_one_process(blocking):
    """The habits around an accumulation: micro-batches in no_sync, the last
    one outside, optimizer.synchronize() (Horovod's; needed in non-blocking
    mode to read .grad), clip_grad_norm_, step -- as one process would."""
    model, net, opt, reference, ref_opt = data_parallel_and_reference(MLP, sgd, 21, blocking)
    g = seeded(12)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        batches = [on_device(torch.randn(2 * SIZE, 10, generator=g) * 4,
                             torch.randint(0, 4, (2 * SIZE,), generator=g)) for _ in range(2)]
        with net.no_sync():
            X, Y = batches[0]
            F.cross_entropy(net(rank_slice(X)), rank_slice(Y)).backward()
        X, Y = batches[1]
        F.cross_entropy(net(rank_slice(X)), rank_slice(Y)).backward()
        for X, Y in batches:
            reference_step(reference, X, Y, cross_entropy)
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        opt.step()
        ref_opt.step()
        net.synchronize()
        assert_params_close(model, reference, what=f"step {step}")


def test_step_right_after_a_no_sync_backward_raises():
    model = build(MLP, seed=1)
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=True)
    with net.no_sync():
        net(on_device(torch.randn(2, 10))).sum().backward()
        with pytest.raises(RuntimeError, match="no_sync"):
            opt.step()
        with pytest.raises(RuntimeError, match="already active"):
            with net.no_sync():
                pass
    with pytest.raises(RuntimeError, match="no_sync"):
        opt.step()
    net(on_device(torch.randn(2, 10))).sum().backward()
    opt.step()  # after a backward outside no_sync the step is fine


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_gradients_from_autograd_grad_are_refused_at_step(blocking):
    """torch.autograd.grad accumulates nothing, so no hook runs and nothing
    is averaged: a step with those gradients assigned by hand raises instead
    of letting each rank step on its own. Averaging them by hand and
    stepping the torch optimizer (the advice, blocking mode) trains like one
    process."""
    model, net, opt, reference, ref_opt = data_parallel_and_reference(MLP, sgd, 700, blocking)
    X, Y = classification_batch(seeded(18), 4 * SIZE)

    def grads_by_hand(average):
        opt.zero_grad()
        params = list(model.parameters())
        grads = torch.autograd.grad(F.cross_entropy(net(rank_slice(X)), rank_slice(Y)), params)
        for p, g in zip(params, grads):
            if average:
                mpidp.allreduce(g, op="avg")      # in place
            p.grad = g

    grads_by_hand(average=False)
    with pytest.raises(RuntimeError, match="no backward\\(\\) through DataParallel produced"):
        opt.step()
    if not blocking:
        return
    grads_by_hand(average=True)
    opt.torch_optimizer.step()
    ref_opt.zero_grad()
    reference_step(reference, X, Y, cross_entropy)
    ref_opt.step()
    assert_params_close(model, reference, what="after averaging autograd.grad's gradients by hand")
    assert_same_on_all_ranks(model)
    # A backward through DataParallel before the next step: an ordinary step.
    X, Y = classification_batch(seeded(19), 4 * SIZE)
    step_like_one_process(net, opt, reference, ref_opt, X, Y)
    assert_params_close(model, reference, what="after an ordinary step")
