"""Horovod's own PyTorch test suite (test/parallel/test_torch.py, unchanged,
from ../shared/peers/horovod) against mpidp.horovod.torch: the whole file in
one mpirun job at 2 ranks and at 3 ranks, as Horovod's CI runs it (one
failure there desynchronises the ranks' automatic names, so every test must
leave the ranks in step).

`horovod` resolves to mpidp.horovod through tests/horovod/horovod_suite (with the
three helpers the suite takes from Horovod's test utilities), and its
plugin deselects by name the tests that fail with Horovod itself here and
writes every test's outcome on every rank; they are kept in
tests/logs/horovod-suite-<N>-ranks.json. Every other test must pass on every
rank, or be skipped by the suite for a reason that holds for Horovod on CPUs
with MPI (no GPU, not the Gloo controller, the suite's own skip)."""

from __future__ import annotations

import collections
import json

import pytest

from mpi_jobs import ROOT, run_mpi

pytestmark = pytest.mark.serial

SUITE = ROOT.parent / "shared" / "peers" / "horovod"
LOGS = ROOT / "tests" / "logs"
# The suite's skips that Horovod on CPUs with MPI takes too.
SKIPS_HOROVOD_TAKES = ("No GPUs available", "Gloo is not available",
                       "github.com/horovod/horovod/issues/2496")
NEEDS_GPU = ("test_broadcast_state_gpu",)   # skipped by the suite without a message


def run_suite(n: int, tmp_path) -> dict:
    """{test: {rank: (outcome, reason)}} of one job at n ranks."""
    out = tmp_path / f"suite-{n}"
    rc, output, seconds = run_mpi(
        n, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_plugin",
            "--rootdir", str(SUITE), str(SUITE / "test_torch.py")],
        timeout=900, PYTHONPATH=str(ROOT / "tests" / "horovod" / "horovod_suite"),
        MPIDP_SUITE_OUT=str(out), MPIDP_TIMEOUT="60")
    results: dict = collections.defaultdict(dict)
    started = {}
    for rank in range(n):
        path = out.with_name(out.name + f".rank{rank}")
        rows = [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []
        for row in rows:
            if "started" in row:
                started[rank] = row["started"]
                continue
            # A test reports its call, and its set-up or teardown where they
            # fail: the first report that is not a pass stands.
            earlier = results[row["test"]].get(rank)
            if earlier is None or earlier[0] == "passed":
                results[row["test"]][rank] = (row["outcome"], row.get("reason", ""))
    LOGS.mkdir(exist_ok=True)
    (LOGS / f"horovod-suite-{n}-ranks.json").write_text(json.dumps(
        {"ranks": n, "exit": rc, "seconds": round(seconds, 1),
         "tests": {t: {str(r): list(v) for r, v in per.items()} for t, per in
                   sorted(results.items())}}, indent=1))
    if rc != 0 and not any(o == "failed" for per in results.values() for o, _ in per.values()):
        pytest.fail(f"the suite's job at {n} ranks exited {rc} (last tests started: {started}):\n"
                    f"{output[-3000:]}")
    return results


@pytest.mark.skipif(not (SUITE / "test_torch.py").exists(),
                    reason="Horovod's suite is not beside this clone (../shared/peers/horovod)")
@pytest.mark.parametrize("n", [2, 3])
def test_horovods_own_suite_passes(n, tmp_path):
    results = run_suite(n, tmp_path)
    assert len(results) >= 115, f"{len(results)} tests reported: the job ended early"
    bad = []
    for test, per_rank in sorted(results.items()):
        for rank in range(n):
            outcome, reason = per_rank.get(rank, ("missing", "no outcome from this rank"))
            ok = outcome in ("passed", "deselected") or outcome == "skipped" and (
                any(s in reason for s in SKIPS_HOROVOD_TAKES) or test in NEEDS_GPU)
            if not ok:
                bad.append(f"{test} on rank {rank}: {outcome}: {reason.strip()[-400:]}")
                break
    assert not bad, f"{len(bad)} of Horovod's tests did not pass at {n} ranks:\n" + \
        "\n".join(bad)
