"""Bagua's DecentralizedAlgorithm and LowPrecisionDecentralizedAlgorithm
against a single-process simulation of every rank's replica, at 1-4 ranks,
flat and (with emulated nodes, MPIDP_RANKS_PER_NODE) hierarchical, compared
on every rank after every step.

The simulation is written from the updates (D-PSGD: the gradient at the
old weights applied to the average taken at the forward; DCD-PSGD on a
ring: d = x - x^_i + (x^_l + x^_i + x^_r)/3 - x^_i, 8-bit quantized by the
reference quantizer, every copy updated with the same decoded bytes), with
the peers of Bagua's shift_one rule computed here. With hierarchical=True
the workers are nodes: each simulated node averages its ranks' weights
first and works on the local ranks' slices. Also: the neighbours' copies of
a worker's weights equal its own bit for bit (Bagua's check), a checkpoint
resumes bitwise, shift_one with an odd number of workers is refused, and the
arguments are checked."""

import copy
import warnings

import pytest
import torch

import mpidp
from dp_reference import (RANK, SIZE, SmallNet, differing_steps, flat_params as flat,
                          rank_slice, regression_batches)
from mpidp import kernels
from mpidp.algorithms import DecentralizedAlgorithm, LowPrecisionDecentralizedAlgorithm
from quant_reference import q

pytestmark = pytest.mark.ranks3

LR = 0.05


class Net(SmallNet):
    def __init__(self):
        super().__init__(inputs=6, hidden=40, outputs=3)


def batches(steps):
    return regression_batches(9, steps, shape=(6, 3), per_rank=3)


def put(model, vec):
    torch.nn.utils.vector_to_parameters(vec.clone(), model.parameters())


def layouts():
    """(per_node, hierarchical): every rank a worker, and nodes of 2 where
    that makes 2 or more nodes."""
    out = [(1, False)]
    if SIZE % 2 == 0 and SIZE >= 4:
        out.append((2, True))
    return out


class Workers:
    """The simulation's view of the workers: ranks, or nodes whose ranks
    average first and work on slices (the counts of mpidp.reduce_scatter)."""

    def __init__(self, n, per_node, hierarchical):
        self.per_node = per_node if hierarchical else 1
        self.count = SIZE // self.per_node
        self.n = n

    def slices(self):
        L = self.per_node
        counts = [self.n // L + (1 if r < self.n % L else 0) for r in range(L)]
        starts = [sum(counts[:r]) for r in range(L)]
        return [slice(s, s + c) for s, c in zip(starts, counts)]

    def values(self, xs):
        """Each worker's weights (a node's mean) from every rank's."""
        if self.per_node == 1:
            return list(xs)
        return [(xs[2 * w] + xs[2 * w + 1]) * 0.5 for w in range(self.count)]

    def ranks(self, w):
        return range(w * self.per_node, (w + 1) * self.per_node)


def shift_one_peer(n, r, t):
    half = n // 2
    s = t % half
    return (s + r) % half + half if r < half else (r - half - s) % half


def simulate_decentralized(init, data, per_node, hierarchical, mode, interval):
    replicas = [copy.deepcopy(init) for _ in range(SIZE)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in replicas]
    workers = Workers(flat(init).numel(), per_node, hierarchical)
    history = []
    for t, (x, y) in enumerate(data):
        due = t % interval == 0 and workers.count > 1
        if due:
            vals = workers.values([flat(m) for m in replicas])
            if mode == "all":
                mean = torch.stack(vals).sum(0) / workers.count
                new = [mean] * workers.count
            else:
                k = t // interval
                new = [(vals[w] + vals[shift_one_peer(workers.count, w, k)]) * 0.5
                       for w in range(workers.count)]
        for r, (m, opt) in enumerate(zip(replicas, opts)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(rank_slice(x, r)), rank_slice(y, r)).backward()
        if due:
            for w in range(workers.count):
                for r in workers.ranks(w):
                    put(replicas[r], new[w])
        for opt in opts:
            opt.step()
        history.append(flat(replicas[RANK]).clone())
    return history


def simulate_low_precision(init, data, per_node, hierarchical, interval):
    replicas = [copy.deepcopy(init) for _ in range(SIZE)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in replicas]
    workers = Workers(flat(init).numel(), per_node, hierarchical)
    n = workers.count
    hats = [flat(init).clone() for _ in range(n)]     # x^_w, as every neighbour holds it
    history = []
    for t, (x, y) in enumerate(data):
        for r, (m, opt) in enumerate(zip(replicas, opts)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(rank_slice(x, r)), rank_slice(y, r)).backward()
            opt.step()
        if t % interval == 0 and n > 1:
            vals = workers.values([flat(m) for m in replicas])
            decoded = []
            for w in range(n):
                left, right = hats[(w - 1) % n], hats[(w + 1) % n]
                dec = torch.empty_like(vals[w])
                for s in workers.slices():        # each local rank quantizes its slice
                    d = vals[w][s] - hats[w][s] + (left[s] + hats[w][s] + right[s]) / 3 - hats[w][s]
                    part = torch.zeros(s.stop - s.start)
                    kernels.dequantize8(part, q(d), accumulate=True, path="ref")
                    dec[s] = part
                decoded.append(dec)
            for w in range(n):
                hats[w] = hats[w] + decoded[w]
                for r in workers.ranks(w):
                    put(replicas[r], hats[w])
        history.append(flat(replicas[RANK]).clone())
    return history, hats


def run(algorithm, init, data, per_node, monkeypatch, each=None):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", str(per_node))
    model = copy.deepcopy(init)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # hierarchical with one rank per node: flat
        net = mpidp.with_bagua(model, [opt], algorithm)
    for t, (x, y) in enumerate(data):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(rank_slice(x)), rank_slice(y)).backward()
        opt.step()
        if each:
            each(t, model, net)
    return net, opt


