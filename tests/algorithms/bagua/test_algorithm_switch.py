"""Switching algorithms with mpidp.with_bagua, in every direction between
GradientAllReduce, ByteGrad, LocalSGD, DiLoCo and Decentralized, against a
single-process simulation of every rank's replica running the same sequence.

One run walks a circuit through all 20 ordered pairs; every phase trains 3
steps, each rank on its own slice of each batch, with one SGD-with-momentum
optimizer throughout. The simulation is written from the rules: at a switch
every replica takes replica 0's parameters and momentum; GradientAllReduce
and ByteGrad step every replica with the mean gradient (ByteGrad's within
its 8-bit rounding); LocalSGD(period 2) averages the replicas after phase
steps 0 and 2; DiLoCo(sync_every 2) steps the shared parameters with the
outer optimizer on θ - mean(x) after step 1 and restarts the replicas from
them; Decentralized("all") replaces each replica by the mean taken at the
forward, then steps it with its own gradient. After each phase every rank
compares its parameters and momentum with its replica's, then the
simulation takes every rank's actual values, so each phase is checked on
its own."""

import copy
import warnings

import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE, SmallNet, rank_slice, seeded
from mpidp import MPI
from mpidp.algorithms import (ByteGradAlgorithm, DecentralizedAlgorithm, DiLoCoAlgorithm,
                              GradientAllReduceAlgorithm, LocalSGDAlgorithm)

pytestmark = pytest.mark.ranks3

LR, STEPS = 0.05, 3
NAMES = ["allreduce", "bytegrad", "localsgd", "diloco", "decentralized"]


class Net(SmallNet):
    def __init__(self):
        super().__init__(inputs=6, hidden=12, outputs=3)


def circuit(names):
    """A closed walk through every ordered pair of `names` once (Hierholzer's
    algorithm on the complete directed graph), from names[0]."""
    unused = {a: [b for b in names if b != a] for a in names}
    stack, walk = [names[0]], []
    while stack:
        node = stack[-1]
        if unused[node]:
            stack.append(unused[node].pop(0))
        else:
            walk.append(stack.pop())
    return walk[::-1]


def outer_sgd(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def algorithm(name, model):
    return {"allreduce": lambda: GradientAllReduceAlgorithm(),
            "bytegrad": lambda: ByteGradAlgorithm(hierarchical=False),
            "localsgd": lambda: LocalSGDAlgorithm(period=2),
            "diloco": lambda: DiLoCoAlgorithm(outer_sgd(model.parameters()), sync_every=2),
            "decentralized": lambda: DecentralizedAlgorithm(hierarchical=False)}[name]()


def loss_of(model, x, y, rank):
    return torch.nn.functional.mse_loss(model(rank_slice(x, rank)), rank_slice(y, rank))


def momenta(model, opt):
    return [opt.state[p]["momentum_buffer"].clone() if p in opt.state else torch.zeros_like(p)
            for p in model.parameters()]


class Simulation:
    """Every rank's replica and optimizer."""

    def __init__(self, init):
        self.models = [copy.deepcopy(init) for _ in range(SIZE)]
        self.opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in self.models]

    def take(self, params, momentum):
        """Replicas set to the given per-rank values."""
        with torch.no_grad():
            for r, (m, opt) in enumerate(zip(self.models, self.opts)):
                for p, v, b in zip(m.parameters(), params[r], momentum[r]):
                    p.copy_(v)
                    opt.state[p]["momentum_buffer"] = b.clone()

    def switch(self):
        self.take([[p.detach().clone() for p in self.models[0].parameters()]] * SIZE,
                  [momenta(self.models[0], self.opts[0])] * SIZE)

    def grads(self, x, y):
        out = []
        for r, m in enumerate(self.models):
            m.zero_grad()
            loss_of(m, x, y, r).backward()
            out.append([p.grad.clone() for p in m.parameters()])
        return out

    def set_grads(self, grads):
        for m, gs in zip(self.models, grads):
            for p, g in zip(m.parameters(), gs):
                p.grad = g.clone()

    def step(self):
        for opt in self.opts:
            opt.step()

    def average_params(self):
        with torch.no_grad():
            for ps in zip(*(m.parameters() for m in self.models)):
                mean = torch.stack([p for p in ps]).sum(0) / SIZE
                for p in ps:
                    p.copy_(mean)

    def phase(self, name, data):
        self.switch()
        if name == "diloco":
            shared = copy.deepcopy(self.models[0])
            outer = outer_sgd(shared.parameters())
        for t, (x, y) in enumerate(data):
            if name == "decentralized":
                means = [torch.stack([p.detach() for p in ps]).sum(0) / SIZE
                         for ps in zip(*(m.parameters() for m in self.models))]
            grads = self.grads(x, y)
            if name in ("allreduce", "bytegrad"):
                mean = [torch.stack(gs).sum(0) / SIZE for gs in zip(*grads)]
                grads = [mean] * SIZE
            self.set_grads(grads)
            if name == "decentralized":
                with torch.no_grad():
                    for m in self.models:
                        for p, v in zip(m.parameters(), means):
                            p.copy_(v)
            self.step()
            if name == "localsgd" and t % 2 == 0:
                self.average_params()
            if name == "diloco" and (t + 1) % 2 == 0:
                with torch.no_grad():
                    for k, s in enumerate(shared.parameters()):
                        s.grad = s.detach() - torch.stack(
                            [list(m.parameters())[k].detach() for m in self.models]).mean(0)
                outer.step()
                with torch.no_grad():
                    for m in self.models:
                        for p, s in zip(m.parameters(), shared.parameters()):
                            p.copy_(s)


