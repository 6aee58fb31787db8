"""DataParallel through staged buckets: the path GPU gradients take (device
buckets copied to host buckets for MPI and back), forced on CPU tensors with
MPIDP_DP_STAGING=1 so that it is tested on machines without a GPU. The same
reference comparisons as the direct path."""

import pytest

import test_data_parallel as blocking_tests
import test_ddp_habits as ddp_habits
import test_join as join_tests
import test_nonblocking as nonblocking_tests


@pytest.fixture(autouse=True)
def staged(monkeypatch):
    monkeypatch.setenv("MPIDP_DP_STAGING", "1")


def test_blocking_with_unused_parameters():
    blocking_tests.train_and_compare(blocking_tests.Branchy, loss_fn=blocking_tests.branchy_loss,
                                     steps=6, zero_grad="after_forward")


def test_blocking_cnn_adam():
    blocking_tests.train_and_compare(blocking_tests.CNN, blocking_tests.adam, x_shape=(1, 12, 12))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_nonblocking(set_to_none):
    nonblocking_tests.run(zero="before", set_to_none=set_to_none)


def test_nonblocking_accumulation():
    nonblocking_tests.test_gradient_accumulation()


def test_join():
    join_tests.test_uneven_batches_match_the_reference(False, blocking_tests.sgd)


@pytest.mark.parametrize("habit", ["clip", "amp"])
def test_blocking_clipping_and_grad_scaler(habit):
    blocking_tests.train_with_habits(habit)


@pytest.mark.parametrize("habit", ["clip", "amp"])
def test_nonblocking_clipping_and_grad_scaler_through_the_relay(habit):
    blocking_tests.test_clipping_and_grad_scaler_between_backward_and_step(habit, False)


@pytest.mark.parametrize("blocking", [True, False])
def test_no_sync(blocking):
    ddp_habits.test_no_sync_accumulates_locally_then_averages_the_sum(blocking)
    ddp_habits.test_no_sync_keeps_gradients_of_parameters_the_last_backward_misses(blocking)


def test_nonblocking_staged_with_a_wire_dtype_equals_the_direct_path(monkeypatch):
    """Non-blocking staged buckets that travel compressed keep the host path's
    separate buffers (the others are relayed: _host_relay.py); its results are
    the direct path's, bit for bit (the same arithmetic on the same bytes)."""
    import torch
    import mpidp
    from dp_reference import build
    from test_data_parallel import MLP
    rank = mpidp.rank()
    results = []
    for staged in ("1", "0"):
        monkeypatch.setenv("MPIDP_DP_STAGING", staged)
        model = build(MLP, 7)
        opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=False,
                                 wire_dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            net(torch.randn(4, 10, generator=g)).sum().backward()
            opt.step()
        net.synchronize()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
