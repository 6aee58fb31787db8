"""The deadline on every wait of fault-tolerant mode that MPI cannot
interrupt (its agreement, its shrink, the rebuild's collectives)."""

from __future__ import annotations

import contextlib
import sys
import threading

from .. import _C
from . import config
from . import mpi as _mpi


@contextlib.contextmanager
def deadline(what: str, seconds: float | None = None, caller: str = "recover()",
             hint: str = "a survivor is not taking part (stuck, or never called "
                         "mpidp.recover())"):
    """A wait of fault-tolerant mode that outlives `seconds` (MPIDP_TIMEOUT)
    ends the job with a message naming `caller`, `what` and `hint`: MPI's
    agreement, shrink and the rebuild's collectives wait for every survivor,
    cannot be interrupted, and one survivor that never comes (stuck
    elsewhere, a bug) would hold the others forever."""
    limit = float(config.get("MPIDP_TIMEOUT")) if seconds is None else float(seconds)
    source = "MPIDP_TIMEOUT" if seconds is None else "the group's timeout"
    rank = _mpi.world_mpi().Get_rank()

    def expire():
        sys.stderr.write(f"mpidp: {caller} on rank {rank}: {what} took longer than "
                         f"{source} ({limit:g} s); {hint}: aborting the job\n")
        sys.stderr.flush()
        _C.abort_job(4)

    timer = threading.Timer(limit, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
