"""Horovod's examples/pytorch/pytorch_synthetic_benchmark.py (from
../shared/peers/horovod, unchanged: `horovod` resolves to mpidp.horovod
through tests/horovod/horovod_suite) at 2 ranks on CPUs, ResNet-18, two short
iterations: it must run to its end and print Horovod's summary lines.

It needs torchvision for its model. Where torchvision cannot be imported
beside this torch the test skips with torchvision's own error: PyPI's
torchvision wheels are built against the CUDA build of torch (they load
libc10_cuda.so), so they do not load beside a CPU-only torch, and the CPU
wheels are published only on download.pytorch.org."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mpi_jobs import ROOT, clean_env, run_mpi

pytestmark = pytest.mark.serial

SCRIPT = ROOT.parent / "shared" / "peers" / "horovod" / "pytorch_synthetic_benchmark.py"


def _torchvision_problem() -> str | None:
    probe = subprocess.run([sys.executable, "-c", "from torchvision import models"],
                           env=clean_env(), capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        return None
    return probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "import failed"


@pytest.mark.skipif(not SCRIPT.exists(),
                    reason="Horovod's benchmark is not beside this clone (../shared/peers/horovod)")
def test_horovods_synthetic_benchmark_runs_unchanged():
    problem = _torchvision_problem()
    if problem is not None:
        pytest.skip(f"torchvision does not import here ({problem}); `make setup` does not "
                    "install it because PyPI's torchvision wheels need the CUDA build of torch "
                    "(libc10_cuda.so) and this machine's torch is the CPU build")
    rc, output, _ = run_mpi(
        2, [str(SCRIPT), "--model", "resnet18", "--num-iters", "2", "--num-batches-per-iter", "2",
            "--batch-size", "8", "--num-warmup-batches", "1", "--no-cuda"],
        timeout=900, PYTHONPATH=str(ROOT / "tests" / "horovod" / "horovod_suite"), MPIDP_TIMEOUT="120")
    assert rc == 0, output[-3000:]
    assert "Model: resnet18" in output and "Number of CPUs: 2" in output, output[-2000:]
    assert "Total img/sec on 2 CPU(s)" in output, output[-2000:]
