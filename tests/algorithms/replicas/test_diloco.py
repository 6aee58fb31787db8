"""DiLoCo and Streaming DiLoCo against a single-process simulation of every
replica, at 1-4 ranks: each rank trains on its own slice of each batch, and
after every inner step compares its model with the simulation's replica of
its rank. The simulation follows torchft's description (and the spec in the
docs): at a fragment's send, Δ = θ - mean(x); at its turn, x_local = x,
x = θ, x.grad = Δ, outer step, θ = x, x = (1 - α) x + α x_local. Its timing
is recomputed here from torchft's counters, not taken from the schedule.

Also: torchft's gradient check (two replicas 2 apart give an outer gradient
of the mean difference), replicas equal on every rank after each turn,
bf16/fp16 on the wire within their rounding, a checkpoint taken with a sync
in flight resumes bit for bit, and bad arguments."""

import contextlib
import copy

import pytest
import torch

import mpidp
from dp_reference import (RANK, SIZE, SmallNet, differing_setting, differing_steps,
                          flat_params as flat, rank_slice, regression_batches)
from mpidp import MPI

pytestmark = pytest.mark.ranks3  # a group size that is not a power of two


class Net(SmallNet):
    def __init__(self):
        super().__init__(inputs=6, hidden=10, outputs=3)


def fragments_of(model, n):
    return None if n == 1 else [model.l1, model.l2]


def outer_sgd(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def inner_adam(params):
    return torch.optim.Adam(params, lr=0.02)


def batches(steps):
    return regression_batches(7, steps, shape=(6, 3))


def inner_step(model, opt, x, y, rank, habit=None):
    """One inner step; habit "clip" clips the gradients before the step,
    "autocast" runs the forward under bfloat16 autocast (CPU AMP)."""
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=habit == "autocast"):
        out = model(rank_slice(x, rank))
    torch.nn.functional.mse_loss(out.float(), rank_slice(y, rank)).backward()
    if habit == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()


def simulate(init, data, sync_every, n_fragments, delay, alpha, habit=None):
    """Every replica's parameters after every step: states[t][r] (lists of tensors)."""
    replicas = [copy.deepcopy(init) for _ in range(SIZE)]
    inner = [inner_adam(m.parameters()) for m in replicas]
    shared = copy.deepcopy(init)
    outer = outer_sgd(shared.parameters())
    frag_params = lambda m: ([list(m.parameters())] if n_fragments == 1
                             else [list(m.l1.parameters()), list(m.l2.parameters())])
    every, local_step, syncs, pending, states = sync_every // n_fragments, 0, 0, {}, []
    for x, y in data:
        for r in range(SIZE):
            inner_step(replicas[r], inner[r], x, y, r, habit)
        local_step += 1
        if local_step == every - delay:                       # send: Δ = θ - mean(x)
            f = syncs % n_fragments
            pending[f] = [s.detach() - torch.stack([frag_params(m)[f][k].detach() for m in replicas]).mean(0)
                          for k, s in enumerate(frag_params(shared)[f])]
        if local_step == every:                               # this fragment's turn
            f = syncs % n_fragments
            syncs, local_step = syncs + 1, 0
            for p in shared.parameters():
                p.grad = None
            for p, g in zip(frag_params(shared)[f], pending.pop(f)):
                p.grad = g.clone()
            outer.step()
            with torch.no_grad():
                for m in replicas:
                    for p, s in zip(frag_params(m)[f], frag_params(shared)[f]):
                        p.copy_(torch.lerp(s, p, alpha))
        states.append([[p.detach().clone() for p in m.parameters()] for m in replicas])
    return states


def train(model, data, sync_every, n_fragments, delay, alpha, wire=None, each=None, habit=None):
    inner = inner_adam(model.parameters())
    diloco = mpidp.DiLoCo(model, inner, outer_sgd(model.parameters()), sync_every,
                          model_fragments=fragments_of(model, n_fragments),
                          fragment_sync_delay=delay, fragment_update_alpha=alpha, wire_dtype=wire)
    with diloco:
        for t, (x, y) in enumerate(data):
            inner_step(model, inner, x, y, RANK, habit)
            if each:
                each(t, diloco)
    return diloco, inner


