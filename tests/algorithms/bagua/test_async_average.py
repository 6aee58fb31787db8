"""Bagua's AsyncModelAverageAlgorithm, by invariants that need no timing
(how many rounds the background thread runs, and when, is up to the
scheduler): with the weights left alone, a round gives every rank the mean
of the ranks' weights; while every rank trains, the sum over the ranks of
the weights is the starting sum plus every rank's own updates; the warm-up
averages gradients as DataParallel does (checked against a single-process
reference); abort() stops the averaging (the ranks then drift apart) and
resume() restarts it; a checkpoint resumes the step and the abort; the
arguments are checked."""

import time

import pytest
import torch
from mpi4py import MPI

import mpidp
from dp_reference import RANK, SIZE, rank_slice, seeded
from mpidp.algorithms import AsyncModelAverageAlgorithm

pytestmark = pytest.mark.ranks3


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def data(steps, seed=3):
    gen = seeded(seed)
    return [(torch.randn(4 * SIZE, 5, generator=gen), torch.randn(4 * SIZE, 2, generator=gen))
            for _ in range(steps)]


def train_step(net, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(rank_slice(x)), rank_slice(y)).backward()
    opt.step()


def rounds_after(net, n, opt=None, batches=()):
    """Trains on `batches` round-robin (or idles) until the thread has
    completed n rounds since it last started, and training has gone through
    `batches` once (the thread may run its rounds before a loaded machine
    gives this one a step)."""
    handle, i = net.bagua_driver, 0
    while handle.averager.rounds < n or (opt is not None and i < len(batches)):
        if opt is not None:
            x, y = batches[i % len(batches)]
            train_step(net, opt, x, y)
            i += 1
        else:
            time.sleep(0.001)
    return i


def test_with_the_weights_left_alone_a_round_gives_every_rank_the_mean():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)      # training changes nothing
    algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=1)
    net = mpidp.with_bagua(model, [opt], algorithm)
    algorithm.abort(net)
    with torch.no_grad():                                  # every rank different
        for i, p in enumerate(model.parameters()):
            p.add_(torch.randn(p.shape, generator=seeded(100 * RANK + i)))
    mine = flat(model).double().numpy()
    mean = MPI.COMM_WORLD.allreduce(mine) / SIZE
    algorithm.resume(net)
    rounds_after(net, 2, opt, data(4))
    algorithm.abort(net)
    torch.testing.assert_close(flat(model).double(), torch.from_numpy(mean), rtol=0, atol=1e-6)
    assert net.bagua_driver.rounds >= 2


