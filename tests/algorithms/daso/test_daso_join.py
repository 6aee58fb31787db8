"""Uneven inputs with DASO: `with net.join():` around an epoch's batch loop.

Rank r has 3, 5 or 8 batches (r % 3). With a blocking average every batch,
fp32 on the wire and plain SGD, DASO's update at step i is the mean over the
nodes that still train of the mean gradient of their ranks that still train:
the single-process reference below computes exactly that on exactly the data
that was trained on."""

import pytest
import torch
import torch.nn.functional as F

import mpidp
from dp_reference import RANK, SIZE, assert_params_close, assert_same_on_all_ranks, seeded

pytestmark = pytest.mark.ranks3

BATCHES = (3, 5, 8)
LAYOUTS = [k for k in (1, 2) if SIZE % k == 0]


def n_batches(rank):
    return BATCHES[rank % len(BATCHES)]


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def data():
    g = seeded(21)
    return {r: [(torch.randn(4, 10, generator=g), torch.randint(0, 3, (4,), generator=g))
                for _ in range(n_batches(r))] for r in range(SIZE)}


@pytest.fixture(params=LAYOUTS, ids=lambda k: f"nodes_of_{k}")
def nodes_of(request, monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", str(request.param))
    return request.param


def run_epoch(net, daso, batches):
    daso.last_batch = len(batches) - 1
    with net.join():
        for x, y in batches:
            daso.zero_grad()
            F.cross_entropy(net(x), y).backward()
            daso.step()
    daso.epoch_loss_logic(1.0)


def test_uneven_batches_match_the_reference(nodes_of):
    batches = data()
    model = mlp(100 + RANK)
    daso = mpidp.DASO(torch.optim.SGD(model.parameters(), lr=0.1), total_epochs=2,
                      warmup_epochs=2, cooldown_epochs=0, downcast_type=torch.float32)
    net = mpidp.DataParallelMultiGPU(model, daso)
    for _ in range(2):
        run_epoch(net, daso, batches[RANK])
        assert_same_on_all_ranks(model)

    reference = mlp(100)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    node_of = [r // nodes_of for r in range(SIZE)]
    for _ in range(2):
        for i in range(max(BATCHES[:SIZE])):
            active = [r for r in range(SIZE) if n_batches(r) > i]
            nodes = sorted({node_of[r] for r in active})
            ref_opt.zero_grad()
            loss = 0.0
            for n in nodes:
                here = [r for r in active if node_of[r] == n]
                loss = loss + sum(F.cross_entropy(reference(batches[r][i][0]), batches[r][i][1])
                                  for r in here) / len(here)
            (loss / len(nodes)).backward()
            ref_opt.step()
    assert_params_close(model, reference, atol=1e-5, what="after two uneven epochs")


def test_uneven_batches_through_the_cycling_phase(nodes_of, monkeypatch):
    monkeypatch.setenv("MPIDP_DASO_STAGING", "1")  # also via the host mirror GPUs use
    batches = data()
    model = mlp(100 + RANK)
    daso = mpidp.DASO(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), total_epochs=4,
                      warmup_epochs=1, cooldown_epochs=1)
    net = mpidp.DataParallelMultiGPU(model, daso)
    for epoch in range(4):
        run_epoch(net, daso, batches[RANK])
        assert_same_on_all_ranks(model)     # every epoch ends with a blocking sync
    assert daso.phase == "cooldown"


def test_join_must_wrap_an_epoch(monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "1")
    model = mlp(0)
    daso = mpidp.DASO(torch.optim.SGD(model.parameters(), lr=0.1), total_epochs=2)
    net = mpidp.DataParallelMultiGPU(model, daso)
    daso.last_batch = 3
    net(torch.randn(2, 10)).sum().backward()
    daso.step()
    with pytest.raises(RuntimeError, match="one epoch's batch loop"):
        with net.join():
            pass