@pytest.mark.parametrize("n_fragments,delay,alpha,habit", [
    (1, 0, 0.0, None), (1, 1, 0.0, None), (1, 0, 0.5, None), (2, 0, 0.0, None), (2, 1, 0.0, None),
    (2, 1, 0.5, None), (2, 0, 1.0, None),
    (2, 1, 0.0, "clip"), (1, 0, 0.0, "autocast")])   # habits: clipping, AMP
def test_every_step_matches_the_simulated_replica(n_fragments, delay, alpha, habit):
    torch.manual_seed(0)
    init = Net()
    data = batches(13)
    states = simulate(init, data, 4, n_fragments, delay, alpha, habit)

    # Under bfloat16 autocast a last-bit difference in the averaged parameters
    # (MPI and the simulation add the ranks in different orders) can move an
    # activation's bf16 rounding: compare to bf16's resolution there.
    rtol, atol = (1e-3, 1e-4) if habit == "autocast" else (1e-5, 1e-6)

    def compare(t, diloco):
        for p, want in zip(diloco.model.parameters(), states[t][RANK]):
            torch.testing.assert_close(p.detach(), want, rtol=rtol, atol=atol,
                                       msg=lambda m: f"step {t}: {m}")

    train(copy.deepcopy(init), data, 4, n_fragments, delay, alpha, each=compare, habit=habit)


def node_sizes():
    """Ranks per emulated node: every divisor of the job's size."""
    return [k for k in range(1, SIZE + 1) if SIZE % k == 0]


def node_means(per_rank, per_node):
    """Each node's mean of its ranks' lists of arrays (or tensors): the
    replica, or gradients, of a node whose ranks average theirs."""
    return [[sum(ts) / per_node for ts in zip(*per_rank[n:n + per_node])]
            for n in range(0, len(per_rank), per_node)]


