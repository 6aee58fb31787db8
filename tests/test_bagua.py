"""mpidp.with_bagua and mpidp.algorithms (Bagua's API): each algorithm against
a single-process reference of every rank's gradients, switching algorithms
mid-training (every rank equal to rank 0 bit for bit after each switch; the
sequence runs through every algorithm, as Bagua's test_model_switch does),
and the argument checks. Nodes are emulated (MPIDP_RANKS_PER_NODE) where an
algorithm is hierarchical."""

import warnings

import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE, rank_slice, seeded
from mpidp import MPI

pytestmark = pytest.mark.ranks3


def make_pair(seed=0):
    torch.manual_seed(seed)
    build = lambda: torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),  # noqa: E731
                                        torch.nn.Linear(16, 3))
    model, reference = build(), build()
    reference.load_state_dict(model.state_dict())
    return model, reference


def algorithms():
    return [mpidp.algorithms.GradientAllReduceAlgorithm(),
            mpidp.algorithms.GradientAllReduceAlgorithm(hierarchical=True),
            mpidp.algorithms.GradientAllReduceAlgorithm(average=False),
            mpidp.algorithms.ByteGradAlgorithm(),
            mpidp.algorithms.ByteGradAlgorithm(hierarchical=False)]


def reference_grads(reference, x, y, average):
    reference.zero_grad()
    for r in range(SIZE):
        loss = torch.nn.functional.mse_loss(reference(rank_slice(x, r)), rank_slice(y, r))
        (loss / SIZE if average else loss).backward()
    return [p.grad.clone() for p in reference.parameters()]


@pytest.mark.parametrize("index", range(5))
def test_gradients_match_the_reference(index, monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "2" if SIZE % 2 == 0 else "1")
    algorithm = algorithms()[index]
    model, reference = make_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # hierarchical where it cannot help
        net = mpidp.with_bagua(model, [opt], algorithm)
    assert net.module is model and net.bagua_algorithm is algorithm
    quantized = isinstance(algorithm, mpidp.algorithms.ByteGradAlgorithm)
    gen = seeded(3)
    for step in range(2):
        x, y = torch.randn(4 * SIZE, 12, generator=gen), torch.randn(4 * SIZE, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(rank_slice(x, RANK)), rank_slice(y, RANK)).backward()
        want = reference_grads(reference, x, y, algorithm.average)
        scale = max(g.abs().max().item() for g in want)
        for p, g in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=(1e-2 if quantized else 1e-6) * scale)
        opt.step()
        with torch.no_grad():
            for p, q in zip(reference.parameters(), model.parameters()):
                p.copy_(q)   # follow the model: each step is checked on its own


def test_switching_through_every_algorithm_keeps_ranks_equal_to_rank_0(monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "2" if SIZE % 2 == 0 else "1")
    torch.manual_seed(RANK)                       # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    net = model
    gen = seeded(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for algorithm in algorithms() + algorithms()[:1]:
            net = mpidp.with_bagua(net, [opt], algorithm)
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            mom = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                             for p in model.parameters() if p in opt.state] or [torch.zeros(0)])
            first = MPI.COMM_WORLD.bcast((flat.numpy().tobytes(), mom.numpy().tobytes()), root=0)
            assert first == (flat.numpy().tobytes(), mom.numpy().tobytes())
            for _ in range(3):
                x, y = torch.randn(4 * SIZE, 12, generator=gen), torch.randn(4 * SIZE, 3, generator=gen)
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(rank_slice(x, RANK)), rank_slice(y, RANK)).backward()
                opt.step()
    assert isinstance(net, mpidp.BaguaModule)


def test_bad_arguments_are_named():
    model, _ = make_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="algorithm: expected an instance of a class of mpidp.algorithms"):
        mpidp.with_bagua(model, [opt], "bytegrad")
    with pytest.raises(TypeError, match="optimizers: expected torch optimizers"):
        mpidp.with_bagua(model, [object()], mpidp.algorithms.GradientAllReduceAlgorithm())
    with pytest.raises(TypeError, match="hierarchical: expected a bool"):
        mpidp.algorithms.ByteGradAlgorithm(hierarchical="yes")
    with pytest.raises(TypeError, match="module: expected a torch.nn.Module"):
        mpidp.with_bagua(3, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
