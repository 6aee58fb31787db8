"""DataParallel's device-resident reduction (_device_reduction.py: buckets
summed where they live, NCCL on a GPU), run on CPU tensors through its MPI
stand-in (MPIDP_DP_DEVICE_COMM=standin) so that its ordering -- what is
posted when, what waits for which sum, the non-blocking mode's deliveries
from its own buffers -- is checked on machines without a GPU, against the
same single-process references as the host path. Under
MPIDP_TEST_DEVICE=cuda (scripts/gpu_check.sh) the same tests run on NCCL
(MPIDP_DP_DEVICE_COMM=nccl), where every rank has a GPU of its own."""

import pytest
import torch

import mpidp
from dp_reference import DEVICE
import test_data_parallel as blocking_tests
import test_ddp_habits as ddp_habits
import test_join as join_tests
import test_nonblocking as nonblocking_tests
import test_rewrap as rewrap_tests


ON_GPU = DEVICE.type == "cuda"
if ON_GPU and mpidp.size() > torch.cuda.device_count():
    pytest.skip("NCCL needs a GPU per rank; these ranks share one", allow_module_level=True)


@pytest.fixture(autouse=True)
def device_path(monkeypatch):
    monkeypatch.setenv("MPIDP_DP_DEVICE_COMM", "nccl" if ON_GPU else "standin")


def test_the_device_path_is_the_one_taken():
    dp = mpidp.DataParallel(torch.nn.Linear(3, 2).to(DEVICE))
    assert dp._reducer.device_resident


def test_blocking_with_unused_parameters():
    blocking_tests.train_and_compare(blocking_tests.Branchy, loss_fn=blocking_tests.branchy_loss,
                                     steps=6, zero_grad="after_forward")


def test_blocking_cnn_adam():
    blocking_tests.train_and_compare(blocking_tests.CNN, blocking_tests.adam, x_shape=(1, 12, 12))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_nonblocking(set_to_none):
    nonblocking_tests.run(zero="before", set_to_none=set_to_none)


@pytest.mark.parametrize("finish", ["eval", "synchronize", "state_dict", "inner_state_dict",
                                    "inner_forward"])
def test_a_pending_update_is_finished_by(finish):
    nonblocking_tests.run(finish=finish, steps=3)


def test_nonblocking_cnn_adam_and_a_scheduler():
    nonblocking_tests.test_cnn_with_adam()
    nonblocking_tests.test_scheduler_changes_the_lr_before_the_deferred_update()
    nonblocking_tests.test_module_zero_grad_bypassing_the_wrapper()


def test_nonblocking_accumulation():
    nonblocking_tests.test_gradient_accumulation()


@pytest.mark.parametrize("blocking", [True, False])
def test_join(blocking):
    join_tests.test_uneven_batches_match_the_reference(blocking, join_tests.sgd)


@pytest.mark.parametrize("habit", ["clip", "amp"])
def test_blocking_clipping_and_grad_scaler(habit):
    blocking_tests.train_with_habits(habit)


@pytest.mark.parametrize("blocking", [True, False])
def test_no_sync(blocking):
    ddp_habits.test_no_sync_accumulates_locally_then_averages_the_sum(blocking)
    ddp_habits.test_no_sync_keeps_gradients_of_parameters_the_last_backward_misses(blocking)


def test_the_setting_must_match_across_ranks(monkeypatch):
    if mpidp.size() < 2:
        pytest.skip("needs 2 ranks")
    monkeypatch.setenv("MPIDP_DP_DEVICE_COMM", "standin" if mpidp.rank() == 0 else "staging")
    with pytest.raises(ValueError, match="MPIDP_DP_DEVICE_COMM"):
        mpidp.DataParallel(torch.nn.Linear(3, 2))


def test_wire_compression_goes_through_the_host():
    dp = mpidp.DataParallel(torch.nn.Linear(3, 2).to(DEVICE), wire_dtype=torch.bfloat16)
    assert not dp._reducer.device_resident


