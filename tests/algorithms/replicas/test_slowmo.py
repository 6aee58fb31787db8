"""SlowMoDistributedDataParallel (LocalSGD base) against a single-process
simulation of every node's replica, at 1-4 ranks, with one rank per node and
(at 2 and 4 ranks) two: each rank trains on its own slice of each batch and
compares its model with the simulation's replica of its node after every
step. The simulation is written from the update rules (fairscale's counting:
LocalSGD after every localsgd_frequency-th step, the slow step after every
slowmo_frequency-th; u = βu + (θ - x̄)/γ, θ -= αγu, x = θ) with its own
counters, not the schedule's.

Ported checks of fairscale's tests (written here from their behaviour):
LocalSGD alone equals per-rank SGD with an average every k steps; with
constant lr the slow step equals torch's SGD(lr=α, momentum=β) on the
gradient θ - x̄; the memory-efficient mode holds 2 x numel / shards extra
elements on shard owners only. Bad arguments are named."""

import copy

import pytest
import torch

import mpidp
from dp_reference import (RANK, SIZE, SmallNet as Net, differing_setting, differing_steps,
                          flat_params, local_steps, node_replicas, per_node_options, rank_slice,
                          regression_batches, slow_momentum_step, slowmo_step)
from mpidp import MPI

pytestmark = pytest.mark.ranks3


LR = 0.1


def batches(steps):
    return regression_batches(3, steps)


