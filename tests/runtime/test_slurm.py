"""The digits example launched by a real Slurm: `srun -n 4 --mpi=pmix --overcommit`.

Starts the one-node Slurm of benchmarks/cluster/slurm_up.sh (munged, slurmctld
and slurmd on localhost, everything under /run/mpidp-slurm, ports
16817/16818), runs examples/digits.py under srun (DASO, 4 ranks as 2 emulated
nodes of 2 through MPIDP_RANKS_PER_NODE=2), checks srun's exit status and that
the test accuracy the example prints is at least 95 %, then stops the Slurm it
started (one that was already running is left running).

slurm_up.sh installs the Debian packages (slurmctld slurmd slurm-client
munge) when they are missing; set MPIDP_TEST_SLURM_INSTALL=0 to skip instead
of installing. Skips, saying why, where Slurm cannot be used: not Linux, not
root, Slurm missing with no apt-get (or installing switched off), the
installation failing, or the daemons not starting (the scripts' exit 77, or
their error message and log). With Slurm installed it takes about 25-35 s on
2 cores.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "benchmarks" / "cluster"
SLURM_DIR = Path("/run/mpidp-slurm")
SLURM_CONF = SLURM_DIR / "slurm.conf"
CANNOT_RUN = 77
RANKS = 4
MIN_ACCURACY = 95.0
SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "munged")


def child_env():
    """This environment without MPI's own variables (the test process is an MPI
    singleton; its OMPI_*/PMIX_* values would confuse the ranks srun starts)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "OPAL_", "SLURM_"))}
    env["SLURM_CONF"] = str(SLURM_CONF)
    return env


def daemons_running():
    """True when slurm_up.sh's slurmctld and slurmd are both running."""
    for name in ("slurmctld", "slurmd"):
        try:
            pid = int((SLURM_DIR / f"{name}.pid").read_text().strip())
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, ValueError):
            return False
        if comm != name:
            return False
    return True


def log_tail(lines=15):
    out = []
    for name in ("slurmctld.log", "slurmd.log"):
        path = SLURM_DIR / "log" / name
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path}\n" + "\n".join(tail))
    return "\n".join(out)


@pytest.fixture(scope="module")
def slurm():
    if not sys.platform.startswith("linux"):
        pytest.skip("Slurm here needs Linux")
    if os.geteuid() != 0:
        pytest.skip(f"needs root to start munged, slurmctld and slurmd (uid {os.geteuid()})")
    missing = [tool for tool in SLURM_TOOLS if not shutil.which(tool)]
    if missing:
        if os.environ.get("MPIDP_TEST_SLURM_INSTALL", "1") == "0":
            pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing) and "
                        "MPIDP_TEST_SLURM_INSTALL=0 forbids installing it")
        if not shutil.which("apt-get"):
            pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing) and there is "
                        "no apt-get to install it")
    ours = not daemons_running()
    t0 = time.monotonic()
    try:
        up = subprocess.run([str(CLUSTER / "slurm_up.sh")], env=child_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        subprocess.run([str(CLUSTER / "slurm_down.sh")], env=child_env(), capture_output=True)
        pytest.skip("slurm_up.sh did not finish in 600 s (package installation or daemons hung)")
    elapsed = time.monotonic() - t0
    if up.returncode != 0:
        message = (up.stderr.strip() or up.stdout.strip()).splitlines()
        reason = message[-1] if message else f"exit status {up.returncode}"
        if up.returncode != CANNOT_RUN:
            sys.stderr.write(f"slurm_up.sh failed ({up.returncode}):\n{up.stdout}\n{up.stderr}\n"
                             f"{log_tail()}\n")
            if ours:
                subprocess.run([str(CLUSTER / "slurm_down.sh")], env=child_env(),
                               capture_output=True)
        pytest.skip(f"Slurm cannot be started here: {reason}")
    if missing:
        sys.stderr.write(f"[test_slurm] installed and started Slurm in {elapsed:.1f} s\n")
    yield
    if ours:
        down = subprocess.run([str(CLUSTER / "slurm_down.sh")], env=child_env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, f"slurm_down.sh failed:\n{down.stdout}\n{down.stderr}"
        assert not daemons_running()


def test_digits_under_srun(slurm):
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        python = Path(sys.executable)
    env = child_env()
    env["MPIDP_RANKS_PER_NODE"] = "2"      # 2 emulated nodes x 2 ranks: DASO syncs between them
    env["MPIDP_TIMEOUT"] = "120"           # no collective waits longer
    env["PYTHONUNBUFFERED"] = "1"
    cmd = ["srun", "-n", str(RANKS), "--mpi=pmix", "--overcommit", "--time=3",
           "--job-name=mpidp-test-digits", "--kill-on-bad-exit=1",
           str(python), str(ROOT / "examples" / "digits.py"), "--quiet"]
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as exc:
        subprocess.run(["scancel", "--name=mpidp-test-digits"], env=env, capture_output=True)
        pytest.fail(f"srun did not finish in 180 s:\n{exc.stdout}\n{exc.stderr}\n{log_tail()}")
    report = f"{' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, f"srun exited {proc.returncode}\n{report}\n{log_tail()}"
    header = re.search(r"on (\d+) rank\(s\) \((\d+) node\(s\) x (\d+)\)", proc.stdout)
    assert header, report
    assert header.groups() == (str(RANKS), "2", "2"), report
    final = re.search(r"test accuracy ([0-9.]+)% after (\d+) epochs", proc.stdout)
    assert final, report
    accuracy = float(final.group(1))
    assert accuracy >= MIN_ACCURACY, f"test accuracy {accuracy}% < {MIN_ACCURACY}%\n{report}"
