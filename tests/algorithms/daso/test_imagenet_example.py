"""examples/imagenet_daso.py end to end, on a tiny generated ImageFolder.

The training runs are real mpirun jobs (4 ranks as 2 emulated nodes of 2, and
2 ranks on synthetic data), so the module runs once, in the single-process
pass. The model, dataset and transform helpers of the example are checked in
process first (they are cheap)."""

from __future__ import annotations

import json
import math
import re
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from mpi_jobs import ROOT, run_mpi

pytestmark = pytest.mark.serial

sys.path.insert(0, str(ROOT / "examples"))
from image_folder import EvalTransform, ImageFolder, SyntheticImages, TrainTransform  # noqa: E402
from resnet import resnet18, resnet50, resnet_tiny  # noqa: E402

SCRIPT = str(ROOT / "examples" / "imagenet_daso.py")
# Three classes told apart by colour. An odd class count puts an odd number of
# float32 values before BatchNorm's int64 counters, which once broke the
# initial broadcast: keep it odd.
COLOURS = {"blue": (40, 60, 200), "green": (40, 190, 60), "red": (210, 40, 40)}
TRAIN_PER_CLASS, VAL_PER_CLASS = 12, 6
# Every child: CPU only (this test is about the example, not the GPU path), and
# a stuck collective aborts the job instead of hanging until the timeout.
ENV = {"CUDA_VISIBLE_DEVICES": "", "MPIDP_TIMEOUT": "60"}
EPOCH_LINE = re.compile(
    r"epoch (\d+)/(\d+): phase (\w+) global_skip (\d+) batches_to_wait (\d+) lr (\S+) "
    r"train_loss (\S+) val_top1 ([\d.]+)% time ([\d.]+)s sent ([\d.]+) MB")


def epochs_in(output: str) -> list[dict]:
    keys = ("epoch", "total", "phase", "global_skip", "btw", "lr", "loss", "acc", "time", "mb")
    rows = []
    for m in EPOCH_LINE.finditer(output):
        row = dict(zip(keys, m.groups()))
        for k in ("epoch", "total", "global_skip", "btw"):
            row[k] = int(row[k])
        for k in ("lr", "loss", "acc", "time", "mb"):
            row[k] = float(row[k])
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    """DIR/{train,val}/<colour>/imgNNN.jpg: 40x40 noisy images of the class colour."""
    root = tmp_path_factory.mktemp("imagenet")
    rng = np.random.default_rng(0)
    for split, n in (("train", TRAIN_PER_CLASS), ("val", VAL_PER_CLASS)):
        for name, colour in COLOURS.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                noise = rng.integers(-50, 51, size=(40, 40, 1))
                pixels = np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels, "RGB").save(folder / f"img{i:03d}.jpg", quality=90)
    (root / "train" / "blue" / "notes.txt").write_text("not an image")
    return root


# -- the example's helpers, in process ------------------------------------------------------------

def test_resnet_layout():
    model = resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's resnet50
    assert sum(p.numel() for p in resnet18().parameters()) == 11_689_512
    names = dict(model.named_parameters())
    assert names["layer2.0.conv2.weight"].shape == (128, 128, 3, 3)   # stride on the 3x3 (v1.5)
    assert model.layer2[0].conv2.stride == (2, 2) and model.layer2[0].conv1.stride == (1, 1)
    assert names["layer4.0.downsample.0.weight"].shape == (2048, 1024, 1, 1)
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    tiny = resnet_tiny(num_classes=4)
    assert tiny(torch.randn(2, 3, 32, 32)).shape == (2, 4)
    assert sum(p.numel() for p in tiny.parameters()) < 100_000


def test_image_folder_and_transforms(image_root):
    train = ImageFolder(image_root / "train", TrainTransform(32))
    assert train.classes == sorted(COLOURS)
    assert len(train) == len(COLOURS) * TRAIN_PER_CLASS   # notes.txt skipped
    assert train.targets == sorted(train.targets)
    x, y = train[TRAIN_PER_CLASS]                         # first image of the second class
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == 1
    val = ImageFolder(image_root / "val", EvalTransform(32), classes=train.classes)
    x, y = val[0]
    assert x.shape == (3, 32, 32) and y == 0
    # Normalised with ImageNet statistics: blue's blue channel is well above its red one.
    assert x[2].mean() > 0.5 > x[0].mean()
    box = TrainTransform(224).crop_box(500, 375)
    assert 0 <= box[0] < box[2] <= 500 and 0 <= box[1] < box[3] <= 375
    synth = SyntheticImages(10, 3, 16, seed=1)
    assert torch.equal(synth[4][0], synth[4][0]) and synth[4][0].shape == (3, 16, 16)
    with pytest.raises(FileNotFoundError):
        ImageFolder(image_root / "missing")


# -- the example, under mpirun -------------------------------------------------------------------

