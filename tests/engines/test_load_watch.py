"""Checkpoints loaded on one rank: Horovod's broadcasts make the others follow
(mpidp.broadcast_parameters / broadcast_optimizer_state), and a load that the
ranks do not share is an error at the next training forwards instead of ranks
quietly training different models. Optimizer settings that differ across
ranks (an LR scheduler stepped on one rank, ReduceLROnPlateau fed each rank's
own loss) are an error too. At 1-4 ranks, against references."""

import copy

import pytest
import torch
import torch.nn.functional as F

import mpidp
from dp_reference import (RANK, SIZE, assert_params_close, assert_same_on_all_ranks, build,
                          classification_batch, cross_entropy, on_device, rank_slice, seeded,
                          step_like_one_process, train_like_one_process)
from mpidp import MPI
from dp_reference import MLP


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def trained_checkpoint(seed=50):
    """A model and Adam state as if read from disk: trained alone for 3 steps."""
    model = build(MLP, seed)
    opt = adam(model.parameters())
    g = seeded(seed)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(on_device(torch.randn(8, 10, generator=g))),
                        on_device(torch.randint(0, 4, (8,), generator=g))).backward()
        opt.step()
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def rank0(x):
    return MPI.COMM_WORLD.bcast(x, root=0)


def train_steps(net, opt, steps, seed=6):
    g = seeded(seed)
    for _ in range(steps):
        X, Y = classification_batch(g, 4 * SIZE)
        opt.zero_grad()
        F.cross_entropy(net(rank_slice(X)), rank_slice(Y)).backward()
        opt.step()


@pytest.mark.parametrize("blocking", [True, False, "plain torch optimizer"])
def test_loading_on_rank0_then_broadcasting_trains_like_one_process(blocking):
    model_state, opt_state = trained_checkpoint()
    model = build(MLP, seed=1 + RANK)
    if blocking == "plain torch optimizer":      # DDP's pattern: the wrapper is not given it
        net = mpidp.DataParallel(model)
        dp_opt = adam(model.parameters())
    else:
        dp_opt = mpidp.DataParallelOptimizer(adam(model.parameters()))
        net = mpidp.DataParallel(model, optimizer=dp_opt, blocking_parameter_updates=blocking)
    if RANK == 0:
        model.load_state_dict(model_state)
        dp_opt.load_state_dict(copy.deepcopy(opt_state))  # torch keeps the tensors it is given
    mpidp.broadcast_parameters(model, root=0)
    mpidp.broadcast_optimizer_state(dp_opt, root=0)
    reference = build(MLP, seed=1)
    reference.load_state_dict(model_state)
    ref_opt = adam(reference.parameters())
    ref_opt.load_state_dict(opt_state)
    train_like_one_process(net, dp_opt, model, reference, ref_opt, cross_entropy, (10, 4), seed=6,
                           what="after the checkpoint broadcast from rank 0")


@pytest.mark.parametrize("what", ["model", "optimizer", "inner_submodule"])
@pytest.mark.skipif(SIZE == 1, reason="one rank shares everything with itself")
def test_a_load_on_one_rank_alone_is_an_error_on_every_rank(what):
    model_state, opt_state = trained_checkpoint()
    model = build(MLP, seed=1)
    dp_opt = mpidp.DataParallelOptimizer(adam(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=dp_opt, blocking_parameter_updates=True)
    train_steps(net, dp_opt, 1)
    if RANK == SIZE - 1:
        if what == "model":
            net.load_state_dict({"module." + k: v for k, v in model_state.items()})
        elif what == "optimizer":
            dp_opt.load_state_dict(copy.deepcopy(opt_state))
        else:
            model.l1.load_state_dict({k[3:]: v for k, v in model_state.items() if k.startswith("l1.")})
    with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{SIZE - 1}\] differ from rank 0.*"
                                           r"broadcast_optimizer_state"):
        train_steps(net, dp_opt, 2)


@pytest.mark.parametrize("when", ["after a step", "before the first step"])
@pytest.mark.skipif(SIZE == 1, reason="one rank shares everything with itself")
def test_a_plain_torch_optimizer_loaded_on_one_rank_alone_is_an_error_on_every_rank(when):
    """DDP's pattern: DataParallel(model) and a torch optimizer the wrapper
    never saw. It joins the watch at its first step, which also finds a state
    loaded on one rank before that step (Horovod's pattern without the
    broadcast); it would otherwise make the ranks' updates differ."""
    _, opt_state = trained_checkpoint()
    model = build(MLP, seed=1)
    net = mpidp.DataParallel(model)
    opt = adam(model.parameters())
    unrelated = adam(build(MLP, seed=2).parameters())  # steps nothing of the model's: not watched
    if when == "after a step":
        train_steps(net, opt, 1)
    if RANK == SIZE - 1:
        opt.load_state_dict(copy.deepcopy(opt_state))
        unrelated.load_state_dict(copy.deepcopy(opt_state))
    with pytest.raises(RuntimeError, match=rf"DataParallel: after load_state_dict.*rank\(s\) "
                                           rf"\[{SIZE - 1}\] differ from rank 0"):
        for _ in range(3):
            train_steps(net, opt, 1)
            unrelated.step()