def test_every_switch_direction_matches_the_simulation():
    walk = circuit(NAMES)
    assert len(walk) == len(NAMES) * (len(NAMES) - 1) + 1
    torch.manual_seed(5)
    init = Net()
    model = copy.deepcopy(init)
    with torch.no_grad():                  # every rank starts elsewhere: the first attach
        for p in model.parameters():       # takes rank 0's
            p.add_(0.01 * RANK)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sim = Simulation(init)
    gathered = MPI.COMM_WORLD.allgather([p.detach().clone() for p in model.parameters()])
    sim.take(gathered, [[torch.zeros_like(p) for p in model.parameters()]] * SIZE)
    gen = seeded(11)
    net, previous = model, None
    for name in walk:
        data = [(torch.randn(4 * SIZE, 6, generator=gen), torch.randn(4 * SIZE, 3, generator=gen))
                for _ in range(STEPS)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")        # one node: hierarchy cannot help
            net = mpidp.with_bagua(net, [opt], algorithm(name, model))
        for x, y in data:
            opt.zero_grad()
            loss_of(net, x, y, RANK).backward()
            opt.step()
        sim.phase(name, data)
        what = f"{previous} -> {name}" if previous else name
        want_params = list(sim.models[RANK].parameters())
        want_momenta = momenta(sim.models[RANK], sim.opts[RANK])
        if name == "bytegrad":
            # Within the 8-bit rounding of 3 steps' mean gradients (a rank
            # that stepped its own gradient would be off by their spread).
            scale = max(g.abs().max().item() for g in want_momenta)
            tol = dict(rtol=0, atol=0.05 * scale * LR * STEPS)
        else:
            tol = dict(rtol=1e-5, atol=1e-6)
        for got, want in zip(model.parameters(), want_params):
            torch.testing.assert_close(got.detach(), want.detach(), **tol,
                                       msg=lambda m: f"{what}: parameters: {m}")
        for got, want in zip(momenta(model, opt), want_momenta):
            torch.testing.assert_close(got, want, **(tol if name != "bytegrad" else dict(
                rtol=0, atol=0.05 * scale * STEPS)), msg=lambda m: f"{what}: momentum: {m}")
        # The next phase starts from what the ranks hold.
        everyone = MPI.COMM_WORLD.allgather(([p.detach().clone() for p in model.parameters()],
                                             momenta(model, opt)))
        sim.take([e[0] for e in everyone], [e[1] for e in everyone])
        previous = name
    assert isinstance(net, mpidp.BaguaModule) and net.module is model


@pytest.mark.parametrize("warmup", [0, 3])
def test_local_sgd_with_a_warm_up_is_torch_post_local_sgd(warmup):
    """LocalSGDAlgorithm(period, warmup_steps): gradients averaged for the
    warm-up, then local steps averaged every period steps, as torch's
    PostLocalSGDState + PeriodicModelAverager."""
    torch.manual_seed(6)
    init = Net()
    model = copy.deepcopy(init)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    net = mpidp.with_bagua(model, [opt], LocalSGDAlgorithm(period=3, warmup_steps=warmup))
    sim = Simulation(init)
    gen = seeded(12)
    for t in range(8):
        x, y = torch.randn(4 * SIZE, 6, generator=gen), torch.randn(4 * SIZE, 3, generator=gen)
        opt.zero_grad()
        loss_of(net, x, y, RANK).backward()
        opt.step()
        grads = sim.grads(x, y)
        if t < warmup:
            grads = [[torch.stack(gs).sum(0) / SIZE for gs in zip(*grads)]] * SIZE
        sim.set_grads(grads)
        sim.step()
        if t >= warmup and (t - warmup) % 3 == 0:
            sim.average_params()
        for got, want in zip(model.parameters(), sim.models[RANK].parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {t}: {m}")
    assert net.bagua_state_dict() == {"step": 8}


def test_slowmo_algorithm_runs_fairscale_slowmo_after_each_step():
    """SlowMoAlgorithm(...) under with_bagua equals SlowMoDistributedDataParallel
    with perform_slowmo after each step, on the same data."""
    torch.manual_seed(7)
    init = Net()
    settings = dict(nprocs_per_node=1, slowmo_frequency=2, localsgd_frequency=1,
                    slowmo_memory_efficient=False)
    model, direct_model = copy.deepcopy(init), copy.deepcopy(init)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    direct_opt = torch.optim.SGD(direct_model.parameters(), lr=LR, momentum=0.9)
    net = mpidp.with_bagua(model, [opt], mpidp.algorithms.SlowMoAlgorithm(**settings))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # the model is another module: no takeover
        direct = mpidp.SlowMoDistributedDataParallel(direct_model, **settings)
    gen = seeded(13)
    for _ in range(5):
        x, y = torch.randn(4 * SIZE, 6, generator=gen), torch.randn(4 * SIZE, 3, generator=gen)
        for m, o in ((net, opt), (direct, direct_opt)):
            o.zero_grad()
            loss_of(m, x, y, RANK).backward()
            o.step()
        direct.perform_slowmo(direct_opt)
    for a, b in zip(model.parameters(), direct_model.parameters()):
        assert torch.equal(a, b)
    assert net.bagua_state_dict()["num_updates"] == 5


def test_new_algorithms_check_their_arguments():
    model = Net()
    with pytest.raises(ValueError, match="period"):
        LocalSGDAlgorithm(period=0)
    with pytest.raises(TypeError, match="outer_optimizer"):
        DiLoCoAlgorithm(object(), sync_every=2)
    with pytest.raises(TypeError, match="unexpected argument.*slowmo_speed"):
        mpidp.algorithms.SlowMoAlgorithm(slowmo_speed=2)
    with pytest.raises(ValueError, match="optimizers: LocalSGDAlgorithm"):
        mpidp.with_bagua(model, [], LocalSGDAlgorithm(period=2))
    with pytest.raises(TypeError, match="outer_optimizer"):
        mpidp.algorithms.MuLoCoAlgorithm(object(), 2)
    with pytest.raises(TypeError, match=r"MuLoCoAlgorithm: unexpected argument.*\['lr'\]"):
        mpidp.algorithms.MuLoCoAlgorithm(outer_sgd(model.parameters()), 2, lr=0.1)
    with pytest.raises(ValueError, match="sync_every"):
        mpidp.algorithms.MuLoCoAlgorithm(outer_sgd(model.parameters()), 0)
    with pytest.raises(ValueError, match="group_size"):
        mpidp.algorithms.NoLoCoAlgorithm(outer_sgd(model.parameters()), 2, group_size=1)
    with pytest.raises(TypeError, match="sync_buffers: expected a bool"):
        mpidp.algorithms.EagerDiLoCoAlgorithm(outer_sgd(model.parameters()), 2, sync_buffers=1)
    with pytest.raises(TypeError, match="outer_optimizer"):
        mpidp.algorithms.EagerDiLoCoAlgorithm(object(), 2)
    with pytest.raises(ValueError, match="exp_avg_every: expected an int >= 1"):
        mpidp.algorithms.DESLOCAlgorithm(2, exp_avg_every=0)
    with pytest.raises(TypeError, match="optimizer: expected a torch.optim.Adam"):
        mpidp.with_bagua(model, [torch.optim.SGD(model.parameters(), lr=LR)],
                         mpidp.algorithms.DESLOCAlgorithm(2))
    muloco = mpidp.algorithms.MuLoCoAlgorithm(outer_sgd(model.parameters()), 2)
    with pytest.raises(ValueError, match="optimizers: MuLoCoAlgorithm"):
        mpidp.with_bagua(model, [], muloco)


def test_a_new_algorithm_on_the_same_ranks_takes_the_module_over():
    """The ownership policy: DataParallel on a module that with_bagua trains
    detaches the Bagua algorithm, DataParallel underneath and all (warning);
    the wrapper then raises."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    net = mpidp.with_bagua(model, [opt], GradientAllReduceAlgorithm())
    with pytest.warns(UserWarning, match="already wrapped by another GradientAllReduceAlgorithm"):
        dp = mpidp.DataParallel(model, blocking_parameter_updates=True)
    with pytest.raises(RuntimeError, match="detached: a newer DataParallel"):
        net(torch.zeros(2, 6))
    dp(torch.zeros(2, 6))


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that disagree")
@pytest.mark.parametrize("make,setting", [
    (lambda m: LocalSGDAlgorithm(period=2 if RANK == 0 else 3), "period"),
    (lambda m: DiLoCoAlgorithm(outer_sgd(m.parameters()), sync_every=2 if RANK == 0 else 4),
     "sync_every"),
    (lambda m: mpidp.algorithms.SlowMoAlgorithm(nprocs_per_node=1,
                                                slowmo_frequency=2 if RANK == 0 else 3),
     "slowmo_frequency"),
    (lambda m: mpidp.algorithms.SparseLoCoAlgorithm(sync_every=2, top_k=8 if RANK == 0 else 16),
     "top_k"),
    (lambda m: mpidp.algorithms.MuLoCoAlgorithm(outer_sgd(m.parameters()), 2,
                                                error_decay=0.9 if RANK == 0 else 0.8),
     "error_decay"),
    (lambda m: mpidp.algorithms.NoLoCoAlgorithm(outer_sgd(m.parameters()), 2,
                                                group_size=2 if RANK == 0 else 3),
     "group_size"),
    (lambda m: mpidp.algorithms.EagerDiLoCoAlgorithm(outer_sgd(m.parameters()), 2,
                                                     sync_buffers=RANK == 0),
     "sync_buffers"),
    (lambda m: mpidp.algorithms.DESLOCAlgorithm(2, exp_avg_every=4 if RANK == 0 else 6),
     "exp_avg_every")],
    ids=["localsgd", "diloco", "slowmo", "sparseloco", "muloco", "noloco", "eager", "desloc"])
def test_settings_that_differ_across_ranks_are_named_on_every_rank(make, setting):
    """A rank with another period would post syncs the others never match:
    with_bagua compares the new algorithms' settings and every rank raises."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=f"with_bagua: the ranks' settings differ.*{setting}"):
        mpidp.with_bagua(model, [opt], make(model))
