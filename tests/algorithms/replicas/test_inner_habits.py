"""Habits of the inner loop -- a learning-rate scheduler stepped after each
inner step, and the gradients clipped to a norm before it -- under each
2025-26 algorithm whose syncs the inner steps drive, at 1-4 ranks. The
simulations take replicas stepped with the scheduler's learning rate and
each rank's clipped gradients; a sync that read the optimizer's first
learning rate, or gradients before the clipping, would not match."""

import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE
from ef_reference import MuLoCoSim
from eager_reference import EagerDiLoCoSim
from noloco_reference import NoLoCoSim
from test_noloco import assert_at_theta
from test_sparseloco import build, check_against, grads_for

pytestmark = pytest.mark.ranks3

CLIP = 1.5          # below every rank's gradient norm here: the clipping always acts
OUTER = dict(lr=0.7, momentum=0.9, nesterov=True)


def lr_at(step: int) -> float:
    """StepLR(lr=0.1, step_size=2, gamma=0.5)'s learning rate at inner step `step`."""
    return 0.1 * 0.5 ** (step // 2)


def clipped(grads):
    """clip_grad_norm_'s rule: every gradient times min(1, CLIP / (norm + 1e-6))."""
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                       for g in grads])))
    scale = min(1.0, CLIP / (norm + 1e-6))
    return [g.double().numpy() * scale for g in grads]


def replica_of(rank, start, model, steps):
    x = [t.copy() for t in start]
    for s in steps:
        x = [a - lr_at(s) * g for a, g in zip(x, clipped(grads_for(model, rank, s)))]
    return x


def inner_step(model, opt, scheduler, step):
    opt.zero_grad()
    sum((p * g).sum() for p, g in zip(model.parameters(), grads_for(model, RANK, step))).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    scheduler.step()


def start(model):
    return [p.detach().double().numpy() for p in model.parameters()]


# name: (the algorithm over model and its inner optimizer, its simulation,
# whether each rank has a θ of its own)
ALGORITHMS = {
    "EagerDiLoCo": (lambda m, opt: mpidp.EagerDiLoCo(m, opt, torch.optim.SGD(
        m.parameters(), **OUTER), 3), lambda m: EagerDiLoCoSim(start(m), SIZE, **OUTER), True),
    "NoLoCo": (lambda m, opt: mpidp.NoLoCo(m, opt, torch.optim.SGD(
        m.parameters(), lr=0.7, momentum=0.5), 3),
        lambda m: NoLoCoSim(start(m), SIZE, lr=0.7, momentum=0.5), True),
    "MuLoCo": (lambda m, opt: mpidp.MuLoCo(m, opt, torch.optim.SGD(m.parameters(), **OUTER), 3,
                                           chunk_size=8),
               lambda m: MuLoCoSim(start(m), SIZE, bins=4, chunk_size=8, **OUTER), False),
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_scheduler_and_clipping_in_the_inner_loop(name):
    make, make_sim, own_theta = ALGORITHMS[name]
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sim = make_sim(model)
    with make(model, opt) as algorithm:
        for sync in range(3):
            steps = range(3 * sync, 3 * sync + 3)
            replicas = [replica_of(r, sim.theta[r] if own_theta else sim.shared, model, steps)
                        for r in range(SIZE)]
            for s in steps:
                inner_step(model, opt, scheduler, s)
            if own_theta:
                sim.round(replicas, sync)
            else:
                sim.round(replicas)
            what = f"{name}, sync {sync}"
            if own_theta:
                assert_at_theta(model, sim, what)
            else:
                check_against(model, algorithm, sim, what)
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(9))      # the scheduler ran
