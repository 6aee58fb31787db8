"""hvd.elastic's state and sampler without a failure (the failures are
tests/fault_tolerance/ulfm/test_horovod_elastic.py, under ULFM): commit / restore / sync
against what rank 0 held, ElasticSampler's shares against a reference
split, and run()'s clear error where fault tolerance is off."""

import pytest
import torch

import mpidp.horovod.torch as hvd
from dp_reference import RANK, SIZE
from mpidp import fault_tolerance

pytestmark = pytest.mark.ranks3


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield


def test_run_without_fault_tolerance_names_ulfm():
    if fault_tolerance.enabled():
        pytest.skip("this pass runs in fault-tolerant mode")

    @hvd.elastic.run
    def train(state):
        return "ran"
    with pytest.raises(RuntimeError, match="ULFM.*--with-ft ulfm"):
        train(hvd.elastic.TorchState(step=0))


def test_torch_state_commit_restore_sync():
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, float(RANK))
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (RANK + 1), momentum=0.9)
    state = hvd.elastic.TorchState(model, opt, epoch=RANK, batch=7)
    state.sync()                       # rank 0's everything
    assert torch.equal(model.weight, torch.zeros(2, 3))
    assert (state.epoch, state.batch) == (0, 7)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state.epoch = 3
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state.epoch = 4
    state.restore()
    assert state.epoch == 3
    assert all(torch.equal(a, b) for a, b in zip(committed, model.parameters()))
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)
    assert all(p.grad is None for p in model.parameters())


def test_elastic_sampler_shares_what_is_left():
    data = list(range(23))
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=5)
    sampler.set_epoch(2)
    order = torch.randperm(23, generator=torch.Generator().manual_seed(5 + 2)).tolist()
    total = -(-23 // SIZE) * SIZE
    padded = order + order[:total - 23]
    shares = hvd.allgather_object(list(sampler))
    assert shares == [padded[r:total:SIZE] for r in range(SIZE)]
    assert len({len(s) for s in shares}) == 1
    covered = set().union(*map(set, shares))
    assert covered == set(data)
    # Each rank processed its first batch of 2; a sync (as after a reset)
    # gives every rank a share of the rest only.
    sampler.record_batch(0, 2)
    state = hvd.elastic.TorchState(sampler=sampler)
    state.sync()
    done = set().union(*map(set, (s[:2] for s in shares)))
    assert set(sampler.processed_indices) == done
    rest = set().union(*map(set, hvd.allgather_object(list(sampler))))
    assert rest == set(data) - done
    sampler.set_epoch(3)
    assert len(sampler.processed_indices) == 0 and len(sampler) == -(-23 // SIZE)