@pytest.mark.skipif(SIZE == 1, reason="one rank shares everything with itself")
def test_an_unrelated_optimizer_loaded_on_one_rank_is_left_alone():
    """Only the state of the wrapped parameters must agree: a torch optimizer
    of another (local) model, stepped between the wrapped model's steps, may
    differ across ranks; the wrapped model trains like one process."""
    _, opt_state = trained_checkpoint()
    model = build(MLP, seed=1)
    net = mpidp.DataParallel(model)
    opt = adam(model.parameters())
    reference = build(MLP, seed=1)
    ref_opt = adam(reference.parameters())
    local = build(MLP, seed=2 + RANK)
    local_opt = adam(local.parameters())
    if RANK == SIZE - 1:
        local_opt.load_state_dict(copy.deepcopy(opt_state))
    g = seeded(6)
    for _ in range(4):
        step_like_one_process(net, opt, reference, ref_opt, *classification_batch(g, 4 * SIZE))
        local(torch.randn(2, 10)).sum().backward()
        local_opt.step()
    assert_params_close(model, reference, what="beside an unrelated optimizer")
    assert_same_on_all_ranks(model)


def test_wrapping_again_hands_the_plain_optimizer_to_the_new_wrapper():
    """DataParallel twice on one model (the newer takes over): the plain
    optimizer joins the new wrapper's watch and leaves the old one's, the
    model trains like one process, and a load on one rank is still found."""
    _, opt_state = trained_checkpoint()
    model = build(MLP, seed=1)
    opt = adam(model.parameters())
    old = mpidp.DataParallel(model)
    train_steps(old, opt, 1)
    with pytest.warns(UserWarning, match="already wrapped"):
        net = mpidp.DataParallel(model)
    reference = copy.deepcopy(model)
    ref_opt = adam(reference.parameters())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch keeps what it is given
    train_like_one_process(net, opt, model, reference, ref_opt, cross_entropy, (10, 4), seed=7,
                           what="after wrapping again")
    assert not old._loads._optimizers and list(net._loads._optimizers) == [opt]
    if SIZE > 1:
        if RANK == SIZE - 1:
            opt.load_state_dict(copy.deepcopy(opt_state))
        with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{SIZE - 1}\] differ from rank 0"):
            train_steps(net, opt, 3)


def step_with_habit(net, opt, habit, t, g):
    """One step on this rank's slice, then the habit's scheduler or setting."""
    X, Y = classification_batch(g, 4 * SIZE)
    opt.zero_grad()
    loss = F.cross_entropy(net(rank_slice(X)), rank_slice(Y))
    loss.backward()
    opt.step()
    groups = opt.param_groups
    if habit == "scheduler stepped on rank 0 only" and RANK == 0:
        opt.scheduler.step()
    elif habit == "ReduceLROnPlateau on each rank's own loss":
        opt.scheduler.step(loss.item() + (t if RANK == 0 else 0.0))   # rank 0's plateaus
    elif habit == "ReduceLROnPlateau on the ranks' mean loss":
        opt.scheduler.step(mpidp.allreduce_scalar(loss.item()) + t)    # every rank's plateaus
    elif habit == "lr set by hand on the last rank" and t == 1 and RANK == SIZE - 1:
        groups[0]["lr"] *= 0.5


@pytest.mark.parametrize("habit", ["scheduler stepped on rank 0 only",
                                   "ReduceLROnPlateau on each rank's own loss",
                                   "lr set by hand on the last rank"])
