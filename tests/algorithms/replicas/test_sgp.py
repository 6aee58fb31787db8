"""SGP, the SlowMo base algorithm of gossip (slowmo_base_algorithm=SGP), at
1-4 ranks with one rank per node and (at 2 and 4 ranks) two.

Against a single-process simulation of every node's replica with a mixing
matrix written here from fairscale's construction (the default graph's phone
book +1, -1, +2, -2, .. without repeats, one entry per round; the ring's
next worker), each replica mixed as w x_i + w x_j over its in-peers in the
graph's order (w = 1/2 with one peer per round), compared after every step.
With two workers a round is the exact mean (fairscale's SGP tests rely on
it); the slow momentum on top, plain and memory-efficient. The gossip
graphs' Python API against fairscale's answers; one node turns SGP off with
a warning; a checkpoint resumes the gossip where it was; bad settings are
named."""

import copy
import warnings

import pytest
import torch

import mpidp
from dp_reference import (RANK, SIZE, SmallNet as Net, differing_steps, flat_params, local_steps,
                          node_replicas, per_node_options, regression_batches,
                          slow_momentum_step, slowmo_step)
from mpidp import gossip

pytestmark = pytest.mark.ranks3


LR = 0.1


def batches(steps):
    return regression_batches(6, steps)


def phone_book(graph, world):
    """Offsets of fairscale's phone book, written from its construction."""
    if graph == "ring":
        candidates = [1, -1]
    else:  # DynamicDirectedExponentialGraph: +-2^i for i <= log2(world - 1)
        candidates = []
        i = 0
        while 2 ** i <= world - 1:
            candidates += [2 ** i, -(2 ** i)]
            i += 1
    book = []
    for d in candidates:
        if d % world and d % world not in book:
            book.append(d % world)
    return book


def in_peer(graph, world, worker, t):
    book = phone_book(graph, world)
    offset = book[0] if graph == "ring" else book[t % len(book)]
    return (worker - offset) % world


