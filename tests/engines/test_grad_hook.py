"""DataParallel's gradient hooks, C++ (mpidp._grad_hook) and Python
(MPIDP_GRAD_HOOK=python, the path of builds without the C++ part), at 1-4
ranks against single-process references: both give the same results, both
run after the user's own post-accumulate-grad hooks (a hook that edits a
gradient is part of the average), a foreign `.grad` goes through the C++
hook's slow path, and a failure inside the hook reaches the caller of
backward with its type."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import mpidp
from dp_reference import (RANK, SIZE, build, on_device, rank_slice, reference_step, seeded,
                          train_like_one_process)
from mpidp import _grad_hook
from mpidp._engines import grad_hook_loader as _grad_hook_loader
from dp_reference import MLP, sgd

pytestmark = pytest.mark.ranks3

HOOKS = ["cpp", "python"]


def loss_fn(model, x, y, _rank=None):
    return F.cross_entropy(model(x), y)


def double_grad(param):
    param.grad.mul_(2)


def test_the_cpp_hook_is_built_and_loads_for_this_torch():
    """make test builds it (torch is importable at build time): a build that
    silently lost it would fall back to the slower Python hook."""
    assert _grad_hook_loader.describe() == "cpp (mpidp._grad_hook)"


@pytest.mark.parametrize("hook", HOOKS)
def test_each_kind_is_installed_as_asked(monkeypatch, hook):
    monkeypatch.setenv("MPIDP_GRAD_HOOK", hook)
    model = build(MLP, 1)
    net = mpidp.DataParallel(model)
    assert net.module is model
    kinds = {type(h).__name__ for h in net._hook_handles}
    wanted, other = ("Hooks", "_AccumulatorHook") if hook == "cpp" else ("_AccumulatorHook", "Hooks")
    assert wanted in kinds and other not in kinds
    assert all(_grad_hook.count(p) == 1 for p in model.parameters())
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_the_benchmarks_noop_cpp_hooks_change_nothing_and_come_off():
    """install_noop gives bench_step.py torch's cost of a C++ accumulator hook:
    it must add exactly one hook per tensor, leave the gradients as a plain
    backward makes them, refuse what is not a leaf that requires grad, and
    take its hooks off again."""
    model, plain = build(MLP, 1), build(MLP, 1)
    params = tuple(model.parameters())
    hooks = _grad_hook.install_noop(params)
    assert all(_grad_hook.count(p) == 1 for p in params)
    g = seeded(RANK)
    x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
    for m in (model, plain):
        loss_fn(m, x, y).backward()
    for p, q in zip(params, plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    hooks.remove()
    hooks.remove()  # idempotent
    assert all(_grad_hook.count(p) == 0 for p in params)
    with pytest.raises(TypeError, match="params: expected a tuple"):
        _grad_hook.install_noop(list(params))
    with pytest.raises(ValueError, match=r"params\[1\]: expected a leaf that requires grad"):
        _grad_hook.install_noop((params[0], torch.zeros(3)))
    with pytest.raises(TypeError, match=r"params\[0\]: expected a tensor"):
        _grad_hook.install_noop((1.0,))
    assert _grad_hook.count(params[0]) == 0  # a refused install leaves nothing behind


def test_gradients_are_plain_aliases_of_their_bucket_sharing_its_version():
    """Autograd accumulates into a `.grad` that is an autograd view through
    its view tracking (~0.4 us a parameter per backward), so each `.grad` is
    a detached alias of its bucket; it must still share the bucket's version
    counter, by which the reducer sees in-place edits."""
    model = build(MLP, 1)
    net = mpidp.DataParallel(model)
    g = seeded(RANK)
    x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
    loss_fn(net, on_device(x), on_device(y)).backward()
    reducer = net._reducer
    for p, b in zip(model.parameters(), reducer.param_bucket):
        bucket = reducer._grad_buckets[b]
        assert not p.grad._is_view()
        assert p.grad.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr()
        before = bucket._version
        p.grad.mul_(1.0)
        assert bucket._version == before + 1


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_a_hook_the_user_adds_after_wrapping_is_part_of_the_average(monkeypatch, hook, blocking):
    """The user's post-accumulate-grad hook doubles every gradient in place;
    the reference doubles its gradient too. mpidp's hook runs after it."""
    monkeypatch.setenv("MPIDP_GRAD_HOOK", hook)
    model, reference = build(MLP, 100 + RANK), build(MLP, 100)
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=blocking)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(double_grad)
    train_like_one_process(net, opt, model, reference, sgd(reference.parameters()), loss_fn,
                           (10, 4), seed=3, edit_reference_grads=lambda ref: [
                               p.grad.mul_(2) for p in ref.parameters()],
                           what=f"{hook} hook after a user's doubling hook")


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_ranks_with_different_hooks_train_as_one_process(monkeypatch, blocking):
    """MPIDP_GRAD_HOOK differing across ranks (a node whose build lacks the
    C++ hook) changes nothing: both hooks post the same buckets in the same order."""
    monkeypatch.setenv("MPIDP_GRAD_HOOK", HOOKS[RANK % 2])
    model, reference = build(MLP, 300 + RANK), build(MLP, 300)
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=blocking)
    train_like_one_process(net, opt, model, reference, sgd(reference.parameters()), loss_fn,
                           (10, 4), seed=9, what="ranks with different gradient hooks")


