"""Different models on different ranks, and parameters drifting apart, give a
clear error on every rank instead of a hang or silently different models."""

import pytest
import torch
import torch.nn.functional as F

import mpidp
from dp_reference import RANK, SIZE

LAST = SIZE - 1


def model(odd_one_out: bool):
    torch.manual_seed(0)
    width = 17 if odd_one_out else 16   # the last rank builds a different layer
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))


def test_different_models_raise_on_every_rank():
    m = model(odd_one_out=SIZE > 1 and RANK == LAST)
    if SIZE == 1:
        mpidp.DataParallel(m, blocking_parameter_updates=True)  # nothing to compare with
        return
    with pytest.raises(ValueError, match=rf"rank\(s\) \[{LAST}\] do not match rank 0.*0\.weight: shape \(17, 8\)"):
        mpidp.DataParallel(m, blocking_parameter_updates=True)


def test_different_buffers_raise_too():
    m = torch.nn.BatchNorm1d(5 if RANK != LAST else 6)
    if SIZE == 1:
        return
    with pytest.raises(ValueError, match="do not match rank 0"):
        mpidp.DataParallel(m, blocking_parameter_updates=True)


def test_drift_is_reported(monkeypatch):
    monkeypatch.setenv("MPIDP_CHECK", "1")
    monkeypatch.setenv("MPIDP_CHECK_EVERY", "1")
    m = model(False)
    opt = mpidp.DataParallelOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    net = mpidp.DataParallel(m, optimizer=opt, blocking_parameter_updates=True)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    for _ in range(2):                       # in sync: checked before each step, no error
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    if SIZE == 1:
        return
    with torch.no_grad():                    # a bug on one rank: its weights move alone
        if RANK == LAST:
            m[2].bias.add_(1e-6)
    with pytest.raises(RuntimeError, match=rf"'2\.bias' differ from rank 0's on rank\(s\) \[{LAST}\]"):
        net(x)


def test_daso_checks_after_every_epoch(monkeypatch):
    monkeypatch.setenv("MPIDP_CHECK", "1")
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "1")
    m = model(False)
    daso = mpidp.DASO(torch.optim.SGD(m.parameters(), lr=0.1), total_epochs=3, warmup_epochs=1,
                      cooldown_epochs=1)
    net = mpidp.DataParallelMultiGPU(m, daso)
    daso.last_batch = 1
    for _ in range(2):
        daso.zero_grad()
        net(torch.randn(4, 8)).sum().backward()
        daso.step()
    daso.epoch_loss_logic(1.0)               # in sync after the epoch's blocking sync
    if SIZE == 1:
        return
    with torch.no_grad():
        if RANK == LAST:
            m[0].weight.mul_(1.0001)
    with pytest.raises(RuntimeError, match=rf"DASO: parameters drifted apart.*'0\.weight'.*\[{LAST}\]"):
        _end_epoch_without_sync(daso)


def _end_epoch_without_sync(daso):
    # The drift check itself, as epoch_loss_logic runs it after each epoch.
    from mpidp._runtime.model_consistency import check_in_sync
    check_in_sync(daso._world, list(zip(daso._param_names, daso._params)), "DASO", "after epoch 1")


@pytest.mark.skipif(SIZE == 1, reason="one rank has nothing to disagree with")
@pytest.mark.parametrize("setting, mine, others", [
    ("wire_dtype", torch.float16, torch.bfloat16),      # used to train on with diverged params
    ("wire_dtype", None, torch.bfloat16),               # used to end in MPI_ERR_TRUNCATE
    ("bucket_cap_mb", 0.001, 25.0),
    ("blocking_parameter_updates", False, True),
    ("broadcast_buffers", False, True),                 # one rank would skip the broadcasts
])
def test_settings_that_differ_across_ranks_are_named(setting, mine, others):
    kwargs = {"blocking_parameter_updates": True, setting: mine if RANK == LAST else others}
    m = model(False)
    opt = mpidp.DataParallelOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=rf"settings differ: rank\(s\) \[{LAST}\] do not match "
                                         rf"rank 0 .*'setting {setting} = "):
        mpidp.DataParallel(m, optimizer=opt, **kwargs)


@pytest.mark.skipif(SIZE == 1, reason="one rank has nothing to disagree with")
def test_mpidp_check_on_one_rank_only_is_named(monkeypatch):
    if RANK == LAST:
        monkeypatch.setenv("MPIDP_CHECK", "1")
    with pytest.raises(ValueError, match=r"settings differ.*MPIDP_CHECK every"):
        mpidp.DataParallel(model(False), blocking_parameter_updates=True)


@pytest.mark.skipif(SIZE == 1, reason="one rank has nothing to disagree with")
@pytest.mark.parametrize("setting, mine, others", [
    ("warmup_epochs", 2, 1),              # used to hang until the timeout, blaming uneven batches
    ("max_global_skips", 4, 8),
    ("downcast_type", torch.float16, torch.bfloat16),
])
def test_daso_settings_that_differ_across_ranks_are_named(monkeypatch, setting, mine, others):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "1")
    m = model(False)
    kwargs = {setting: mine if RANK == LAST else others}
    daso = mpidp.DASO(torch.optim.SGD(m.parameters(), lr=0.1), total_epochs=6, **kwargs)
    with pytest.raises(ValueError, match=rf"settings differ.*'setting {setting} = "):
        mpidp.DataParallelMultiGPU(m, daso)


@pytest.mark.skipif(SIZE == 1, reason="one rank has nothing to disagree with")
def test_daso_wrapper_broadcast_buffers_that_differ_are_named(monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "1")
    m = model(False)
    daso = mpidp.DASO(torch.optim.SGD(m.parameters(), lr=0.1), total_epochs=6)
    with pytest.raises(ValueError, match=r"settings differ.*'setting broadcast_buffers = "):
        mpidp.DataParallelMultiGPU(m, daso, broadcast_buffers=RANK != LAST)
