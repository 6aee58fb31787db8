"""pytest set-up shared by every test: the shared references in tests/support
on the import path, the `serial` marker and, in an MPI run, aborting the whole
job as soon as any rank fails a test (the other ranks would otherwise wait
forever in the next collective)."""

import os
import sys

import pytest

# The references and helpers every folder's tests import by name
# (dp_reference, mpi_jobs, ...).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

# mpidp first, as in the README: it initialises MPI (with its settings, see
# python/mpidp/_runtime/mpi.py) and its exit handling.
import mpidp  # noqa: F401
from mpi4py import MPI  # noqa: E402

# tests/fault_tolerance/ulfm kill ranks of jobs run under ULFM (Open MPI 5):
# they run in their own environment, scripts/test_fault_tolerance.sh (make
# pytest-ft).
collect_ignore = [] if os.environ.get("MPIDP_FT_TESTS") else ["fault_tolerance/ulfm"]

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "serial: runs only in the single-process pass of `make test` (the test "
                   "starts its own MPI jobs, or has nothing to do with several ranks)")
    config.addinivalue_line(
        "markers", "ranks3: also run at 3 ranks (a communicator size that is not a power of two)")


def pytest_report_header(config):
    return f"MPI: rank {RANK} of {SIZE}; {MPI.Get_library_version().splitlines()[0]}"


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.failed and SIZE > 1:
        sys.stderr.write(f"\n[rank {RANK}/{SIZE}] FAILED {report.nodeid} ({report.when}):\n"
                         f"{report.longreprtext}\n[rank {RANK}] aborting the MPI job\n")
        sys.stderr.flush()
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture(scope="module")
def horovod_dynamic():
    """mpidp.horovod started afresh with dynamic process sets, for a module."""
    import mpidp.horovod as hvd
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    yield
    hvd.shutdown()
