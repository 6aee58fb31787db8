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


def every_algorithm(opt):
    """One instance of every algorithm (several settings of some), QAdam last:
    past its warm-up its optimizer steps only under QAdamAlgorithm."""
    decentralized = [mpidp.algorithms.DecentralizedAlgorithm(),
                     mpidp.algorithms.DecentralizedAlgorithm(hierarchical=False,
                                                             communication_interval=2),
                     mpidp.algorithms.LowPrecisionDecentralizedAlgorithm(),
                     mpidp.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1),
                     mpidp.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=0,
                                                                 warmup_steps=2)]
    if SIZE != 3:                               # shift_one pairs an even number of workers
        decentralized.append(mpidp.algorithms.DecentralizedAlgorithm(peer_selection_mode="shift_one"))
    return (algorithms() + decentralized + algorithms()[:1]
            + [mpidp.algorithms.QAdamAlgorithm(opt)])


def test_switching_through_every_algorithm_keeps_ranks_equal_to_rank_0(monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "2" if SIZE % 2 == 0 else "1")
    torch.manual_seed(RANK)                       # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    steps = 3
    opt = mpidp.algorithms.QAdamOptimizer(model.parameters(), lr=0.01)
    sequence = every_algorithm(opt)
    # Adam for every algorithm before QAdam; one warm-up step under QAdam,
    # then its 8-bit momentum steps.
    opt.warmup_steps = steps * (len(sequence) - 1) + 1
    net = model
    gen = seeded(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for algorithm in sequence:
            net = mpidp.with_bagua(net, [opt], algorithm)
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            state = torch.cat([v.reshape(-1).float() for p in model.parameters()
                               for v in opt.state.get(p, {}).values()] or [torch.zeros(0)])
            first = MPI.COMM_WORLD.bcast((flat.numpy().tobytes(), state.numpy().tobytes()), root=0)
            assert first == (flat.numpy().tobytes(), state.numpy().tobytes()), repr(algorithm)
            for _ in range(steps):
                x, y = torch.randn(4 * SIZE, 12, generator=gen), torch.randn(4 * SIZE, 3, generator=gen)
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(rank_slice(x, RANK)), rank_slice(y, RANK)).backward()
                opt.step()
    assert isinstance(net, mpidp.BaguaModule)
    assert opt.param_groups[0]["qadam_step"] == steps * len(sequence)   # QAdam's steps ran


@pytest.mark.parametrize("adopt", [False, True])
def test_join_lets_ranks_with_fewer_batches_finish(adopt, monkeypatch):
    """GradientAllReduce under join(): rank r trains 2 + r batches; every rank
    ends with the parameters (and, adopting, the optimizer state) of the rank
    that trained longest. Algorithms without join say so."""
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "1")
    model, _ = make_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    net = mpidp.with_bagua(model, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
    gen = seeded(4)
    data = [(torch.randn(4, 12, generator=gen), torch.randn(4, 3, generator=gen))
            for _ in range(2 + SIZE)]
    with net.join(adopt_optimizer_state=adopt):
        for x, y in data[:2 + RANK]:
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mom = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    first = MPI.COMM_WORLD.bcast((flat.numpy().tobytes(), mom.numpy().tobytes()), root=0)
    assert (first[0] == flat.numpy().tobytes()) or SIZE == 1
    assert (first[1] == mom.numpy().tobytes()) == (adopt or SIZE == 1 or RANK == 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = mpidp.with_bagua(net, [opt], mpidp.algorithms.DecentralizedAlgorithm())
    with pytest.raises(NotImplementedError, match="join: DecentralizedAlgorithm does not support"):
        net.join()


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


@pytest.mark.skipif(SIZE < 2, reason="differing ranks need two")
def test_algorithms_or_settings_that_differ_across_ranks_are_named():
    """Ranks that pick different algorithms (or settings) would post
    different communication and hang until the timeout; every rank raises
    instead, naming the setting. Rank 0's optimizer state may differ: it is
    broadcast."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (RANK + 1))
    mode = "all" if RANK == 0 else "shift_one"
    with pytest.raises(ValueError, match=r"with_bagua: the ranks' settings differ.*peer_selection"):
        mpidp.with_bagua(model, [opt], mpidp.algorithms.DecentralizedAlgorithm(
            hierarchical=False, peer_selection_mode=mode))
    algorithm = (mpidp.algorithms.GradientAllReduceAlgorithm() if RANK == 0 else
                 mpidp.algorithms.AsyncModelAverageAlgorithm())
    with pytest.raises(ValueError, match=r"settings differ.*GradientAllReduceAlgorithm"):
        mpidp.with_bagua(model, [opt], algorithm)
    net = mpidp.with_bagua(model, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
    assert opt.param_groups[0]["lr"] == 0.1                # rank 0's, not an error
    assert isinstance(net, mpidp.BaguaModule)
