"""examples/diloco_digits.py end to end: real mpirun jobs at 2 ranks. A run
of 3 epochs and a run of 2 epochs resumed for the third end on the same
parameters bit for bit, with a fragment's sync in flight at the checkpoint
(Streaming DiLoCo: 2 fragments, one turn every 4 steps, sent 2 steps
ahead)."""

from __future__ import annotations

import re

import pytest
import torch

from mpi_jobs import ROOT, run_mpi

pytestmark = pytest.mark.serial

SCRIPT = str(ROOT / "examples" / "diloco_digits.py")
ARGS = ["--sync-every", "8", "--fragments", "2", "--delay", "2", "--batch-size", "16"]
ENV = {"CUDA_VISIBLE_DEVICES": "", "MPIDP_TIMEOUT": "60"}
EPOCH = re.compile(r"epoch (\d+)/(\d+): train_loss (\S+) test_acc ([\d.]+)% steps (\d+)")


def run(ckpt, epochs, *extra):
    rc, out, _ = run_mpi(2, [SCRIPT, *ARGS, "--epochs", str(epochs), "--checkpoint-dir", str(ckpt),
                             *extra], timeout=120, **ENV)
    assert rc == 0, out
    return out


def test_resumed_run_equals_the_uninterrupted_one(tmp_path):
    straight = run(tmp_path / "a", 3)
    rows = [m.groups() for m in EPOCH.finditer(straight)]
    assert [int(r[0]) for r in rows] == [0, 1, 2] and "done: 3 epochs" in straight, straight
    assert float(rows[-1][2]) < float(rows[0][2]) and float(rows[-1][3]) > 50, straight

    run(tmp_path / "b", 2)
    state = torch.load(tmp_path / "b" / "epoch0001-rank00001.pt", weights_only=True)
    steps = state["diloco"]["step"]
    assert steps == 2 * int(rows[0][4])
    # Every 4 steps a turn; a send 2 steps ahead is in flight when steps % 4 == 2.
    assert bool(state["diloco"]["in_flight"]) == (steps % 4 == 2)
    resumed = run(tmp_path / "b", 3, "--resume")
    assert "continuing at epoch 2" in resumed and "done: 3 epochs" in resumed, resumed
    assert [m.group(1) for m in EPOCH.finditer(resumed)] == ["2"], resumed

    for rank in (0, 1):
        a = torch.load(tmp_path / "a" / f"epoch0002-rank{rank:05d}.pt", weights_only=True)
        b = torch.load(tmp_path / "b" / f"epoch0002-rank{rank:05d}.pt", weights_only=True)
        for k, v in a["model"].items():
            assert torch.equal(v, b["model"][k]), (rank, k)
        for fa, fb in zip(a["diloco"]["shared"], b["diloco"]["shared"]):
            assert all(torch.equal(x, y) for x, y in zip(fa, fb)), rank
    # Only the last two epochs are kept.
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(
        [f"epoch{e:04d}-rank{r:05d}.pt" for e in (1, 2) for r in (0, 1)] +
        ["epoch0001.done", "epoch0002.done"])


def test_resume_needs_a_checkpoint_directory():
    rc, out, _ = run_mpi(1, [SCRIPT, "--resume"], timeout=60, **ENV)
    assert rc != 0 and "--resume needs --checkpoint-dir" in out, out
