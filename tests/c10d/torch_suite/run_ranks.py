"""Runs torch's own distributed test suite (the torch wheel's
torch/testing/_internal/distributed/distributed_test.py,
`DistributedTest._DistTestBase`) on the "mpidp" backend, inside the ranks of
one mpirun job:

    mpirun -np N python tests/c10d/torch_suite/run_ranks.py --out results.jsonl [NAME ...]

torch runs that suite by spawning one process per rank per test, each
calling init_process_group with a file store. Here the ranks are MPI's:
every rank imports the suite with BACKEND=mpidp (registered as a "plugin"
backend, with the DDP and subgroup features; --gates-as mpi shows the
suite's gates the name of torch's own MPI backend instead), calls
`dist.init_process_group("mpidp")` once, and runs the test methods one after
another (NAMEs, default: all), meeting at an MPI barrier between tests
instead of the suite's file barrier. After each test the ranks exchange
their outcomes (passed, failed, skipped, with the reason) and rank 0 appends
one JSON line to --out; before each test it writes a "started" line, so
that a driver (tests/c10d/test_torch_distributed_suite.py) that sees the job end
mid-test knows which test ended it and can start the rest in a new job.

A skip's reason is unittest's, or the one behind the exit code torch's
decorators use to skip a spawned process (common_distributed.TEST_SKIPS)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
import unittest

import mpidp  # noqa: F401  (registers the backend)
from mpidp import MPI

COMM = MPI.COMM_WORLD


def prepare_environment(gates_as: str) -> str:
    """The variables the suite reads at import (BACKEND: the name its skip
    gates compare with); a temporary directory (the suite's files) shared by
    the ranks of this machine."""
    tmp = tempfile.mkdtemp(prefix="mpidp-torch-suite-") if COMM.rank == 0 else None
    tmp = COMM.bcast(tmp)
    if COMM.rank == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(tmp, sub))
    COMM.Barrier()
    os.environ.update(BACKEND=gates_as, WORLD_SIZE=str(COMM.size), RANK=str(COMM.rank),
                      TEMP_DIR=tmp, INIT_METHOD="env://")
    return tmp


def load_suite():
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import TEST_SKIPS, DistTestCases
    from torch.testing._internal.common_utils import TestCase
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("mpidp")
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    skip_reasons = {s.exit_code: s.message for s in TEST_SKIPS.values()}

    class OnMPIDP(DistributedTest._DistTestBase, TestCase):
        rank = COMM.rank
        world_size = str(COMM.size)
        file_name = None
        destroy_pg_upon_exit = False

        def _barrier(self, *args, **kwargs):
            # The suite's barrier polls files; the ranks are MPI's.
            COMM.Barrier()

    names = sorted(n for n in dir(OnMPIDP) if n.startswith("test_"))
    return dist, OnMPIDP, names, skip_reasons


def outcome_of(result: unittest.TestResult, skip_reasons: dict) -> tuple[str, str]:
    """("passed" | "skipped" | "failed", reason) of one test on this rank."""
    if result.skipped:
        return "skipped", str(result.skipped[0][1])
    problems = result.failures + result.errors
    if problems:
        lines = problems[0][1].strip().splitlines()
        # The exception's line (torch's TestCase appends how to rerun the test).
        last = next((line for line in reversed(lines)
                     if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b", line)), lines[-1])
        if last.startswith("SystemExit: "):   # torch's spawn-level skip: sys.exit(code)
            code = last.split(": ", 1)[1].strip()
            if code.isdigit() and int(code) in skip_reasons:
                return "skipped", skip_reasons[int(code)]
        return "failed", last[:500]
    return "passed", ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON-lines file rank 0 appends to")
    parser.add_argument("--gates-as", default="mpidp",
                        help="the backend name the suite's skip gates see (the group is "
                             "'mpidp' whatever it is): 'mpi' runs the tests torch keeps for "
                             "its in-tree MPI backend (CPU all_to_all)")
    parser.add_argument("names", nargs="*", help="test methods to run (default: all)")
    args = parser.parse_args()
    prepare_environment(args.gates_as)
    dist, suite, names, skip_reasons = load_suite()
    wanted = args.names or names
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise SystemExit(f"names: not in the suite: {unknown[:5]}")
    out = open(args.out, "a") if COMM.rank == 0 else None

    def record(line: dict):
        if out is not None:
            out.write(json.dumps(line) + "\n")
            out.flush()

    for name in wanted:
        if not dist.is_initialized():    # a test may destroy the default group
            dist.init_process_group("mpidp")
        COMM.Barrier()
        record({"started": name})
        t0 = time.perf_counter()
        result = unittest.TestResult()
        try:
            suite(name).run(result)
            mine = outcome_of(result, skip_reasons)
        except BaseException:  # noqa: BLE001  (anything the runner itself hits)
            mine = ("failed", traceback.format_exc().strip().splitlines()[-1][:500])
        everyone = COMM.allgather(mine)
        kinds = {k for k, _ in everyone}
        verdict = "failed" if "failed" in kinds else "skipped" if kinds == {"skipped"} else (
            "passed" if kinds == {"passed"} else "mixed")
        reason = next((r for k, r in everyone if k == verdict), "") if verdict != "mixed" else \
            "; ".join(f"rank {i}: {k} {r}" for i, (k, r) in enumerate(everyone))
        record({"test": name, "outcome": verdict, "reason": reason,
                "seconds": round(time.perf_counter() - t0, 2)})
    COMM.Barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    # Every test ran. A test that caught a timeout (MPIDP_ON_TIMEOUT=raise)
    # left its call posted, so this job then ends at exit rather than wait
    # in MPI_Finalize: the driver takes this line as the job's end.
    record({"finished": len(wanted)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
