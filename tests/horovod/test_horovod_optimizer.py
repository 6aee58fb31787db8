"""hvd.DistributedOptimizer against a single-process simulation of every
rank: each rank trains on its own batches, the simulation averages the
ranks' gradients itself. Horovod's habits (gradient accumulation over
backward_passes_per_step, synchronize() before clipping, GradScaler,
unused parameters, LR schedulers, process sets) and its errors."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import mpidp.horovod.torch as hvd
from dp_reference import RANK, SIZE

pytestmark = [pytest.mark.ranks3, pytest.mark.usefixtures("horovod_dynamic")]
STEPS = 4


class Net(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)
        self.side = torch.nn.Linear(6, 3)      # used by rank 0 only (see forward)
        self.unused = torch.nn.Linear(2, 2)    # never used

    def forward(self, x, rank=None):
        out = self.fc2(torch.tanh(self.fc1(x)))
        if rank == 0:
            out = out + self.side(x)
        return out


def batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(4 + rank, 6, generator=g), torch.randint(0, 3, (4 + rank,), generator=g)


def loss_of(model, step, rank, micro=0):
    x, y = batch(step, rank, micro)
    return F.cross_entropy(model(x, rank), y)


def simulate(make_opt, steps=STEPS, passes=1, op="avg", ranks=None, clip=None, edit=None):
    """Every rank's replica: the mean (or sum) over `ranks` of each rank's
    gradient summed over `passes` micro-batches; then the step."""
    ranks = list(range(SIZE)) if ranks is None else ranks
    model = Net()
    opt = make_opt(model)
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in ranks:
            for micro in range(passes):
                model.zero_grad()
                loss_of(model, step, r, micro).backward()
                for g, p in zip(grads, model.parameters()):
                    if p.grad is not None:
                        g += p.grad
        for g, p in zip(grads, model.parameters()):
            p.grad = g / len(ranks) if op == "avg" else g
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if edit:
            edit(model)
        opt.step()
    return model


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def assert_same(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def train(opt_kwargs=None, passes=1, clip=None, edit=None, make_opt=sgd):
    model = Net(seed=RANK)          # different on every rank until the broadcasts
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **(opt_kwargs or {}))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(passes):
            loss_of(model, step, RANK, micro).backward()
        if clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            if edit:
                edit(model)
            opt.step()
    return model, opt


def test_mnist_style_training_matches_the_simulation():
    model, opt = train()
    assert isinstance(opt, torch.optim.SGD)
    assert_same(model, simulate(sgd))
    # A parameter no rank used got zero gradients (Horovod sends them), so
    # weight decay moved it in both.
    assert torch.count_nonzero(model.unused.weight.grad) == 0


def test_backward_passes_per_step_accumulates_the_sum():
    model, _ = train(passes=2)
    assert_same(model, simulate(sgd, passes=2))


def test_a_step_after_fewer_passes_reduces_what_was_accumulated():
    model = Net()
    opt = hvd.DistributedOptimizer(sgd(model), backward_passes_per_step=3)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, step, RANK).backward()
        opt.step()
    assert_same(model, simulate(sgd))


def test_synchronize_then_clip_then_step():
    model, _ = train(clip=0.05)
    assert_same(model, simulate(sgd, clip=0.05))


def test_gradients_edited_before_step_are_used():
    def edit(m):
        for p in m.parameters():
            if p.grad is not None:
                p.grad.mul_(3.0)
    model, _ = train(edit=edit)
    assert_same(model, simulate(sgd, edit=edit))


def test_sum_op_and_adam_and_lr_scheduler():
    def adam(m):
        return torch.optim.Adam(m.parameters(), lr=0.01)
    model, opt = train({"op": hvd.Sum}, make_opt=adam)
    assert_same(model, simulate(adam, op="sum"))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loss_of(model, 0, RANK).backward()
    opt.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.005


def test_fp16_and_bf16_compression_stay_close():
    for compression in (hvd.Compression.fp16, hvd.Compression.bf16):
        model, _ = train({"compression": compression})
        reference = simulate(sgd)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)


def test_grad_scaler_with_synchronize_and_skip_synchronize():
    model = Net(seed=RANK)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(loss_of(model, step, RANK)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    assert_same(model, simulate(sgd, clip=0.05))


def test_process_set_averages_within_the_set_only():
    evens = hvd.add_process_set(list(range(0, SIZE, 2))) if SIZE > 1 else hvd.global_process_set
    model = Net()
    opt = hvd.DistributedOptimizer(sgd(model), process_set=evens)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, step, RANK).backward()
        opt.step()
    members = list(range(0, SIZE, 2)) if RANK % 2 == 0 else [RANK]
    assert_same(model, simulate(sgd, ranks=members))
    if evens is not hvd.global_process_set:
        hvd.remove_process_set(evens)


def test_horovod_errors():
    model = Net()
    opt = hvd.DistributedOptimizer(sgd(model))
    loss_of(model, 0, RANK).backward()
    if SIZE > 1:    # one rank reduces nothing, so Horovod has nothing pending to guard
        with pytest.raises(AssertionError, match="zero_grad.*before"):
            opt.zero_grad()
        with pytest.raises(AssertionError, match="backward_passes_per_step"):
            loss_of(model, 1, RANK).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="already"):
        hvd.DistributedOptimizer(opt)
    with pytest.raises(NotImplementedError, match="Adasum.*Average"):
        hvd.DistributedOptimizer(sgd(Net()), op=hvd.Adasum)
    named = list(Net().named_parameters())
    other = Net()
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(sgd(other), named_parameters=named[:2])
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(sgd(other), named_parameters=[("w", p) for p in other.parameters()])
    with pytest.raises(ValueError, match="sequence of tuples"):
        hvd.DistributedOptimizer(sgd(other), named_parameters=list(other.parameters()))
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(sgd(other), backward_passes_per_step=0)


@pytest.mark.skipif(SIZE == 1, reason="settings can only differ between ranks")
def test_settings_that_differ_across_ranks_raise_on_every_rank():
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(sgd(Net()), backward_passes_per_step=1 + RANK % 2)


@pytest.mark.skipif(SIZE == 1, reason="one rank has no reducer to refuse")
def test_join_with_a_reducing_optimizer_is_refused():
    model = Net()
    opt = hvd.DistributedOptimizer(sgd(model))
    with pytest.raises(NotImplementedError, match="join.*drop_last"):
        hvd.join()
    del opt


@pytest.mark.skipif(SIZE == 1, reason="one rank has no reducer to refuse")
def test_an_optimizer_left_in_a_failed_tests_traceback_does_not_refuse_join():
    """An optimizer the program dropped but a reference cycle still holds
    (the frames of a caught exception's traceback, as a failed test leaves
    it in Horovod's suite) is no reason to refuse join: it is collected."""
    import gc

    def build_then_fail():
        opt = hvd.DistributedOptimizer(sgd(Net()))   # noqa: F841  (held by the frame)
        raise ValueError("a failure after the optimizer was made")

    try:
        build_then_fail()
    except ValueError as e:
        kept = [e]
        kept.append(kept)           # the traceback's frames, in a cycle
    del kept
    gc.disable()                    # the cycle stays until join() looks
    try:
        last = hvd.join()
    finally:
        gc.enable()
    assert last in range(SIZE) and hvd.allgather_object(last) == [last] * SIZE


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_are_reduced_dense(sparse_as_dense):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    start = emb.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                   sparse_as_dense=sparse_as_dense)
    emb(torch.tensor([RANK % 10, 7])).sum().backward()
    opt.step()
    mean = torch.zeros(10, 3)
    for r in range(SIZE):
        mean[r % 10] += 1.0 / SIZE
        mean[7] += 1.0 / SIZE
    torch.testing.assert_close(emb.weight.detach(), start - 0.5 * mean)