def train_as_one_process_with(setting, mine, blocking, seed, what):
    """DataParallel with the process-wide `setting` (_C.configure) at this
    rank's value `mine` trains like one process on all the data."""
    before = mpidp._C.process_state()[setting]
    mpidp._C.configure(**{setting: mine})
    try:
        model, reference = build(MLP, 300 + seed + RANK), build(MLP, 300 + seed)
        opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
        net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=blocking)
        train_like_one_process(net, opt, model, reference, sgd(reference.parameters()), loss_fn,
                               (10, 4), seed=seed, what=what)
    finally:
        mpidp._C.configure(**{setting: before})


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_ranks_whose_hooks_progress_mpi_or_not_train_as_one_process(blocking):
    """MPIDP_HOOK_PROGRESS differing across ranks: progress from the hooks
    (at most every 10 us) only moves transfers along, so every rank must
    still end on one process's values."""
    train_as_one_process_with("hook_progress", RANK % 2 == 0, blocking, 10,
                              "ranks with and without hook progress")


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_ranks_whose_waits_spin_or_sleep_train_as_one_process(blocking):
    """MPIDP_WAIT_SPIN_MS differing across ranks (0: sleep between tests at
    once; 20 ms): the spin only decides how a wait spends its time, so every
    rank must still end on one process's values."""
    train_as_one_process_with("wait_spin", 0.0 if RANK % 2 else 0.02, blocking, 20,
                              "ranks whose waits spin or sleep")


@pytest.mark.parametrize("hook", HOOKS)
def test_a_foreign_grad_is_adopted(monkeypatch, hook):
    """`.grad` replaced by the user's own tensor between forward and backward:
    autograd accumulates into that tensor, the C++ hook's slow path (the
    Python-level grad_arrived) copies it into the bucket, and the sum is averaged."""
    monkeypatch.setenv("MPIDP_GRAD_HOOK", hook)
    model, reference = build(MLP, 200 + RANK), build(MLP, 200)
    net = mpidp.DataParallel(model, blocking_parameter_updates=True)
    g = seeded(5)
    X, Y = on_device(torch.randn(4 * SIZE, 10, generator=g),
                     torch.randint(0, 4, (4 * SIZE,), generator=g))
    loss = loss_fn(net, rank_slice(X), rank_slice(Y))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01 * (RANK + 1))
    loss.backward()
    reference_step(reference, X, Y, loss_fn)
    mean_start = sum(0.01 * (r + 1) for r in range(SIZE)) / SIZE
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad + mean_start, rtol=1e-5, atol=1e-6)


class SharedThroughCheckpoint(torch.nn.Module):
    """One Linear used inside a reentrant checkpoint and again outside it: its
    parameters receive two gradients in one backward, the second from the
    checkpoint's nested backward (on the C++ hook's fast path)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        inner = torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)
        return self.lin(inner)


@pytest.mark.parametrize("hook", HOOKS)
def test_a_failure_in_the_hook_reaches_backward_with_its_type(monkeypatch, hook):
    """The core refuses a second gradient for a parameter whose bucket may be
    on the wire already (ESTATE): a RuntimeError naming the cause, raised from
    backward() on every rank."""
    monkeypatch.setenv("MPIDP_GRAD_HOOK", hook)
    torch.manual_seed(0)
    model = SharedThroughCheckpoint()
    net = mpidp.DataParallel(model, blocking_parameter_updates=True)
    out = net(torch.randn(3, 4, requires_grad=True)).sum()
    with pytest.raises(RuntimeError, match="received a second gradient"):
        out.backward()


@pytest.mark.serial   # starts a Python of its own: not from inside an MPI job
def test_a_hook_built_for_another_torch_is_refused_with_the_reason():
    """libtorch's C++ ABI changes between releases: the module compares the
    torch it was built for with the running one before anything else."""
    code = ("import torch; torch.__version__ = '2.0.0'; "
            "from mpidp._engines import grad_hook_loader as l; print(l.describe())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "python (C++ hook unavailable: mpidp._grad_hook was built for torch" in out.stdout
    assert "this is torch 2.0.0" in out.stdout