def simulate(init, data, per_node, graph, alpha, beta, m, memory_efficient):
    nodes = SIZE // per_node
    replicas, opts, theta, u = node_replicas(init, nodes, LR)
    slow = alpha != 1.0 or beta != 0.0
    history = []
    for t, (x, y) in enumerate(data):
        local_steps(replicas, opts, x, y, per_node)
        if nodes > 1:                      # one gossip round: w x_i + w x_j
            xs = [flat_params(r) for r in replicas]
            for n, r in enumerate(replicas):
                mixed = xs[n] * 0.5 + xs[in_peer(graph, nodes, n, t)] * 0.5
                torch.nn.utils.vector_to_parameters(mixed, r.parameters())
        if slow and (t + 1) % m == 0:
            slow_momentum_step(replicas, theta, u, beta, alpha, LR, memory_efficient)
        history.append(flat_params(replicas[RANK // per_node]).clone())
    return history


def make(model, per_node, graph="dde", **kwargs):
    nodes = SIZE // per_node
    g = None
    if graph == "ring" and nodes > 1:
        node_rank = RANK // per_node
        g = gossip.RingGraph(node_rank, nodes, per_node, RANK % per_node)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # one node: SGP off
        return mpidp.SlowMoDistributedDataParallel(
            model, nprocs_per_node=per_node, slowmo_base_algorithm=mpidp.SlowMoBaseAlgorithm.SGP,
            graph=g, **kwargs)


def train(net, data, each=None):
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    for t, (x, y) in enumerate(data):
        slowmo_step(net, opt, x, y)
        if each:
            each(t)
    return opt


@pytest.mark.parametrize("per_node", per_node_options())
@pytest.mark.parametrize("graph,alpha,beta,m,memory_efficient", [
    ("dde", 1.0, 0.0, 48, True),        # gossip alone
    ("ring", 1.0, 0.0, 48, True),
    ("dde", 0.7, 0.5, 3, False),        # with slow momentum every 3 steps
    ("dde", 0.7, 0.5, 3, True),
])
def test_every_step_matches_the_gossip_simulation(per_node, graph, alpha, beta, m, memory_efficient):
    torch.manual_seed(0)
    init = Net()
    data = batches(9)
    want = simulate(init, data, per_node, graph, alpha, beta, m, memory_efficient)
    model = copy.deepcopy(init)
    net = make(model, per_node, graph, slowmo_momentum=beta, slowmo_lr=alpha, slowmo_frequency=m,
               slowmo_memory_efficient=memory_efficient, slowmo_num_shards=3)
    assert net.sgp == (SIZE // per_node > 1)

    def compare(t):
        got = flat_params(model)
        torch.testing.assert_close(got, want[t], rtol=1e-5, atol=1e-6, msg=lambda s: f"step {t}: {s}")

    train(net, data, compare)


@pytest.mark.skipif(SIZE not in (2, 4), reason="two workers of 1 or 2 ranks")
def test_with_two_workers_a_round_is_the_exact_mean():
    """Gossip between two workers averages them exactly: the replicas agree
    bit for bit after every step, and equal LocalSGD averaging every step."""
    per_node = SIZE // 2
    torch.manual_seed(0)
    model, other = Net(), Net()
    other.load_state_dict(model.state_dict())
    data = batches(5)
    sgp = make(model, per_node, slowmo_momentum=0.0)
    local = mpidp.SlowMoDistributedDataParallel(other, nprocs_per_node=per_node, slowmo_momentum=0.0,
                                                localsgd_frequency=1)
    opt = torch.optim.SGD(local.parameters(), lr=LR, momentum=0.9)

    def compare(t):
        slowmo_step(local, opt, *data[t])
        mine = flat_params(model)
        theirs = flat_params(other)
        assert torch.equal(mine, theirs), f"step {t}: gossip differs from the exact mean"
        everyone = mpidp.allgather(mine.unsqueeze(0))
        assert all(torch.equal(everyone[0], row) for row in everyone), f"step {t}"

    train(sgp, data, compare)


@pytest.mark.skipif(SIZE < 2, reason="the gossip state needs two workers")
def test_a_checkpoint_resumes_the_gossip_where_it_was():
    torch.manual_seed(0)
    init = Net()
    data = batches(8)
    straight = make(copy.deepcopy(init), 1)
    train(straight, data)
    first = make(copy.deepcopy(init), 1)
    opt = train(first, data[:5])
    state, opt_state = first.slowmo_state_dict(), opt.state_dict()
    assert state["sgp"]["round"] == 5
    resumed = make(Net(), 1)
    resumed.load_slowmo_state_dict(state)
    opt2 = torch.optim.SGD(resumed.parameters(), lr=LR, momentum=0.9)
    opt2.load_state_dict(opt_state)
    for x, y in data[5:]:
        slowmo_step(resumed, opt2, x, y)
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)


@pytest.mark.skipif(SIZE < 2, reason="the gossip state needs two workers")
def test_a_checkpoint_loaded_on_one_rank_alone_is_an_error_at_the_next_gossip():
    """The gossip mixes every step: a rank back at round 2 would mix its old
    replica into its peers' with no error. Every rank raises instead."""
    torch.manual_seed(0)
    net = make(Net(), 1)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    data = batches(6)
    for t, (x, y) in enumerate(data[:4]):
        if t == 2:
            saved = copy.deepcopy((net.slowmo_state_dict(), opt.state_dict()))
        slowmo_step(net, opt, x, y)
    if RANK == SIZE - 1:
        net.load_slowmo_state_dict(saved[0])
        opt.load_state_dict(saved[1])
    with pytest.raises(RuntimeError, match=differing_steps("SlowMoDistributedDataParallel", 2, 4)):
        for x, y in data[4:]:
            slowmo_step(net, opt, x, y)


def test_one_node_turns_sgp_off_with_a_warning():
    with pytest.warns(UserWarning, match="SGP gossips between nodes and there is one"):
        net = mpidp.SlowMoDistributedDataParallel(Net(), nprocs_per_node=SIZE,
                                                  slowmo_base_algorithm="sgp")
    assert not net.sgp


def test_graphs_answer_as_fairscales():
    g = gossip.DynamicDirectedExponentialGraph(0, 8)
    assert g.get_peers() == ([1], [7])
    assert g.get_peers(rotate=True) == ([7], [1])
    assert g.get_peers(rotate=True) == ([2], [6])
    # Workers are nodes: peers come back as the counterparts' ranks.
    g = gossip.DynamicDirectedExponentialGraph(1, 4, nprocs_per_node=2, local_rank=1)
    assert g.get_peers() == ([5], [1])
    assert gossip.RingGraph(2, 5).get_peers(rotate=True) == ([3], [1])
    assert not gossip.RingGraph(0, 3).is_dynamic_graph()
    b = gossip.DynamicBipartiteLinearGraph(2, 6)
    assert b.is_bipartite_graph() and b.is_passive() and not b.is_passive(3)
    n = gossip.NPeerDynamicDirectedExponentialGraph(4, 9, peers_per_itr=2)
    n.get_peers(rotate=True)
    assert n.get_peers() == ([7, 1], [1, 7])
    assert gossip.UniformMixing(n).get_mixing_weights() == {"uniform": 1 / 3, "lo": 1 / 3}


def test_bad_gossip_settings_are_named():
    with pytest.raises(ValueError, match="bipartite graph .* even number"):
        gossip.DynamicBipartiteExponentialGraph(0, 5)
    with pytest.raises(ValueError, match="rank: expected 0 .. 3"):
        gossip.RingGraph(4, 4)
    with pytest.raises(ValueError, match="phone book holds 2"):
        gossip.RingGraph(0, 4, peers_per_itr=3)
    with pytest.raises(TypeError, match="graph: expected an mpidp.gossip graph"):
        gossip.UniformMixing("ring")
    with pytest.raises(ValueError, match="graph, mixing: gossip settings"):
        mpidp.SlowMoDistributedDataParallel(Net(), graph=gossip.RingGraph(0, 2))
    with pytest.raises(ValueError, match="overlap, synch_freq: SGP runs synchronously"):
        mpidp.SlowMoDistributedDataParallel(Net(), slowmo_base_algorithm="sgp", overlap=True)
    with pytest.raises(TypeError, match="mixing: expected an mpidp.gossip mixing manager"):
        mpidp.SlowMoDistributedDataParallel(Net(), slowmo_base_algorithm="sgp", mixing="uniform")
    if SIZE >= 2:
        with pytest.raises(ValueError, match="graph: built for worker"):
            mpidp.SlowMoDistributedDataParallel(Net(), nprocs_per_node=1,
                                                slowmo_base_algorithm="sgp",
                                                graph=gossip.RingGraph(0, SIZE + 1))
