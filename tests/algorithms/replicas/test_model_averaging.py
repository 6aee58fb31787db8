"""torch's model averagers over MPI, at 1-4 ranks: mpidp's
PeriodicModelAverager, HierarchicalModelAverager and PostLocalSGDOptimizer
trained beside torch.distributed's own implementations over a gloo group
(same initial model, each rank its own data), parameters compared after
every step; checks ported from torch's tests (written here from their
behaviour); mpidp's guard for ranks averaging different parameters; bad
arguments.

Comparisons with torch are bitwise at 1 and 2 ranks (both divide by the
group size and sum two numbers, which commutes) and to float32 rounding at
3 and 4 (gloo's allreduce and Open MPI's may add the ranks' values in
different orders)."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
import torch.distributed.algorithms.model_averaging.hierarchical_model_averager as torch_hier
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGD

import mpidp
from dp_reference import RANK, SIZE, differing_setting, differing_steps, rank_slice, seeded
from mpidp import MPI

pytestmark = pytest.mark.ranks3  # a group size that is not a power of two


def torch_world():
    if not dist.is_initialized():
        mpidp.init_process_group(backend="gloo")


class Net(torch.nn.Module):
    """Two layers, a float64 parameter (flattened with upcasting, as torch
    does) and a parameter no forward uses (its .grad stays None: skipped)."""
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(5, 8)
        self.l2 = torch.nn.Linear(8, 3)
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
        self.unused = torch.nn.Parameter(torch.full((4,), float(RANK)))

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))) * self.scale.float()


def assert_matches_torch(ours, theirs, step):
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        if SIZE <= 2:
            assert torch.equal(a, b), f"step {step}: {name} differs from torch's"
        else:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7,
                                       msg=f"step {step}: {name} differs from torch's")


def same_on_all_ranks(model) -> bool:
    flat = torch.cat([p.detach().double().reshape(-1) for n, p in model.named_parameters()
                      if n != "unused"])
    return all(torch.equal(flat, other) for other in MPI.COMM_WORLD.allgather(flat))


def train_beside_torch(ours_averager, torch_averager, steps, averaged_steps):
    torch.manual_seed(0)
    ours = Net()
    theirs = copy.deepcopy(ours)
    opt = mpidp.PostLocalSGDOptimizer(torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9),
                                      ours_averager)
    ref = TorchPostLocalSGD(torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9),
                            torch_averager)
    gen = seeded(1)
    for step in range(steps):
        x, y = torch.randn(4 * SIZE, 5, generator=gen), torch.randn(4 * SIZE, 3, generator=gen)
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            torch.nn.functional.mse_loss(model(rank_slice(x)), rank_slice(y)).backward()
            o.step()
        assert_matches_torch(ours, theirs, step)
        if SIZE > 1:  # replicas meet exactly on averaging steps and drift apart between
            assert same_on_all_ranks(ours) == (step in averaged_steps), f"step {step}"
    assert torch.equal(ours.unused.detach(), torch.full((4,), float(RANK)))  # never had a .grad
    assert opt.state_dict()["step"] == steps == ref.state_dict()["step"]


@pytest.mark.parametrize("warmup", [0, 3])
def test_periodic_averager_matches_torch(warmup):
    torch_world()
    period, steps = 4, 13
    due = {t for t in range(steps) if t >= warmup and (t - warmup) % period == 0}
    train_beside_torch(mpidp.PeriodicModelAverager(period, warmup_steps=warmup),
                       torch_averagers.PeriodicModelAverager(period, warmup_steps=warmup),
                       steps, due)


def hierarchy():
    """Periods 2, 4, 8 over groups of 1, 2 and 4 ranks at 4 ranks; else 2 and 4
    over 1 and all ranks."""
    return {2: 1, 4: 2, 8: 4} if SIZE == 4 else {2: 1, 4: SIZE}


def test_hierarchical_averager_matches_torch():
    torch_world()
    levels = hierarchy()
    warmup, steps = 3, 18
    due = {t for t in range(warmup, steps) if t % max(levels) == 0}  # all ranks meet only there
    train_beside_torch(mpidp.HierarchicalModelAverager(levels, warmup_steps=warmup),
                       torch_hier.HierarchicalModelAverager(levels, warmup_steps=warmup),
                       steps, due)


def rank_valued(n=6):
    """A parameter holding this rank's number, with a gradient."""
    p = torch.nn.Parameter(torch.full((n,), float(RANK)))
    p.grad = torch.zeros_like(p)
    return p