@contextlib.contextmanager
def node_workers(per_node, model):
    """Nodes of per_node consecutive ranks, each a worker: node-local
    DataParallel over `model` (held to the end: a wrapper dropped unhooks
    itself). Yields (the number of nodes, this rank's node, the
    communicator of the ranks with this rank's place on every node)."""
    node = MPI.COMM_WORLD.Split(RANK // per_node, RANK)
    cross = MPI.COMM_WORLD.Split(RANK % per_node, RANK)
    net = mpidp.DataParallel(model, node)
    try:
        yield SIZE // per_node, RANK // per_node, cross
    finally:
        del net         # its hooks go before its communicator
        node.Free()
        cross.Free()


@pytest.mark.parametrize("per_node", node_sizes())
def test_nodes_as_workers_match_the_simulated_node_replicas(per_node):
    """DiLoCo's workers as nodes: node-local DataParallel averages the node's
    gradients every step; DiLoCo syncs over cross_node_comm (one rank per
    node). Against a simulation with one replica per node that steps on the
    mean of its ranks' gradients."""
    torch.manual_seed(0)
    init, data, nodes = Net(), batches(9), SIZE // per_node
    replicas = [copy.deepcopy(init) for _ in range(nodes)]
    inners = [inner_adam(m.parameters()) for m in replicas]
    shared = copy.deepcopy(init)
    outer = outer_sgd(shared.parameters())
    states = []
    for t, (x, y) in enumerate(data):
        for n, (m, opt) in enumerate(zip(replicas, inners)):
            opt.zero_grad()
            ranks = range(n * per_node, (n + 1) * per_node)
            loss = sum(torch.nn.functional.mse_loss(m(rank_slice(x, r)), rank_slice(y, r))
                       for r in ranks) / per_node
            loss.backward()
            opt.step()
        if (t + 1) % 3 == 0:                                  # outer step every 3 inner steps
            for k, s in enumerate(shared.parameters()):
                s.grad = s.detach() - torch.stack([list(m.parameters())[k].detach()
                                                   for m in replicas]).mean(0)
            outer.step()
            with torch.no_grad():
                for m in replicas:
                    for p, s in zip(m.parameters(), shared.parameters()):
                        p.copy_(s)
        states.append([p.detach().clone() for p in replicas[RANK // per_node].parameters()])

    # As a user would emulate nodes of per_node ranks (MPIDP_RANKS_PER_NODE).
    node = MPI.COMM_WORLD.Split(RANK // per_node, RANK)
    cross = MPI.COMM_WORLD.Split(RANK % per_node, RANK)
    model = copy.deepcopy(init)
    net = mpidp.DataParallel(model, node)
    inner = inner_adam(model.parameters())
    with mpidp.DiLoCo(model, inner, outer_sgd(model.parameters()), 3, comm=cross):
        for t, (x, y) in enumerate(data):
            inner.zero_grad()
            torch.nn.functional.mse_loss(net(rank_slice(x, RANK)), rank_slice(y, RANK)).backward()
            inner.step()
            for p, want in zip(model.parameters(), states[t]):
                torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {t}: {m}")
    node.Free()
    cross.Free()


def test_cross_node_comm_holds_one_rank_per_node_in_node_order():
    topo = mpidp.topology()
    cross = mpidp.cross_node_comm()
    assert cross.Get_size() == topo.n_nodes and cross.Get_rank() == topo.node
    assert cross.allgather(topo.local_rank) == [topo.local_rank] * topo.n_nodes
    assert mpidp.cross_node_comm() is cross


def test_replicas_meet_after_each_turn_with_alpha_zero():
    torch.manual_seed(0)
    model = Net()
    turns = []

    def check(t, diloco):
        if (t + 1) % 4 == 0:  # sync_every 4, one fragment: every rank holds θ
            turns.append(t)
            gathered = MPI.COMM_WORLD.allgather(flat(diloco.model))
            assert all(torch.equal(g, gathered[0]) for g in gathered), f"step {t}"
        elif SIZE > 1 and t % 4 != 0:
            gathered = MPI.COMM_WORLD.allgather(flat(diloco.model))
            assert not all(torch.equal(g, gathered[0]) for g in gathered), f"step {t}"

    train(model, batches(9), 4, 1, 0, 0.0, each=check)
    assert turns == [3, 7]


def test_outer_gradient_is_the_mean_distance_from_the_shared_parameters():
    """torchft's test_gradient_correctness: parameters moved by +2 (rank r by
    2 + r here) give the outer gradient -(2 + mean r) with outer SGD lr 1."""
    model = torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    diloco = mpidp.DiLoCo(model, inner, outer, sync_every=1)
    start = flat(model).clone()
    seen = []
    outer.register_step_pre_hook(lambda opt, a, k: seen.append([p.grad.clone() for p in model.parameters()]))
    with diloco:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(2.0 + RANK)
        inner.step()  # no gradients: the inner step changes nothing
    mean_shift = 2.0 + (SIZE - 1) / 2
    assert all(torch.allclose(g, torch.full_like(g, -mean_shift)) for g in seen[0])
    assert torch.allclose(flat(model), start + mean_shift)  # θ - lr * Δ = the mean replica


@pytest.mark.parametrize("wire,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_compressed_outer_gradients_stay_within_their_rounding(wire, tol):
    torch.manual_seed(0)
    init = Net()
    data = batches(8)
    states = simulate(init, data, 4, 2, 1, 0.0)
    diloco, _ = train(copy.deepcopy(init), data, 4, 2, 1, 0.0, wire=wire)
    for p, want in zip(diloco.model.parameters(), states[-1][RANK]):
        torch.testing.assert_close(p.detach(), want, rtol=tol, atol=tol)
    # The last step was fragment 1's turn (l2): every rank holds its θ.
    gathered = MPI.COMM_WORLD.allgather(flat(diloco.model.l2))
    assert all(torch.equal(g, gathered[0]) for g in gathered)


@pytest.mark.parametrize("received", [False, True])
def test_a_checkpoint_with_a_sync_in_flight_resumes_exactly(received):
    torch.manual_seed(0)
    init = Net()
    data = batches(12)
    model = copy.deepcopy(init)
    inner = inner_adam(model.parameters())
    diloco = mpidp.DiLoCo(model, inner, outer_sgd(model.parameters()), 4,
                          model_fragments=fragments_of(model, 2), fragment_sync_delay=1)
    with diloco:
        for x, y in data[:7]:           # step 6 sends fragment 1; its turn is step 7
            inner_step(model, inner, x, y, RANK)
        # The progress hooks may already have completed the send (received,
        # not yet applied): the checkpoint must hold it either way.
        if received:
            diloco._syncs[1].wait()
        saved = copy.deepcopy({"model": model.state_dict(), "inner": inner.state_dict(),
                               "diloco": diloco.state_dict()})
        for x, y in data[7:]:
            inner_step(model, inner, x, y, RANK)
    assert 1 in saved["diloco"]["in_flight"]

    resumed = Net()
    resumed.load_state_dict(saved["model"])
    inner2 = inner_adam(resumed.parameters())
    inner2.load_state_dict(saved["inner"])
    diloco2 = mpidp.DiLoCo(resumed, inner2, outer_sgd(resumed.parameters()), 4,
                           model_fragments=fragments_of(resumed, 2), fragment_sync_delay=1)
    diloco2.load_state_dict(saved["diloco"])
    with diloco2:
        for x, y in data[7:]:
            inner_step(resumed, inner2, x, y, RANK)
    assert torch.equal(flat(resumed), flat(model))
    assert diloco2.step == diloco.step == 12


@pytest.mark.skipif(SIZE < 2, reason="needs a job of another size to resume")
@pytest.mark.parametrize("grow", [True, False], ids=["one rank more", "one rank fewer"])
def test_a_job_resumes_at_another_number_of_ranks(grow):
    """A job of `before` ranks saves one step into its second interval of 3;
    `after` ranks resume it: those with a checkpoint load their own, a new
    rank takes θ, the step and the outer optimizer from rank 0's
    (load_shared_state) with its replica at θ. The simulation gains that
    replica at θ at the resume, or loses the last rank's."""
    world = MPI.COMM_WORLD
    before, after = (SIZE - 1, SIZE) if grow else (SIZE, SIZE - 1)
    torch.manual_seed(0)
    init, data = Net(), batches(9)

    def inner_sgd(params):
        return torch.optim.SGD(params, lr=0.05)

    shared = copy.deepcopy(init)
    outer = outer_sgd(shared.parameters())
    replicas = {r: copy.deepcopy(init) for r in range(before)}
    expected = {}
    for t, (x, y) in enumerate(data):
        if t == 4 and grow:
            replicas[before] = copy.deepcopy(shared)
        if t == 4 and not grow:
            del replicas[after]
        for r, m in replicas.items():
            inner_step(m, inner_sgd(m.parameters()), x, y, r)
        if t % 3 == 2:
            for k, theta in enumerate(shared.parameters()):
                theta.grad = theta.detach() - torch.stack(
                    [list(m.parameters())[k].detach() for m in replicas.values()]).mean(0)
            outer.step()
            with torch.no_grad():
                for m in replicas.values():
                    for p, theta in zip(m.parameters(), shared.parameters()):
                        p.copy_(theta)
            expected[t] = [p.detach().clone() for p in shared.parameters()]

    def train(comm, steps, load=None):
        model = copy.deepcopy(init)
        inner = inner_sgd(model.parameters())
        diloco = mpidp.DiLoCo(model, inner, outer_sgd(model.parameters()), 3, comm)
        if load is not None:
            load(diloco)
        with diloco:
            for t in steps:
                inner_step(model, inner, *data[t], RANK)
                if t in expected:
                    torch.testing.assert_close(flat(model), torch.cat([e.reshape(-1) for e in
                                                                       expected[t]]),
                                               rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"step {t}: {m}")
        return diloco

    mine = None
    comm = world.Split(0 if RANK < before else MPI.UNDEFINED, RANK)
    if comm != MPI.COMM_NULL:
        mine = copy.deepcopy(train(comm, range(4)).state_dict())
        comm.Free()
    shared_state = world.bcast(mine, root=0)
    comm = world.Split(0 if RANK < after else MPI.UNDEFINED, RANK)
    if comm == MPI.COMM_NULL:
        return
    resumed = train(comm, range(4, 9), load=lambda d: d.load_state_dict(mine) if mine is not None
                    else d.load_shared_state(shared_state))
    assert resumed.step == 9
    comm.Free()


@pytest.mark.parametrize("n_fragments,delay", [(1, 0), (2, 1)])
@pytest.mark.skipif(SIZE < 2, reason="needs a rank that differs")
def test_a_checkpoint_loaded_on_one_rank_alone_is_an_error_on_every_rank(n_fragments, delay):
    """The rank that went back to step 2 would pair its syncs with the others'
    later ones (mixing replicas of different times, or MPI_ERR_TRUNCATE where
    fragments differ in size): every rank raises at the next sync instead,
    naming each rank's step, and the error names DiLoCo (not DASO)."""
    torch.manual_seed(0)
    model = Net()
    data = batches(12)
    inner = inner_adam(model.parameters())
    with mpidp.DiLoCo(model, inner, outer_sgd(model.parameters()), 4,
                      model_fragments=fragments_of(model, n_fragments),
                      fragment_sync_delay=delay) as diloco:
        for t, (x, y) in enumerate(data[:5]):
            if t == 2:
                saved = copy.deepcopy({"inner": inner.state_dict(), "diloco": diloco.state_dict()})
            inner_step(model, inner, x, y, RANK)
        if RANK == SIZE - 1:
            diloco.load_state_dict(saved["diloco"])
            inner.load_state_dict(saved["inner"])
        with pytest.raises(RuntimeError, match=differing_steps("DiLoCo")):
            for x, y in data[5:]:
                inner_step(model, inner, x, y, RANK)


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that differs")
def test_an_outer_lr_that_differs_across_ranks_is_an_error_at_the_next_sync():
    """The outer optimizer steps the shared parameters on every rank: with
    another lr on one rank they would stop being shared, with no error."""
    torch.manual_seed(0)
    model = Net()
    inner = inner_adam(model.parameters())
    outer = outer_sgd(model.parameters())
    if RANK == SIZE - 1:
        outer.param_groups[0]["lr"] = 0.35
    with pytest.raises(RuntimeError, match=differing_setting("DiLoCo", "param group 0: lr",
                                                             0.35, 0.7)):
        with mpidp.DiLoCo(model, inner, outer, 2):
            for x, y in batches(4):
                inner_step(model, inner, x, y, RANK)


def test_bad_arguments_are_named():
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = outer_sgd(model.parameters())
    for every, error in ((0, ValueError), (3, ValueError), (-2, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match="sync_every"):
            mpidp.DiLoCo(model, inner, outer, every, model_fragments=[model.l1, model.l2])
    with pytest.raises(ValueError, match="fragment_sync_delay"):
        mpidp.DiLoCo(model, inner, outer, 4, model_fragments=[model.l1, model.l2],
                     fragment_sync_delay=2)
    with pytest.raises(ValueError, match="fragment_update_alpha"):
        mpidp.DiLoCo(model, inner, outer, 4, fragment_update_alpha=1.5)
    with pytest.raises(ValueError, match="cover"):
        mpidp.DiLoCo(model, inner, outer, 4, model_fragments=[model.l1])
    with pytest.raises(ValueError, match="overlap"):
        mpidp.DiLoCo(model, inner, outer, 4, model_fragments=[model, model.l2])
    with pytest.raises(ValueError, match="outer_optimizer"):
        mpidp.DiLoCo(model, inner, outer_sgd([*model.parameters(), torch.nn.Parameter(torch.ones(2))]), 4)
    with pytest.raises(ValueError, match="outer_optimizer"):
        mpidp.DiLoCo(model, inner, outer_sgd(model.l1.parameters()), 4)
    with pytest.raises(TypeError, match="float32 CPU"):
        double = Net().double()
        mpidp.DiLoCo(double, inner, outer_sgd(double.parameters()), 4)
    with pytest.raises(TypeError, match="inner_optimizer"):
        mpidp.DiLoCo(model, object(), outer, 4)
    with pytest.raises(ValueError, match="wire_dtype"):
        mpidp.DiLoCo(model, inner, outer, 4, wire_dtype=torch.int8)
    with pytest.raises(TypeError, match="comm"):
        mpidp.DiLoCo(model, inner, outer, 4, comm="world")


class BNNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(6, 10)
        self.bn = torch.nn.BatchNorm1d(10)
        self.l2 = torch.nn.Linear(10, 3)

    def forward(self, x):
        return self.l2(torch.relu(self.bn(self.l1(x))))


@pytest.mark.parametrize("sync_buffers", [True, False])
def test_batchnorm_statistics_become_the_ranks_mean_at_each_turn(sync_buffers):
    """With sync_buffers (the default) every rank ends a turn with the mean of
    the replicas' running statistics; without, each keeps its own."""
    torch.manual_seed(0)
    model = BNNet()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = mpidp.DiLoCo(model, inner, outer_sgd(model.parameters()), 2,
                          sync_buffers=sync_buffers)
    with diloco:
        for t, (x, y) in enumerate(batches(4)):
            inner.zero_grad()
            torch.nn.functional.mse_loss(model(rank_slice(x)), rank_slice(y)).backward()
            stats = [model.bn.running_mean.clone(), model.bn.running_var.clone()]
            replicas = MPI.COMM_WORLD.allgather(stats)
            inner.step()
            if (t + 1) % 2:
                continue  # a turn after steps 1 and 3
            for i, now in enumerate((model.bn.running_mean, model.bn.running_var)):
                mean = torch.stack([r[i] for r in replicas]).mean(0)
                if sync_buffers:
                    torch.testing.assert_close(now, mean, rtol=1e-6, atol=1e-7)
                else:
                    assert torch.equal(now, stats[i])


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that disagree")
def test_settings_or_models_that_differ_across_ranks_are_named():
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"DiLoCo: the ranks' settings differ.*sync_every"):
        mpidp.DiLoCo(model, inner, outer_sgd(model.parameters()), 4 if RANK == 0 else 8)
    other = Net() if RANK == 0 else torch.nn.Sequential(torch.nn.Linear(6, 3))
    with pytest.raises(ValueError, match="DiLoCo: the ranks' models differ"):
        mpidp.DiLoCo(other, torch.optim.SGD(other.parameters(), lr=0.1),
                     outer_sgd(other.parameters()), 4)


def test_a_second_diloco_entered_on_a_model_takes_it_over():
    """Wrapping twice: two entered DiLoCos would sync every turn twice, so
    the newer one takes the model over (mpidp's one ownership policy) and the
    older one's hooks are gone."""
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    first = mpidp.DiLoCo(model, inner, outer_sgd(model.parameters()), 4)
    second = mpidp.DiLoCo(model, inner, outer_sgd(model.parameters()), 4)
    with first:
        with pytest.warns(UserWarning, match="already wrapped by another DiLoCo"):
            with second:
                inner_step(model, inner, *batches(1)[0], RANK)
        inner_step(model, inner, *batches(1)[0], RANK)    # neither counts it
    assert second.step == 1 and first.step == 0
    with first:   # entered again, the first takes over again
        inner_step(model, inner, *batches(1)[0], RANK)
    assert second.step == 1 and first.step == 1


def test_a_layer_frozen_mid_training_stays_where_it_is():
    """layer.requires_grad_(False) after a sync: the outer optimizer gets no
    gradient for it, so neither it nor its outer momentum moves (as torch's
    optimizers leave a parameter without a gradient), where the outer
    momentum would otherwise go on moving it; freezing it on one rank only
    raises on every rank at the next sync."""
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = outer_sgd(model.parameters())
    gen = torch.Generator().manual_seed(RANK)
    with mpidp.DiLoCo(model, inner, outer, sync_every=2):
        def step():
            inner.zero_grad()
            torch.nn.functional.mse_loss(model(torch.randn(8, 6, generator=gen)),
                                         torch.randn(8, 3, generator=gen)).backward()
            inner.step()
        for _ in range(4):
            step()
        model.l1.requires_grad_(False)
        frozen = [p.detach().clone() for p in model.l1.parameters()]
        momenta = [outer.state[p]["momentum_buffer"].clone() for p in model.l1.parameters()]
        for _ in range(6):
            step()
        for p, before, m in zip(model.l1.parameters(), frozen, momenta):
            assert torch.equal(p.detach(), before)
            assert torch.equal(outer.state[p]["momentum_buffer"], m)
        mine = flat(model)
        theirs = mine.clone()
        MPI.COMM_WORLD.Bcast(theirs.numpy(), root=0)
        assert torch.equal(mine, theirs)
        if SIZE > 1:
            if RANK == SIZE - 1:
                model.l1.requires_grad_(True)
            with pytest.raises(RuntimeError, match="frozen parameters"):
                step()
                step()