def test_the_sum_over_ranks_is_kept_while_every_rank_trains():
    """Σ_ranks x = Σ_ranks x0 + Σ_ranks Σ_steps (x after - x before the step),
    each update measured under the weight lock (from the forward to the
    step), however the rounds fall between the steps."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    applied = torch.zeros(flat(model).numel(), dtype=torch.float64)
    before = {}
    # Registered before with_bagua's hook, so it runs while the lock is held.
    opt.register_step_pre_hook(lambda *_: before.update(x=flat(model).double()))
    opt.register_step_post_hook(lambda *_: applied.add_(flat(model).double() - before["x"]))
    net = mpidp.with_bagua(model, [opt], AsyncModelAverageAlgorithm(sync_interval_ms=1))
    start = flat(model).double()
    steps = rounds_after(net, 4, opt, data(6, seed=4 + RANK))     # each rank its own data
    net.bagua_algorithm.abort(net)
    total = torch.from_numpy(MPI.COMM_WORLD.allreduce(flat(model).double().numpy()))
    want = torch.from_numpy(MPI.COMM_WORLD.allreduce((start + applied).numpy()))
    torch.testing.assert_close(total, want, rtol=0, atol=1e-5)
    assert steps > 0 and applied.abs().max() > 1e-3      # training did move the weights


def test_the_warm_up_averages_gradients_then_the_thread_starts():
    model = make_model()
    reference = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    net = mpidp.with_bagua(model, [opt], AsyncModelAverageAlgorithm(warmup_steps=3))
    for i, (x, y) in enumerate(data(3)):
        assert net.bagua_driver.averager is None
        train_step(net, opt, x, y)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()   # the whole batch
        ref_opt.step()
        torch.testing.assert_close(flat(model), flat(reference), rtol=0, atol=1e-6)
    assert net.bagua_driver.averager is not None and net.bagua_driver.step == 3
    net.bagua_algorithm.abort(net)


@pytest.mark.skipif(SIZE < 2, reason="drifting apart needs two ranks")
def test_abort_stops_the_averaging_and_resume_restarts_it():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=1)
    net = mpidp.with_bagua(model, [opt], algorithm)
    algorithm.abort(net)
    rounds = net.bagua_driver.rounds
    for x, y in data(3, seed=10 + RANK):                  # each rank its own data, no averaging
        train_step(net, opt, x, y)
    assert net.bagua_driver.rounds == rounds and net.bagua_driver.averager is None
    copies = MPI.COMM_WORLD.allgather(flat(model).numpy().tobytes())
    assert len(set(copies)) == SIZE                        # the ranks drifted apart
    algorithm.resume(net)
    rounds_after(net, 1)
    algorithm.abort(net)
    assert net.bagua_driver.rounds > rounds


def test_a_checkpoint_resumes_the_step_and_the_abort():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = mpidp.with_bagua(model, [opt], AsyncModelAverageAlgorithm(warmup_steps=2))
    for x, y in data(2):
        train_step(net, opt, x, y)
    net.bagua_algorithm.abort(net)
    state = net.bagua_state_dict()
    assert state == {"step": 2, "aborted": True}

    fresh = make_model()
    again = mpidp.with_bagua(fresh, [torch.optim.SGD(fresh.parameters(), lr=0.1)],
                             AsyncModelAverageAlgorithm(warmup_steps=2))
    assert again.bagua_driver._warmup is not None               # a fresh start warms up
    again.load_bagua_state_dict(state)
    assert again.bagua_driver._warmup is None and again.bagua_driver.averager is None   # past it, aborted
    again.load_bagua_state_dict({"step": 5, "aborted": False})
    assert again.bagua_driver.averager is not None
    again.bagua_algorithm.abort(again)
    with pytest.raises(ValueError, match=r"state: expected the keys \['aborted', 'step'\]"):
        again.load_bagua_state_dict({"step": 1})


def test_evaluation_forwards_do_not_keep_the_lock():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = mpidp.with_bagua(model, [opt], AsyncModelAverageAlgorithm(sync_interval_ms=1))
    with torch.no_grad():
        net(torch.randn(2, 5))
    assert not net.bagua_driver._locked
    rounds_after(net, net.bagua_driver.averager.rounds + 2)      # the thread is not blocked
    x, y = data(1)[0]
    net(rank_slice(x))
    assert net.bagua_driver._locked                              # training: until the step
    opt.step()
    assert not net.bagua_driver._locked
    net.bagua_algorithm.abort(net)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="peer_selection_mode"):
        AsyncModelAverageAlgorithm(peer_selection_mode="shift_one")
    with pytest.raises(TypeError, match="sync_interval_ms: expected an int"):
        AsyncModelAverageAlgorithm(sync_interval_ms="500")
    with pytest.raises(ValueError, match="sync_interval_ms"):
        AsyncModelAverageAlgorithm(sync_interval_ms=-1)
    with pytest.raises(TypeError, match="warmup_steps: expected an int"):
        AsyncModelAverageAlgorithm(warmup_steps=1.5)
    algorithm = AsyncModelAverageAlgorithm()
    with pytest.raises(ValueError, match="model: expected the module that mpidp.with_bagua"):
        algorithm.abort(make_model())
    model = make_model()
    net = mpidp.with_bagua(model, [torch.optim.SGD(model.parameters(), lr=0.1)],
                           mpidp.algorithms.GradientAllReduceAlgorithm())
    with pytest.raises(ValueError, match="trained with another algorithm"):
        algorithm.resume(net)
    with pytest.raises(ValueError, match="optimizers: the warm-up"):
        mpidp.with_bagua(make_model(), [], AsyncModelAverageAlgorithm(warmup_steps=2))
    with pytest.raises(NotImplementedError, match="join: AsyncModelAverageAlgorithm"):
        net = mpidp.with_bagua(net, [], AsyncModelAverageAlgorithm())
        try:
            net.join()
        finally:
            net.bagua_algorithm.abort(net)


def test_a_replaced_parameter_storage_is_an_error_not_a_lost_update():
    """The thread writes into the storage it was given: a parameter rebound
    to a new tensor (p.data = ...) would silently stop being averaged."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = mpidp.with_bagua(model, [opt], AsyncModelAverageAlgorithm(sync_interval_ms=1))
    model[0].weight.data = model[0].weight.data.clone()
    with pytest.raises(RuntimeError, match="storage was replaced"):
        net(torch.randn(2, 5))
    net.bagua_algorithm.abort(net)
    net.bagua_algorithm.resume(net)                        # restarting adopts the new storage
    net(torch.randn(2, 5))
    opt.step()
    net.bagua_algorithm.abort(net)