def close(got, want, t, exact):
    if exact:
        assert torch.equal(got, want), f"step {t}: differs from the simulation"
    else:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6, msg=lambda s: f"step {t}: {s}")


@pytest.mark.parametrize("per_node,hierarchical", layouts())
@pytest.mark.parametrize("mode,interval", [("all", 1), ("all", 2), ("shift_one", 1), ("shift_one", 3)])
def test_decentralized_matches_the_replica_simulation(per_node, hierarchical, mode, interval,
                                                      monkeypatch):
    workers = SIZE // per_node if hierarchical else SIZE
    if mode == "shift_one" and workers > 1 and workers % 2:
        pytest.skip("shift_one needs an even number of workers (refusal tested below)")
    torch.manual_seed(0)
    init = Net()
    data = batches(7)
    want = simulate_decentralized(init, data, per_node, hierarchical, mode, interval)
    # Pairwise means (and 2-rank allreduces) add two numbers: exact; larger
    # allreduces may add in another order than the simulation.
    exact = mode == "shift_one" or workers <= 2
    run(DecentralizedAlgorithm(hierarchical=hierarchical, peer_selection_mode=mode,
                               communication_interval=interval), init, data, per_node, monkeypatch,
        lambda t, model, net: close(flat(model), want[t], t, exact))


@pytest.mark.parametrize("per_node,hierarchical", layouts())
@pytest.mark.parametrize("interval", [1, 2])
def test_low_precision_matches_the_replica_simulation_and_copies_agree(per_node, hierarchical,
                                                                       interval, monkeypatch):
    torch.manual_seed(0)
    init = Net()
    data = batches(6)
    want, hats = simulate_low_precision(init, data, per_node, hierarchical, interval)

    def compare(t, model, net):
        close(flat(model), want[t], t, exact=True)

    net, _ = run(LowPrecisionDecentralizedAlgorithm(hierarchical=hierarchical,
                                                    communication_interval=interval),
                 init, data, per_node, monkeypatch, compare)
    h = net.bagua_driver
    if h.workers.size > 1:
        # Bagua's check: my left neighbour's copy of me is my own copy, bit for bit.
        w, n = h.workers.rank, h.workers.size
        slices = Workers(flat(init).numel(), per_node, hierarchical).slices()
        mine = slices[h.workers.node.Get_rank()] if h.workers.node is not None else slice(None)
        assert torch.equal(h.replicas[1], hats[w][mine])
        assert torch.equal(h.replicas[0], hats[(w - 1) % n][mine])
        assert torch.equal(h.replicas[2], hats[(w + 1) % n][mine])