def test_average_parameters_over_all_ranks_and_over_a_subgroup():
    """torch's test_average_parameters: the mean of the ranks' values; over a
    group of consecutive pairs, the pair's mean."""
    p = rank_valued()
    mpidp.averaging.average_parameters([p])
    assert torch.equal(p.detach(), torch.full((6,), (SIZE - 1) / 2))
    if SIZE % 2 == 0:
        pairs = MPI.COMM_WORLD.Split(RANK // 2, RANK)
        q = rank_valued()
        mpidp.averaging.average_parameters([q], pairs)
        assert torch.equal(q.detach(), torch.full((6,), (RANK // 2) * 2 + 0.5))
        pairs.Free()


@pytest.mark.parametrize("warmup", [12, 13, 14, 15])
@pytest.mark.parametrize("as_groups", [False, True])
def test_periodic_averager_steps(warmup, as_groups):
    """torch's test_periodic_model_averager(_param_group): reset to the rank's
    value before every step; averaged exactly on the due steps."""
    averager = mpidp.PeriodicModelAverager(period=4, warmup_steps=warmup)
    p = rank_valued()
    opt = torch.optim.SGD([p], lr=0.1)
    for step in range(20):
        with torch.no_grad():
            p.fill_(RANK)
        averager.average_parameters(opt.param_groups if as_groups else [p])
        due = step >= warmup and (step - warmup) % 4 == 0
        assert p[0].item() == ((SIZE - 1) / 2 if due else RANK), f"step {step}"
    assert averager.step == 20


def test_hierarchical_averager_uses_the_group_of_the_largest_period_due():
    """torch's 3-level test at 4 ranks (periods 2, 4, 8 over groups of 1, 2, 4
    with 10 warm-up steps: singletons at 10, 14, 18, 22, pairs at 12, 20, all
    at 16, 24); 2 levels elsewhere."""
    levels = hierarchy()
    averager = mpidp.HierarchicalModelAverager(levels, warmup_steps=10)
    p = rank_valued()
    for step in range(26):
        with torch.no_grad():
            p.fill_(RANK)
        averager.average_parameters([p])
        due = [period for period in levels if step >= 10 and step % period == 0]
        group = levels[max(due)] if due else 1
        first = RANK // group * group
        expected = sum(range(first, first + group)) / group
        assert p[0].item() == expected, f"step {step}"


def test_state_dict_carries_the_averager_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = mpidp.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      mpidp.PeriodicModelAverager(2))
    for _ in range(5):
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    state = opt.state_dict()
    assert state["step"] == 5 and "momentum_buffer" in state["state"][0]
    fresh = mpidp.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        mpidp.PeriodicModelAverager(2))
    fresh.load_state_dict(state)
    assert fresh.averager.step == 5
    assert torch.equal(fresh.state[model.weight]["momentum_buffer"],
                       opt.state[model.weight]["momentum_buffer"])
    del state["step"]
    with pytest.warns(UserWarning, match="no averager step counter"):
        fresh.load_state_dict(state)
    assert fresh.averager.step == 0
    # An LR scheduler accepts it (it is a torch Optimizer and shares the groups).
    sched = torch.optim.lr_scheduler.StepLR(fresh, step_size=1, gamma=0.5)
    fresh.step()
    sched.step()
    assert fresh.optim.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("unscale_first", [False, True])
def test_a_grad_scaler_skipping_one_ranks_step_keeps_its_averager_in_step(unscale_first):
    """GradScaler leaves out optimizer.step() on a rank whose gradients
    overflowed: torch's PostLocalSGDOptimizer then falls a step behind and
    averages out of turn. Here the last rank skips its own update at step 2
    (an inf in its gradients) and still averages when due; every rank
    matches a one-process simulation of the replicas after every step, with
    the gradients unscaled by GradScaler (unscale_first) or by the step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    mpidp.broadcast_parameters(model)
    replicas = [copy.deepcopy(model) for _ in range(SIZE)]
    sims = [torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.9) for r in replicas]
    opt = mpidp.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      mpidp.PeriodicModelAverager(2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    g = seeded(3)
    for t in range(6):
        x = torch.randn(SIZE, 3, generator=g)
        overflow = (t == 2)               # on the last rank only
        for r, (rep, sim) in enumerate(zip(replicas, sims)):
            sim.zero_grad()
            rep(x[r:r + 1]).pow(2).sum().backward()
            if not (overflow and r == SIZE - 1):
                sim.step()
        if t % 2 == 0:                     # PeriodicModelAverager(2): steps 0, 2, 4
            mean = torch.stack([torch.nn.utils.parameters_to_vector(r.parameters())
                                for r in replicas]).mean(0)
            for rep in replicas:
                torch.nn.utils.vector_to_parameters(mean.clone(), rep.parameters())
        opt.zero_grad()
        scaler.scale(model(x[RANK:RANK + 1]).pow(2).sum()).backward()
        if overflow and RANK == SIZE - 1:
            model.weight.grad[0, 0] = float("inf")
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        want = torch.nn.utils.parameters_to_vector(replicas[RANK].parameters())
        torch.testing.assert_close(torch.nn.utils.parameters_to_vector(model.parameters()), want,
                                   msg=lambda m: f"step {t}: {m}")
        assert opt.averager.step == t + 1


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that differs")
def test_a_checkpoint_loaded_on_one_rank_alone_is_an_error_on_every_rank():
    """The rank that went back to step 2 would average its model with the
    others' models of later steps, with no error (torch's averager does): every
    rank raises at the next average instead, naming each rank's step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    mpidp.broadcast_parameters(model)
    opt = mpidp.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      mpidp.PeriodicModelAverager(3))

    def step():
        opt.zero_grad()
        model(torch.full((1, 3), float(RANK))).sum().backward()
        opt.step()

    for t in range(5):
        if t == 2:
            saved = copy.deepcopy({"opt": opt.state_dict(), "model": model.state_dict()})
        step()
    if RANK == SIZE - 1:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    with pytest.raises(RuntimeError, match=differing_steps("PeriodicModelAverager", 3, 6)):
        for _ in range(5):
            step()


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that differs")
def test_an_lr_that_differs_across_ranks_is_an_error_at_the_next_average():
    """An LR scheduler stepped on the last rank only: its replica would train
    with another lr between the averages (torch's averager lets it)."""
    model = torch.nn.Linear(3, 2)
    mpidp.broadcast_parameters(model)
    opt = mpidp.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      mpidp.PeriodicModelAverager(2))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with pytest.raises(RuntimeError, match=differing_setting(
            "PeriodicModelAverager", "param group 0: lr", 0.025, 0.1)):
        for _ in range(4):
            opt.zero_grad()
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            if RANK == SIZE - 1:
                scheduler.step()


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that disagree")
def test_ranks_averaging_different_parameters_all_raise():
    """torch would post allreduces of different sizes here (undefined
    behaviour); every rank raises instead."""
    a, b = rank_valued(), rank_valued(3)
    if RANK == 0:
        b.grad = None
    with pytest.raises(ValueError, match="different numbers of elements"):
        mpidp.averaging.average_parameters([a, b])
    MPI.COMM_WORLD.Barrier()