def test_nccl_refuses_cpu_parameters(monkeypatch):
    monkeypatch.setenv("MPIDP_DP_DEVICE_COMM", "nccl")
    with pytest.raises(ValueError, match="MPIDP_DP_DEVICE_COMM=nccl: rank 0: the parameters are on cpu"):
        mpidp.DataParallel(torch.nn.Linear(3, 2))


# The habits users bring, on the device path, against the same references.

@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
@pytest.mark.parametrize("habit", ["clip", "amp", "amp-step-only"])
def test_clipping_and_grad_scaler_between_backward_and_step(habit, blocking):
    blocking_tests.test_clipping_and_grad_scaler_between_backward_and_step(habit, blocking)


def test_nonblocking_edit_without_synchronize_raises_instead_of_being_lost():
    blocking_tests.test_nonblocking_edit_without_synchronize_raises_instead_of_being_lost()


@pytest.mark.parametrize("zero_grad", ["none", "zeros", "after_forward"])
def test_parameter_unused_in_some_steps_and_ranks(zero_grad):
    blocking_tests.test_parameter_unused_in_some_steps_and_ranks(zero_grad)


def test_tied_and_frozen_parameters_and_500_small_tensors():
    blocking_tests.test_tied_parameters()
    blocking_tests.test_frozen_parameters_stay_frozen_and_equal()
    blocking_tests.test_500_small_parameter_tensors()


def test_gradient_accumulation_and_no_optimizer():
    blocking_tests.test_gradient_accumulation(blocking_tests.adam)
    blocking_tests.test_without_optimizer_gradients_are_averaged()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_wrapping_again_and_dropping_a_wrapper(blocking, monkeypatch):
    rewrap_tests.test_a_second_wrapper_replaces_the_first(blocking)
    rewrap_tests.test_wrap_drop_wrap_again_keeps_one_set_of_hooks(blocking)
    rewrap_tests.test_a_dropped_wrapper_is_freed_at_once(blocking, False, monkeypatch)


def test_a_layer_run_directly_applies_a_pending_update_first():
    """Device-resident buckets are applied whole at the start of the wrapper's
    forward, without a hook per layer: a layer run on its own still reads its
    parameters through the watched dicts, which apply the update first."""
    import copy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(DEVICE)
    reference = copy.deepcopy(model)
    opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=False)
    x = torch.randn(3, 4, device=DEVICE)
    net(x).sum().backward()      # the same batch on every rank: the mean is this gradient
    opt.step()
    reference(x).sum().backward()
    ref_opt.step()
    probe = torch.ones(1, 8, device=DEVICE)
    with torch.no_grad():
        assert torch.allclose(model[2](probe), reference[2](probe), atol=1e-6)
        assert torch.allclose(model(x), reference(x), atol=1e-6)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_buffers_follow_rank0_summed_on_the_device(blocking):
    """Buffers are broadcast through the device communicator (bytes summed
    with zeros), BatchNorm's integer counter too."""
    ddp_habits.test_buffers_follow_rank0_before_every_training_forward(True, blocking)
    ddp_habits.test_two_forwards_before_one_backward_with_batchnorm(blocking)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_mpi_on_the_buckets_where_they_live(blocking, monkeypatch):
    """MPIDP_DP_DEVICE_COMM=mpi: MPI sums the buckets in place (a CUDA-aware
    MPI on a GPU; here host memory), ordered on the host."""
    if ON_GPU and not mpidp._C.mpi_cuda_aware():
        monkeypatch.setenv("MPIDP_DP_DEVICE_COMM", "mpi")
        with pytest.raises(ValueError, match="does not take device pointers"):
            mpidp.DataParallel(torch.nn.Linear(3, 2).to(DEVICE))
        return
    monkeypatch.setenv("MPIDP_DP_DEVICE_COMM", "mpi")
    dp = mpidp.DataParallel(torch.nn.Linear(3, 2).to(DEVICE))
    assert dp._reducer.device_resident and dp._reducer._staging._dc.kind == "mpi"
    del dp
    if blocking:
        blocking_tests.train_and_compare(blocking_tests.CNN, blocking_tests.adam, x_shape=(1, 12, 12))
    else:
        nonblocking_tests.run(zero="before", set_to_none=True)
    ddp_habits.test_buffers_follow_rank0_before_every_training_forward(True, blocking)