@pytest.mark.parametrize("algorithm", ["decentralized", "low_precision"])
def test_a_checkpoint_resumes_bitwise(algorithm, monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "1")
    make = (lambda: DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="all",
                                           communication_interval=2)) \
        if algorithm == "decentralized" else \
        (lambda: LowPrecisionDecentralizedAlgorithm(hierarchical=False, communication_interval=2))
    torch.manual_seed(0)
    init = Net()
    data = batches(7)
    straight, _ = run(make(), init, data, 1, monkeypatch)
    first, opt = run(make(), init, data[:3], 1, monkeypatch)
    state = (copy.deepcopy(first.module.state_dict()), opt.state_dict(), first.bagua_state_dict())
    model = Net()
    opt2 = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model.load_state_dict(state[0])
    net = mpidp.with_bagua(model, [opt2], make())
    # with_bagua starts every rank from rank 0's model: put this rank's back.
    model.load_state_dict(state[0])
    opt2.load_state_dict(state[1])
    net.load_bagua_state_dict(state[2])
    for x, y in data[3:]:
        opt2.zero_grad()
        torch.nn.functional.mse_loss(net(rank_slice(x)), rank_slice(y)).backward()
        opt2.step()
    assert torch.equal(flat(model), flat(straight.module))


@pytest.mark.parametrize("algorithm", ["all", "shift_one", "low_precision"])
@pytest.mark.skipif(SIZE < 2, reason="needs a rank that differs")
def test_a_checkpoint_loaded_on_one_rank_alone_is_an_error_on_every_rank(algorithm, monkeypatch):
    """A rank that went back to step 1 would average with the others' later
    weights (or pair with another step's partner) with no error: every rank
    raises at the next exchange instead, naming each rank's step."""
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "1")
    if algorithm == "shift_one" and SIZE % 2:
        pytest.skip("shift_one pairs an even number of workers")
    algo = (LowPrecisionDecentralizedAlgorithm(hierarchical=False)
            if algorithm == "low_precision" else
            DecentralizedAlgorithm(hierarchical=False, peer_selection_mode=algorithm))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    net = mpidp.with_bagua(model, [opt], algo)

    def step(x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(rank_slice(x)), rank_slice(y)).backward()
        opt.step()

    data = batches(6)
    for t, (x, y) in enumerate(data[:3]):
        if t == 1:
            saved = copy.deepcopy(net.bagua_state_dict())
        step(x, y)
    if RANK == SIZE - 1:
        net.load_bagua_state_dict(saved)
    name = "LowPrecisionDecentralized" if algorithm == "low_precision" else "Decentralized"
    with pytest.raises(RuntimeError, match=differing_steps(f"{name}Algorithm", "[12]", "[34]")):
        for x, y in data[3:]:
            step(x, y)


@pytest.mark.skipif(SIZE != 3, reason="an odd number of workers")
def test_shift_one_with_an_odd_number_of_workers_is_refused(monkeypatch):
    monkeypatch.setenv("MPIDP_RANKS_PER_NODE", "1")
    model = Net()
    with pytest.raises(ValueError, match="peer_selection_mode: 'shift_one' pairs the workers .* got 3"):
        mpidp.with_bagua(model, [torch.optim.SGD(model.parameters(), lr=LR)],
                         DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="shift_one"))


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="peer_selection_mode: expected one of 'all', 'shift_one'"):
        DecentralizedAlgorithm(peer_selection_mode="ring")
    with pytest.raises(TypeError, match="communication_interval"):
        DecentralizedAlgorithm(communication_interval=1.0)
    with pytest.raises(ValueError, match="communication_interval"):
        LowPrecisionDecentralizedAlgorithm(communication_interval=0)
    with pytest.raises(TypeError, match="hierarchical"):
        LowPrecisionDecentralizedAlgorithm(hierarchical="yes")
    model = Net().double()
    with pytest.raises(TypeError, match="module: decentralized algorithms average float32"):
        mpidp.with_bagua(model, [torch.optim.SGD(model.parameters(), lr=LR)],
                         DecentralizedAlgorithm(hierarchical=False))


@pytest.mark.skipif(SIZE < 2, reason="copies of a neighbour's weights need a neighbour")
def test_mpidp_check_passes_healthy_runs_and_catches_a_corrupted_copy(monkeypatch):
    monkeypatch.setenv("MPIDP_CHECK", "1")
    monkeypatch.setenv("MPIDP_CHECK_EVERY", "1")
    torch.manual_seed(0)
    init = Net()
    data = batches(3)
    run(DecentralizedAlgorithm(hierarchical=False), init, data, 1, monkeypatch)  # no false alarm
    net, opt = run(LowPrecisionDecentralizedAlgorithm(hierarchical=False), init, data, 1,
                   monkeypatch)
    if RANK == 0:
        net.bagua_driver.replicas[1][0] += 1.0          # rank 0's own copy no longer its neighbours'
    x, y = data[0]
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(rank_slice(x)), rank_slice(y)).backward()
    with pytest.raises(RuntimeError, match=r"copies of the weights of rank\(s\) \[0\] differ"):
        opt.step()
