"""hvd.elastic (mpidp.horovod.torch) on ULFM: a rank killed mid-epoch rolls
every survivor back to the last commit, and training goes on at the new
size -- compared with the simulation of every replica of
test_fault_tolerance.py (the dead rank's data counts in every step
committed before its death and in none after)."""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
from test_fault_tolerance import simulate  # noqa: E402

pytestmark = pytest.mark.serial
STEPS = 6


def run(tmp_path, n, kill):
    env = dict(os.environ, FT_KILL=kill, FT_STEPS=str(STEPS), MPIDP_TIMEOUT="60")
    proc = subprocess.run([os.path.join(ROOT, "scripts/mpirun_ft.sh"), str(n), sys.executable,
                           os.path.join(HERE, "hvd_elastic_train.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=240)
    saved = {int(f[5:-3]): torch.load(tmp_path / f) for f in os.listdir(tmp_path)
             if f.startswith("rank-")}
    return proc, saved


@pytest.mark.parametrize("phase", ["forward", "step"])
def test_a_lost_rank_rolls_back_to_the_commit_and_training_goes_on(tmp_path, phase):
    proc, saved = run(tmp_path, 3, f"2:3:{phase}")
    assert sorted(saved) == [0, 1], proc.stderr[-3000:]
    params, momentum, _ = simulate(3, STEPS, {2: 3})
    for r, got in saved.items():
        assert got["sizes"] == [3, 3, 3, 2, 2, 2]
        assert got["resets"] == [2]
        for a, b in zip(got["params"], params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(got["momentum"], momentum):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_rank_lost_runs_through(tmp_path):
    proc, saved = run(tmp_path, 2, "")
    assert sorted(saved) == [0, 1], proc.stderr[-3000:]
    params, _, _ = simulate(2, STEPS, {})
    for got in saved.values():
        assert got["resets"] == []
        for a, b in zip(got["params"], params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
