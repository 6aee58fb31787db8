"""Smoke test of the emulated multi-node cluster (benchmarks/cluster/).

Brings up 2 emulated nodes (network namespaces, veth + bridge, tbf at
100 Mbit/s), runs mpi4py jobs across them with benchmarks/cluster/run.sh, and
checks that
  * an allreduce gives the right values at 2 ranks (1 per node) and at 4
    ranks (2 per node), with the ranks on the nodes they should be on;
  * the shaper is in force: 20 MB between the nodes take >= 1.4 s (1.6 s at
    100 Mbit/s), and the same transfer with shaping off is several times
    faster;
  * ranks of one node do not use the links (shared memory): a 20 MB transfer
    between them is fast and adds little to the link byte counters.
Skips (with the reason) where the cluster cannot be built: not root, no ip
or tc, namespaces not permitted (the scripts exit 77 then), or no Open MPI
mpirun. Uses its own cluster name, so a cluster someone else brought up is
left alone, and tears it down at the end. Runs in about 15 s.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "benchmarks" / "cluster"
NAME = "mpidpsmoke"      # cluster name: namespaces mpidpsmoke-sw, mpidpsmoke-n0, ...
CANNOT_RUN = 77          # the scripts' exit status for "cannot run here"
MB20 = 20_000_000
RATE_BITS = 100e6        # --rate 100mbit
# The least time 20 MB can take on that link (TCP/IP's headers aside).
LINK_FLOOR_S = 0.875 * MB20 * 8 / RATE_BITS

# benchmarks/cluster/netstats.py, loaded from its file (benchmarks/ is no package)
_spec = importlib.util.spec_from_file_location("mpidp_cluster_netstats", CLUSTER / "netstats.py")
netstats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(netstats)


def child_env():
    """This environment without MPI's own variables (the test process may be an
    MPI singleton: its OMPI_*/PMIX_* values would confuse the new mpirun) and
    without GLOO_SOCKET_IFNAME: a gloo group made in this process on one node
    sets it to the loopback ("lo"), and run.sh keeps a value it is given, so
    the nodes' ranks would look for each other on their own loopbacks."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "OPAL_")) and k != "GLOO_SOCKET_IFNAME"}
    env["MPIDP_CLUSTER_NAME"] = NAME
    return env


def script(name, *args, timeout=60):
    proc = subprocess.run([str(CLUSTER / name), *map(str, args)], env=child_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    return proc


def check(proc):
    assert proc.returncode == 0, (
        f"{proc.args} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def linkbench(nodes, per_node, rate, *args):
    """Runs linkbench.py on the cluster; returns (its JSON result, link byte delta)."""
    before = netstats.snapshot(NAME)
    proc = check(script("run.sh", "--nodes", nodes, "--ranks-per-node", per_node, "--rate", rate,
                        "--", sys.executable, "-m", "mpi4py", CLUSTER / "linkbench.py", *args))
    traffic = netstats.delta(before, netstats.snapshot(NAME))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("LINKBENCH ")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0][len("LINKBENCH "):]), traffic


@pytest.fixture(scope="module")
def cluster():
    if not sys.platform.startswith("linux"):
        pytest.skip("the emulated cluster needs Linux network namespaces")
    pytest.importorskip("mpi4py")
    pytest.importorskip("numpy")
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun on PATH (Debian: apt-get install openmpi-bin)")
    proc = script("up.sh", "--nodes", 2, "--rate", "100mbit", "--delay", "0ms")
    if proc.returncode == CANNOT_RUN:
        pytest.skip("emulated cluster cannot be built here: " + proc.stderr.strip().splitlines()[-1])
    check(proc)
    try:
        yield
    finally:
        check(script("down.sh"))


def test_two_nodes_one_rank_each_allreduce_and_shaping(cluster):
    res, traffic = linkbench(2, 1, "100mbit", "--bytes", MB20, "--reps", 1)
    assert res["allreduce_ok"] and res["allreduce_value"] == 3.0, res
    assert res["hosts"] == [f"{NAME}-n0", f"{NAME}-n1"], res
    assert res["peer"] == 1, res
    # 20 MB at 100 Mbit/s need 1.6 s on the wire (plus ~3 % TCP/IP headers):
    # a bound no load can beat (unshaped, this machine moves them in
    # ~0.01-0.05 s; a loaded one only takes longer, so no upper bound).
    t = res["seconds"][0]
    assert t >= LINK_FLOOR_S, \
        f"20 MB took {t:.3f} s; at 100 Mbit/s expected >= {LINK_FLOOR_S:.2f} s"
    assert traffic["nodes"][f"{NAME}-n0"]["sent_bytes"] >= MB20, traffic


def test_two_nodes_two_ranks_each_allreduce_and_shared_memory(cluster):
    res, traffic = linkbench(2, 2, "100mbit", "--bytes", MB20, "--reps", 1, "--same-node")
    assert res["allreduce_ok"] and res["allreduce_value"] == 10.0, res
    assert res["hosts"] == [f"{NAME}-n0"] * 2 + [f"{NAME}-n1"] * 2, res
    assert res["peer"] == 1, res
    # rank 0 -> rank 1 stays on node 0 (shared memory): not on the link
    # counters (the allreduce of 512 KiB vectors and MPI's startup account
    # for ~1-2 MB there). (Not timed: a loaded node only makes it slower.)
    assert traffic["total_bytes"] < MB20 / 4, traffic


def test_unshaped_links_are_much_faster(cluster):
    res, traffic = linkbench(2, 1, "none", "--bytes", MB20, "--reps", 1)
    assert res["allreduce_ok"], res
    t = res["seconds"][0]
    assert t < LINK_FLOOR_S, (f"20 MB took {t:.3f} s without shaping, as long as the 100 Mbit/s "
                              "link would need: the tbf shaper must be what slows them down")
    assert traffic["total_bytes"] >= MB20, traffic


def test_daso_across_two_emulated_nodes(cluster):
    """torch's default group across nodes (rank 0's TCP store, reached from the
    other node) and node-local DDP inside each: the Heat-style DASO script
    trains, and every rank ends with the same model."""
    proc = check(script("run.sh", "--nodes", 2, "--ranks-per-node", 2, "--rate", "none", "--",
                        sys.executable, ROOT / "tests" / "support" / "heat_style_train.py", "daso",
                        timeout=240))
    # Searched, not split into lines: ranks' lines can interleave mid-line.
    found = dict(re.findall(r"rank (\d+): accuracy [\d.]+ digest (\d+)", proc.stdout))
    assert len(found) == 4 and len(set(found.values())) == 1, proc.stdout + proc.stderr