def test_bad_arguments_are_named():
    torch_world()
    for period, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="period"):
            mpidp.PeriodicModelAverager(period)
    with pytest.raises(ValueError, match="warmup_steps"):
        mpidp.PeriodicModelAverager(4, warmup_steps=-1)
    with pytest.warns(UserWarning, match="period=1"):
        mpidp.PeriodicModelAverager(1)
    with pytest.raises(TypeError, match="process_group"):
        mpidp.PeriodicModelAverager(4, process_group="world")
    with pytest.raises(ValueError, match="non-empty"):
        mpidp.HierarchicalModelAverager({})
    with pytest.raises(ValueError, match="ascending"):
        mpidp.HierarchicalModelAverager({4: 1, 2: SIZE})
    with pytest.raises(ValueError, match="last group size"):
        mpidp.HierarchicalModelAverager({2: 1, 4: SIZE + 1})
    if SIZE == 4:
        with pytest.raises(ValueError, match="does not divide"):
            mpidp.HierarchicalModelAverager({2: 3, 4: 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        averager = mpidp.PeriodicModelAverager(1)
    with pytest.raises(TypeError, match="optim"):
        mpidp.PostLocalSGDOptimizer(object(), averager)
    with pytest.raises(TypeError, match="averager"):
        mpidp.PostLocalSGDOptimizer(torch.optim.SGD([rank_valued()], lr=0.1),
                                    torch_averagers.PeriodicModelAverager(2))
    with pytest.raises(TypeError, match="params"):
        averager.average_parameters([3.0])


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that disagree")
def test_settings_that_differ_across_ranks_are_named():
    """Different periods would post mismatched allreduces: every rank raises."""
    with pytest.raises(ValueError, match=r"PeriodicModelAverager: the ranks' settings differ.*period"):
        mpidp.PeriodicModelAverager(4 if RANK == 0 else 8)
    with pytest.raises(ValueError, match="HierarchicalModelAverager: the ranks' settings differ"):
        mpidp.HierarchicalModelAverager({2: 1, 4: SIZE}, warmup_steps=RANK)