@pytest.mark.parametrize("given", [False, True])
@pytest.mark.skipif(SIZE == 1, reason="one rank shares everything with itself")
def test_optimizer_settings_that_differ_across_ranks_are_an_error_on_every_rank(habit, given):
    """The same averaged gradients would update the ranks' models differently
    (torch DDP lets them drift apart); every rank raises within two steps,
    naming the setting and the ranks, whether DataParallel was given the
    optimizer or the user steps a plain torch optimizer beside it."""
    model = build(MLP, seed=1)
    if given:
        opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=True)
        torch_opt = opt.torch_optimizer
    else:
        net = mpidp.DataParallel(model)
        opt = torch_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.scheduler = (torch.optim.lr_scheduler.ReduceLROnPlateau(torch_opt, patience=0)
                     if "Plateau" in habit else torch.optim.lr_scheduler.StepLR(torch_opt, 1))
    g = seeded(6)
    with pytest.raises(RuntimeError, match=r"DataParallel: the optimizers' settings differ "
                                           r"across ranks: rank\(s\) \[.*\] do not match rank 0 "
                                           r"\(optimizer 0, param group 0: lr = \S+ on rank \d+, "
                                           r"\S+ on rank 0\).*ReduceLROnPlateau"):
        for t in range(6):
            step_with_habit(net, opt, habit, t, g)
            assert t < 4, "not found within two steps of the difference"


def test_reduce_lr_on_plateau_on_the_ranks_mean_loss_trains_like_one_process():
    """The fix the error gives: the scheduler sees the same metric on every
    rank, the lr drops alike, and the model is the one-process reference's."""
    model = build(MLP, seed=1)
    net = mpidp.DataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    reference = build(MLP, seed=1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, patience=0)
    g, ref_g = seeded(6), seeded(6)
    for t in range(4):
        step_with_habit(net, opt, "ReduceLROnPlateau on the ranks' mean loss", t, g)
        X, Y = classification_batch(ref_g, 4 * SIZE)
        ref_opt.zero_grad()
        loss = F.cross_entropy(reference(X), Y)
        loss.backward()
        ref_opt.step()
        ref_sched.step(loss.item() + t)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < 0.1
    assert_params_close(model, reference, what="after 4 steps with the plateau schedule")
    assert_same_on_all_ranks(model)


@pytest.mark.skipif(SIZE == 1, reason="one rank shares everything with itself")
def test_loading_the_same_checkpoint_everywhere_is_fine():
    model_state, opt_state = trained_checkpoint()
    model = build(MLP, seed=1)
    dp_opt = mpidp.DataParallelOptimizer(adam(model.parameters()))
    net = mpidp.DataParallel(model, optimizer=dp_opt, blocking_parameter_updates=True)
    train_steps(net, dp_opt, 1)
    model.load_state_dict(model_state)
    dp_opt.load_state_dict(copy.deepcopy(opt_state))
    train_steps(net, dp_opt, 3)
    assert_same_on_all_ranks(model)


def test_broadcast_optimizer_state_from_any_root():
    """Each rank's own Adam state (trained alone on its own data) becomes the
    root's, moments and step counts alike; DASO-style local optimizers too."""
    root = SIZE - 1
    model = build(MLP, seed=3)
    opt = adam(model.parameters())
    g = seeded(20 + RANK)
    opt.zero_grad()
    model(on_device(torch.randn(4, 10, generator=g))).sum().backward()
    opt.step()
    opt.param_groups[0]["lr"] = 0.001 * (RANK + 1)
    mpidp.broadcast_optimizer_state(opt, root=root)
    mine = opt.state_dict()
    theirs = MPI.COMM_WORLD.bcast(mine, root=root)
    assert mine["param_groups"][0]["lr"] == pytest.approx(0.001 * SIZE)
    for k, state in theirs["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(mine["state"][k][name]).cpu(),
                               torch.as_tensor(value).cpu()), (k, name)


def test_broadcast_parameters_takes_modules_state_dicts_and_pairs():
    for form in ("module", "state_dict", "named"):
        model = build(MLP, seed=30 + RANK)
        target = {"module": model, "state_dict": model.state_dict(),
                  "named": model.named_parameters()}[form]
        mpidp.broadcast_parameters(target, root=0)
        want = rank0({k: v.detach().cpu() for k, v in model.state_dict().items()})
        for k, v in model.state_dict().items():
            assert torch.equal(v.detach().cpu(), want[k]), (form, k)


def test_broadcasts_check_their_arguments():
    model = build(MLP, seed=0)
    with pytest.raises(ValueError, match=r"root: expected a rank in 0 \.\. "):
        mpidp.broadcast_parameters(model, root=SIZE)
    with pytest.raises(TypeError, match="root: expected an int"):
        mpidp.broadcast_parameters(model, root=True)
    with pytest.raises(TypeError, match="params: expected a torch.nn.Module"):
        mpidp.broadcast_parameters(3)
    with pytest.raises(TypeError, match="params: entry 0 is a str"):
        mpidp.broadcast_parameters(["x"])
    with pytest.raises(TypeError, match="optimizer: expected a torch optimizer"):
        mpidp.broadcast_optimizer_state(model)