def simulate(init, data, per_node, k, m, alpha, beta, memory_efficient, clip=False):
    nodes = SIZE // per_node
    replicas, opts, theta, u = node_replicas(init, nodes, LR)
    slow = alpha != 1.0 or beta != 0.0
    history = []
    for t, (x, y) in enumerate(data):
        local_steps(replicas, opts, x, y, per_node, clip_norm=0.05 if clip else None)
        slow_now = slow and (t + 1) % m == 0
        if (t + 1) % k == 0 and not (slow_now and memory_efficient):
            mean = torch.stack([flat_params(r) for r in replicas]).mean(0)
            for r in replicas:
                torch.nn.utils.vector_to_parameters(mean.clone(), r.parameters())
        if slow_now:
            slow_momentum_step(replicas, theta, u, beta, alpha, LR, memory_efficient)
        history.append(flat_params(replicas[RANK // per_node]).clone())
    return history


@pytest.mark.parametrize("per_node", per_node_options())
@pytest.mark.parametrize("k,m,alpha,beta,memory_efficient,clip", [
    (3, 48, 1.0, 0.0, True, False),      # LocalSGD alone (no slow momentum)
    (1, 1, 0.5, 0.5, False, False),      # a slow step after every averaged step
    (1, 1, 0.5, 0.5, True, False),
    (2, 4, 1.0, 0.5, False, False),      # slow steps on every other average
    (2, 4, 1.0, 0.5, True, False),
    (2, 3, 0.7, 0.3, False, False),      # slow steps off the averaging grid: nodes drift apart
    (2, 3, 0.7, 0.3, True, False),
    (2, 4, 0.8, 0.5, True, True),      # habit: gradients clipped before the step
])
def test_every_step_matches_the_simulated_node_replica(per_node, k, m, alpha, beta,
                                                        memory_efficient, clip):
    torch.manual_seed(0)
    init = Net()
    data = batches(12)
    want = simulate(init, data, per_node, k, m, alpha, beta, memory_efficient, clip)
    model = copy.deepcopy(init)
    net = mpidp.SlowMoDistributedDataParallel(
        model, nprocs_per_node=per_node, slowmo_momentum=beta, slowmo_lr=alpha,
        slowmo_frequency=m, localsgd_frequency=k, slowmo_memory_efficient=memory_efficient,
        slowmo_num_shards=3)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    for t, (x, y) in enumerate(data):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(rank_slice(x)), rank_slice(y)).backward()
        if clip:  # on the node's averaged gradients, as the simulation does
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        net.perform_slowmo(opt)
        got = flat_params(model)
        torch.testing.assert_close(got, want[t], rtol=1e-5, atol=1e-6, msg=lambda s: f"step {t}: {s}")
    assert net.num_updates == 12


def test_slow_step_is_sgd_with_momentum_on_the_outer_gradient():
    """fairscale's check, with constant lr: SlowMo's slow step equals torch's
    SGD(lr=slowmo_lr, momentum=slowmo_momentum) stepping θ with the gradient
    θ - x̄ (x̄: the replicas' mean after the period)."""
    torch.manual_seed(0)
    model = Net()
    net = mpidp.SlowMoDistributedDataParallel(model, nprocs_per_node=1, slowmo_momentum=0.6,
                                              slowmo_lr=0.8, slowmo_frequency=2,
                                              localsgd_frequency=2, slowmo_memory_efficient=False)
    theta = copy.deepcopy(model)
    outer = torch.optim.SGD(theta.parameters(), lr=0.8, momentum=0.6)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for t, (x, y) in enumerate(batches(8)):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(rank_slice(x)), rank_slice(y)).backward()
        opt.step()
        if (t + 1) % 2 == 0:  # the expected slow step, from the replicas' mean
            replicas = MPI.COMM_WORLD.allgather([p.detach().clone() for p in model.parameters()])
            for i, p in enumerate(theta.parameters()):
                p.grad = p.detach() - torch.stack([r[i] for r in replicas]).mean(0)
            outer.step()
        net.perform_slowmo(opt)
        if (t + 1) % 2 == 0:
            for p, q in zip(model.parameters(), theta.parameters()):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shards", [1, 2, 32])
def test_memory_efficient_buffers_live_on_shard_owners(shards):
    model = Net()
    numel = sum(p.numel() for p in model.parameters())
    net = mpidp.SlowMoDistributedDataParallel(model, nprocs_per_node=1, slowmo_momentum=0.5,
                                              slowmo_num_shards=shards)
    owners = min(SIZE, shards)
    length = -(-numel // owners)
    mine = max(0, min(length, numel - RANK * length)) if RANK < owners else 0
    assert net.slowmo_buffer_numel == 2 * mine
    plain = mpidp.SlowMoDistributedDataParallel(Net(), nprocs_per_node=1, slowmo_momentum=0.5,
                                                slowmo_memory_efficient=False)
    assert plain.slowmo_buffer_numel == 2 * numel
    off = mpidp.SlowMoDistributedDataParallel(Net(), nprocs_per_node=1, slowmo_momentum=0.0)
    assert off.slowmo_buffer_numel == 0  # slowmo_lr 1 and momentum 0: LocalSGD only


@pytest.mark.parametrize("whole", [False, True])
def test_state_round_trip_continues_exactly(whole):
    """whole: the checkpoint holds θ and u whole (as fault-tolerant mode
    saves them, which a relaunch at any size loads): each rank takes its
    shard."""
    torch.manual_seed(0)
    init = Net()
    data = batches(10)

    def run(steps, state=None, start=None):
        model = copy.deepcopy(init) if start is None else start
        net = mpidp.SlowMoDistributedDataParallel(model, nprocs_per_node=1, slowmo_momentum=0.5,
                                                  slowmo_lr=0.9, slowmo_frequency=4,
                                                  localsgd_frequency=2)
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
        if state is not None:
            net.load_slowmo_state_dict(state["slowmo"])
            opt.load_state_dict(state["opt"])
        for x, y in steps:
            slowmo_step(net, opt, x, y)
        return model, net, opt

    straight, _, _ = run(data)
    half, net, opt = run(data[:5])
    state = copy.deepcopy({"slowmo": net.slowmo_state_dict(), "opt": opt.state_dict(),
                           "model": half.state_dict()})
    if whole:
        for key in ("theta", "u"):
            state["slowmo"][key] = torch.cat(MPI.COMM_WORLD.allgather(state["slowmo"][key]))
        assert state["slowmo"]["theta"].numel() == sum(p.numel() for p in init.parameters())
    resumed_model = Net()
    resumed_model.load_state_dict(state["model"])
    resumed, _, _ = run(data[5:], state, resumed_model)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.skipif(SIZE < 2, reason="needs a rank that differs")
def test_a_checkpoint_loaded_on_one_rank_alone_is_an_error_on_every_rank(memory_efficient):
    """The rank that went back to step 2 would average with the others' later
    replicas (and its slow step would pair with theirs) with no error: every
    rank raises at the next average instead, naming each rank's step."""
    torch.manual_seed(0)
    model = Net()
    net = mpidp.SlowMoDistributedDataParallel(model, nprocs_per_node=1, slowmo_momentum=0.5,
                                              slowmo_lr=0.9, slowmo_frequency=4,
                                              localsgd_frequency=2,
                                              slowmo_memory_efficient=memory_efficient)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    data = batches(10)
    for t, (x, y) in enumerate(data[:5]):
        if t == 2:
            saved = copy.deepcopy({"slowmo": net.slowmo_state_dict(), "opt": opt.state_dict(),
                                   "model": model.state_dict()})
        slowmo_step(net, opt, x, y)
    if RANK == SIZE - 1:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        net.load_slowmo_state_dict(saved["slowmo"])
    with pytest.raises(RuntimeError, match=differing_steps("SlowMoDistributedDataParallel", 3, 5)):
        for x, y in data[5:]:
            slowmo_step(net, opt, x, y)


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that differs")
def test_an_lr_that_differs_across_ranks_is_an_error_at_the_next_average():
    """The lr is the slow step's gamma and each replica's step size: an LR
    scheduler stepped on the last rank only is named at the next average."""
    net = mpidp.SlowMoDistributedDataParallel(Net(), nprocs_per_node=1, localsgd_frequency=2)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with pytest.raises(RuntimeError, match=differing_setting(
            "SlowMoDistributedDataParallel", "param group 0: lr", 0.025, 0.1)):
        for x, y in batches(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(rank_slice(x)), rank_slice(y)).backward()
            opt.step()
            if RANK == SIZE - 1:
                scheduler.step()
            net.perform_slowmo(opt)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="global_group"):
        mpidp.SlowMoDistributedDataParallel(Net(), global_group=object())
    with pytest.raises(ValueError, match="graph"):    # a gossip setting without SGP
        mpidp.SlowMoDistributedDataParallel(Net(), graph=object())
    for name in ("slowmo_frequency", "localsgd_frequency", "slowmo_num_shards", "nprocs_per_node"):
        with pytest.raises(ValueError, match=name):
            mpidp.SlowMoDistributedDataParallel(Net(), **{name: 0})
    with pytest.raises(ValueError, match="slowmo_lr"):
        mpidp.SlowMoDistributedDataParallel(Net(), slowmo_lr=-1.0)
    if SIZE == 4:
        with pytest.raises(ValueError, match="does not divide"):
            mpidp.SlowMoDistributedDataParallel(Net(), nprocs_per_node=3)
    net = mpidp.SlowMoDistributedDataParallel(Net(), nprocs_per_node=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="fp32_params"):
        net.perform_slowmo(opt, fp32_params=torch.zeros(3))
    with pytest.raises(TypeError, match="module"):
        mpidp.SlowMoDistributedDataParallel("model")


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that disagree")
def test_settings_that_differ_across_ranks_are_named():
    with pytest.raises(ValueError, match=r"SlowMoDistributedDataParallel: the ranks' settings "
                                         r"differ.*localsgd_frequency"):
        mpidp.SlowMoDistributedDataParallel(Net(), nprocs_per_node=1,
                                            localsgd_frequency=3 if RANK == 0 else 4)


def test_wrapping_twice_hands_over_to_the_newer_wrapper():
    model = Net()
    old = mpidp.SlowMoDistributedDataParallel(model, nprocs_per_node=1)
    with pytest.warns(UserWarning, match="already wrapped"):
        new = mpidp.SlowMoDistributedDataParallel(model, nprocs_per_node=1)
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="detached: a newer SlowMoDistributedDataParallel"):
        old(rank_slice(x))
    opt = torch.optim.SGD(new.parameters(), lr=LR)
    with pytest.raises(RuntimeError, match="detached: a newer SlowMoDistributedDataParallel"):
        old.perform_slowmo(opt)
    torch.nn.functional.mse_loss(new(rank_slice(x)), rank_slice(y)).backward()
    opt.step()
    new.perform_slowmo(opt)
    assert new.num_updates == 1
    with pytest.raises(TypeError, match="already a SlowMoDistributedDataParallel"):
        mpidp.SlowMoDistributedDataParallel(new)