def test_a_dropped_optimizer_stops_reducing():
    """A script that builds its optimizer again (each epoch, or after a
    reload) must not keep the first one's hooks reducing the gradients:
    after the drop, a plain torch optimizer sees this rank's own gradients."""
    model = Net()
    hvd.DistributedOptimizer(sgd(model), op=hvd.Sum)     # dropped at once
    local = sgd(model)
    local.zero_grad()
    loss_of(model, 0, RANK).backward()
    reference = Net()
    loss_of(reference, 0, RANK).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embedding_gradients_stay_sparse(sparse_as_dense):
    """An Embedding(sparse=True) under SparseAdam (which takes only sparse
    gradients): the reduced gradient is sparse, its values the mean of every
    rank's, and SparseAdam steps as on one process with the mean."""
    inputs = [torch.tensor([[r % 10, (3 * r + 1) % 10, 4]]) for r in range(SIZE)]

    def model():
        torch.manual_seed(5)
        return torch.nn.Embedding(10, 3, sparse=True)

    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(m.parameters()), lr=0.1),
                                   sparse_as_dense=sparse_as_dense)
    (m(inputs[RANK]) * (RANK + 1)).sum().backward()
    opt.step()
    assert m.weight.grad.is_sparse
    ref = model()
    ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.1)
    sum(((ref(inputs[r]) * (r + 1)).sum() for r in range(SIZE))).backward()
    ref.weight.grad = ref.weight.grad.coalesce() / SIZE
    assert torch.allclose(m.weight.grad.to_dense(), ref.weight.grad.to_dense())
    ref_opt.step()
    assert torch.allclose(m.weight.detach(), ref.weight.detach(), atol=1e-6)


def test_sparse_allreduce_async_returns_a_callable_handle():
    """Horovod's handle is a function that waits for the result."""
    t = torch.zeros(6, 2)
    t[RANK % 6] = RANK + 1.0
    handle = hvd.sparse_allreduce_async(t.to_sparse(), name="sparse.handle", op=hvd.Sum)
    dense = torch.zeros(6, 2)
    for r in range(SIZE):
        dense[r % 6] += r + 1.0
    assert torch.equal(handle().to_dense(), dense)
