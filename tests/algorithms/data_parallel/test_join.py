"""Uneven inputs: `with net.join():` lets ranks with fewer batches finish.

Rank r has 3, 5 or 8 batches (by r % 3). The single-process reference sees
exactly what was trained on: at step i, the mean of the losses of the ranks
that still had a batch i."""

import pytest
import torch
import torch.nn.functional as F

import mpidp
from dp_reference import (RANK, SIZE, assert_params_close, assert_same_on_all_ranks, build,
                          on_device, seeded)
from test_data_parallel import MLP, adam, sgd

pytestmark = pytest.mark.ranks3

BATCHES = (3, 5, 8)


def n_batches(rank):
    return BATCHES[rank % len(BATCHES)]


def all_data():
    g = seeded(11)
    return {r: [on_device(torch.randn(4, 10, generator=g), torch.randint(0, 4, (4,), generator=g))
                for _ in range(n_batches(r))] for r in range(SIZE)}


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("make_opt", [sgd, adam], ids=["sgd", "adam"])
def test_uneven_batches_match_the_reference(blocking, make_opt):
    data = all_data()
    model, reference = build(MLP, 100 + RANK), build(MLP, 100)
    opt = mpidp.DataParallelOptimizer(make_opt(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=blocking)
    with net.join():
        for x, y in data[RANK]:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    ref_opt = make_opt(reference.parameters())
    for i in range(max(n_batches(r) for r in range(SIZE))):
        active = [r for r in range(SIZE) if n_batches(r) > i]
        ref_opt.zero_grad()
        loss = sum(F.cross_entropy(reference(data[r][i][0]), data[r][i][1]) for r in active)
        (loss / len(active)).backward()
        ref_opt.step()
    assert_params_close(model, reference, what="after join")
    assert_same_on_all_ranks(model)


def test_optimizer_state_is_each_ranks_own_by_default():
    model = build(MLP, 100 + RANK)
    opt = mpidp.DataParallelOptimizer(adam(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=True)
    with net.join():
        for x, y in all_data()[RANK]:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    steps = opt.torch_optimizer.state[model.l1.weight]["step"].item()
    assert steps == n_batches(RANK)           # its own steps, no phantom ones
    assert_same_on_all_ranks(model)


def test_join_twice_then_train_on_with_adopted_optimizer_state():
    model = build(MLP, 100 + RANK)
    opt = mpidp.DataParallelOptimizer(sgd(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=True)
    for _ in range(2):
        with net.join(adopt_optimizer_state=True):
            for x, y in all_data()[RANK]:
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                opt.step()
    # Even steps after join() average over every rank again.
    opt.zero_grad()
    x, y = on_device(torch.ones(2, 10) * RANK, torch.zeros(2, dtype=torch.long))
    F.cross_entropy(net(x), y).backward()
    opt.step()
    assert_same_on_all_ranks(model)


def test_join_is_not_reentrant():
    net = mpidp.DataParallel(build(MLP, 0), blocking_parameter_updates=True)
    with net.join():
        with pytest.raises(RuntimeError, match="already active"):
            with net.join():
                pass