def common_args(image_root, ckpt, epochs):
    return [SCRIPT, "--data", str(image_root), "--arch", "tiny", "--image-size", "32",
            "--batch-size", "4", "--epochs", str(epochs), "--warmup-epochs", "1",
            "--cooldown-epochs", "0", "--workers", "0", "--checkpoint-dir", str(ckpt)]


def test_train_checkpoint_resume(image_root, tmp_path):
    ckpt = tmp_path / "ckpt"
    env = dict(ENV, MPIDP_RANKS_PER_NODE="2")
    rc, out, secs = run_mpi(4, common_args(image_root, ckpt, 2), timeout=150, **env)
    assert rc == 0, out
    assert "4 rank(s) = 2 node(s) x 2" in out, out
    rows = epochs_in(out)
    assert [(r["epoch"], r["total"]) for r in rows] == [(0, 2), (1, 2)], out
    assert rows[0]["phase"] == "warmup" and rows[0]["global_skip"] == 0, out
    assert rows[1]["phase"] == "cycling" and rows[1]["global_skip"] >= 1, out
    for r in rows:
        assert math.isfinite(r["loss"]) and 0 <= r["acc"] <= 100 and r["mb"] > 0, out
    assert "done: 2 epochs" in out

    names = sorted(p.name for p in ckpt.iterdir())
    expected = [f"epoch{e:04d}-rank{r:05d}.pt" for e in (0, 1) for r in range(4)]
    assert names == sorted(expected + ["epoch0000.done", "epoch0001.done"]), names
    marker = json.loads((ckpt / "epoch0001.done").read_text())
    assert (marker["world_size"], marker["n_nodes"], marker["local_size"]) == (4, 2, 2)
    state = torch.load(ckpt / "epoch0001-rank00003.pt", weights_only=True)
    assert state["epoch"] == 1 and state["daso"]["rank"] == 3
    assert state["daso"]["schedule"]["epoch"] == 2
    # Between epochs every rank holds the same parameters (the last batch's sync is blocking).
    other = torch.load(ckpt / "epoch0001-rank00000.pt", weights_only=True)
    for k, v in state["model"].items():
        assert torch.equal(v, other["model"][k]), k

    # A second job continues after epoch 1 instead of starting over.
    rc, out2, secs2 = run_mpi(4, common_args(image_root, ckpt, 3) + ["--resume", "--no-progress"],
                              timeout=150, **env)
    assert rc == 0, out2
    assert "resumed from" in out2 and "continuing at epoch 2" in out2, out2
    rows = epochs_in(out2)
    assert [(r["epoch"], r["total"]) for r in rows] == [(2, 3)], out2
    assert math.isfinite(rows[0]["loss"]), out2
    names = sorted(p.name for p in ckpt.iterdir())
    expected = [f"epoch{e:04d}-rank{r:05d}.pt" for e in (1, 2) for r in range(4)]
    assert names == sorted(expected + ["epoch0001.done", "epoch0002.done"]), names  # last two kept
    assert torch.load(ckpt / "epoch0002-rank00001.pt", weights_only=True)["epoch"] == 2
    print(f"train {secs:.1f}s, resume {secs2:.1f}s")


def test_synthetic_two_ranks():
    rc, out, secs = run_mpi(
        2, [SCRIPT, "--synthetic", "--num-classes", "3", "--synthetic-train-size", "64",
            "--synthetic-val-size", "20", "--arch", "tiny", "--image-size", "32",
            "--batch-size", "8", "--epochs", "2", "--warmup-epochs", "1", "--cooldown-epochs", "0",
            "--workers", "0", "--amp"], timeout=120, **ENV)
    assert rc == 0, out
    assert "2 rank(s) = 1 node(s) x 2, device cpu" in out and "AMP" in out, out
    rows = epochs_in(out)
    assert [r["epoch"] for r in rows] == [0, 1], out
    assert [r["phase"] for r in rows] == ["warmup", "cycling"], out
    assert all(math.isfinite(r["loss"]) for r in rows), out
    assert "done: 2 epochs" in out


def test_help_and_usage_errors(tmp_path):
    rc, out, _ = run_mpi(1, [SCRIPT, "--help"], timeout=60, **ENV)
    assert rc == 0, out
    for option in ("--data", "--synthetic", "--resume", "--checkpoint-dir", "--downcast",
                   "--warmup-epochs", "exit codes"):
        assert option in out, option
    # A fresh run (no --resume) into a directory holding another run's
    # checkpoints stops with exit 2 before training, and leaves them alone.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "epoch0003.done").write_text("{}")
    rc, out, _ = run_mpi(1, [SCRIPT, "--synthetic", "--arch", "tiny", "--image-size", "32",
                             "--checkpoint-dir", str(ckpt)], timeout=60, **ENV)
    assert rc == 2 and "add --resume" in out and not epochs_in(out), out
    assert [p.name for p in ckpt.iterdir()] == ["epoch0003.done"]
