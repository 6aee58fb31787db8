"""torch's own distributed test suite on the "mpidp" backend: every test
method of the torch wheel's DistributedTest._DistTestBase, run inside
mpirun-launched ranks by tests/c10d/torch_suite/run_ranks.py, at 3 and 4 ranks
(the suite's group tests use ranks 1 and 2, so torch runs it at 3 or more).

Every test must pass or be skipped by the suite itself (a GPU it needs, a
world size, a feature torch keeps for one named backend: the reasons are
counted in tests/logs/torch-suite-<N>-ranks.json and in docs/
torch-distributed.md). A second pass shows the suite's gates the name of
torch's in-tree MPI backend, for the tests torch runs on that backend only
(all_to_all on CPU tensors). A job that ends inside a test (a deadline, a
crash) fails that test, and the rest run in a new job."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest

from mpi_jobs import ROOT, clean_env, run_mpi

pytestmark = pytest.mark.serial

RUNNER = str(ROOT / "tests" / "c10d" / "torch_suite" / "run_ranks.py")
LOGS = ROOT / "tests" / "logs"
# The suite's own skip reasons for the tests it keeps for torch's MPI backend.
MPI_ONLY = ("Only MPI supports",)


def run_suite(n: int, tmp_path, names=(), gates_as="mpidp", **env) -> list[dict]:
    """Runs the suite (or `names`) at n ranks; one result per test, a job
    that ends inside a test counting as that test's failure."""
    results: list[dict] = []
    remaining = list(names)
    out = tmp_path / f"suite-{n}-{gates_as}.jsonl"
    env.setdefault("MPIDP_TIMEOUT", "60")
    for _ in range(20):
        out.write_text("")
        rc, output, _ = run_mpi(n, [RUNNER, "--out", str(out), "--gates-as", gates_as,
                                    *remaining], timeout=600, **env)
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        done = [line for line in lines if "test" in line]
        results += done
        started = [line["started"] for line in lines if "started" in line]
        if rc == 0 or any("finished" in line for line in lines):
            return results
        if not started or (done and done[-1]["test"] == started[-1]):
            pytest.fail(f"the suite's job at {n} ranks failed outside a test (exit {rc}):\n"
                        f"{output[-3000:]}")
        results.append({"test": started[-1], "outcome": "failed",
                        "reason": f"the job ended inside it (exit {rc}): {output[-600:]}"})
        every = remaining or _all_names()
        remaining = every[every.index(started[-1]) + 1:]
        if not remaining:
            return results
    pytest.fail("the suite's job kept ending")


def _all_names():
    """The full test list, in the runner's order, when no names were given."""
    code = ("import os; os.environ.update(BACKEND='mpidp', WORLD_SIZE='1', TEMP_DIR='/tmp');"
            "from torch.testing._internal.distributed.distributed_test import DistributedTest as D;"
            "print('\\n'.join(sorted(n for n in dir(D._DistTestBase) if n.startswith('test_'))))")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True,
                         text=True, check=True).stdout
    return out.split()


def summarize(n: int, results: list[dict], extra: list[dict]) -> dict:
    counts = collections.Counter(r["outcome"] for r in results)
    summary = {
        "ranks": n,
        "tests": len(results),
        "passed": counts["passed"],
        "failed": counts["failed"] + counts["mixed"],
        "skipped": counts["skipped"],
        "passed_with_mpi_gates": sum(r["outcome"] == "passed" for r in extra),
        "skip_reasons": collections.Counter(r["reason"] for r in results
                                            if r["outcome"] == "skipped").most_common(),
        "failures": [r for r in results + extra if r["outcome"] in ("failed", "mixed")],
    }
    LOGS.mkdir(exist_ok=True)
    (LOGS / f"torch-suite-{n}-ranks.json").write_text(json.dumps(summary, indent=1))
    return summary


@pytest.mark.parametrize("ranks", [3, 4])
def test_torch_distributed_suite_passes_on_mpidp(ranks, tmp_path):
    results = run_suite(ranks, tmp_path)
    mpi_only = [r["test"] for r in results
                if r["outcome"] == "skipped" and r["reason"].startswith(MPI_ONLY)]
    extra = run_suite(ranks, tmp_path, mpi_only, gates_as="mpi") if mpi_only else []
    summary = summarize(ranks, results, extra)
    print(f"torch's distributed suite at {ranks} ranks: {summary['passed']} passed, "
          f"{summary['failed']} failed, {summary['skipped']} skipped; with MPI's gates "
          f"{summary['passed_with_mpi_gates']} of {len(extra)} more passed")
    assert summary["passed"] >= 50, summary   # the suite ran, not just its skips
    assert len(extra) == 0 or summary["passed_with_mpi_gates"] > 0, extra
    assert not summary["failures"], json.dumps(summary["failures"], indent=1)


# The suite's tests that stay torch's gloo's alone with gloo's gates: torch's
# front end refuses monitored_barrier for every other backend, and
# test_get_backend compares the group's name with the gates' "gloo".
GLOO_ONLY = {
    "test_get_backend": "compares the backend's name with 'gloo'",
    "test_monitored_barrier_gloo": "torch implements monitored_barrier for gloo only",
    "test_monitored_barrier_gloo_rank_0_timeout": "torch implements monitored_barrier for gloo "
                                                  "only",
    "test_monitored_barrier_gloo_subgroup": "torch implements monitored_barrier for gloo only",
}


def test_torch_distributed_suite_with_gloos_gates(tmp_path):
    """The suite with the skip gates torch applies to gloo, at 3 ranks: the
    tests torch runs on gloo alone (sparse all_reduce, timeouts a program
    catches) pass too, except GLOO_ONLY's. Run with MPIDP_ON_TIMEOUT=raise,
    the setting that gives a torch.distributed program gloo's contract for
    timeouts (an exception it can catch; docs/torch-distributed.md)."""
    results = run_suite(3, tmp_path, gates_as="gloo", MPIDP_ON_TIMEOUT="raise")
    outcomes = collections.Counter(r["outcome"] for r in results)
    failed = {r["test"]: r["reason"] for r in results if r["outcome"] in ("failed", "mixed")}
    print(f"torch's distributed suite with gloo's gates at 3 ranks: {dict(outcomes)}")
    assert outcomes["passed"] >= 80, outcomes
    assert set(failed) <= set(GLOO_ONLY), json.dumps(failed, indent=1)
    assert "test_sparse_all_reduce_sum" in {r["test"] for r in results
                                            if r["outcome"] == "passed"}
