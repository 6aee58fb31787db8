"""MPI start-up: import mpi4py, load the C extension, check they share one MPI,
and turn user-facing communicator arguments into mpidp's own duplicates."""

from __future__ import annotations

import atexit
import os
import sys
import weakref

from mpi4py import MPI  # initialises MPI (thread level MULTIPLE by default)

from .. import _C
from . import config
from .launch import check_launch

__all__ = ["MPI", "Communicator", "communicator", "resolve_comm", "as_mpi4py", "world",
           "world_mpi", "mpi_library_version"]


def _implementation(version: str) -> str:
    """'Open MPI v4.1' or 'MPICH 4.2' style family + major.minor of a version string."""
    v = version.strip()
    for family, marker in (("Open MPI", "Open MPI v"), ("MPICH", "MPICH Version:"),
                           ("Intel MPI", "Intel(R) MPI Library")):
        if v.startswith(marker):
            rest = v[len(marker):].strip().split()[0] if v[len(marker):].strip() else ""
            return f"{family} {'.'.join(rest.rstrip(',').split('.')[:2])}"
    return v.splitlines()[0] if v else "unknown"


def _check_same_mpi() -> None:
    ours = _C.mpi_library_version()
    theirs = MPI.Get_library_version()
    headers = _C.mpi_header_version()
    if ours.strip() != theirs.strip():
        raise ImportError(
            "mpidp and mpi4py run on different MPI libraries in this process, which cannot "
            f"work:\n  mpidp._C: {ours.splitlines()[0]}\n  mpi4py:   {theirs.splitlines()[0]}\n"
            "Rebuild mpi4py against the MPI that mpidp was built with: "
            "MPICC=$(which mpicc) pip install --force-reinstall --no-binary=mpi4py mpi4py")
    if _implementation(headers) != _implementation(ours):
        raise ImportError(
            f"mpidp was compiled against {headers} headers but runs on "
            f"{ours.splitlines()[0]}: rebuild mpidp with this MPI's mpicc "
            "(pip install --force-reinstall --no-build-isolation mpidp).")


_check_same_mpi()

# Open MPI 4.1 picks a binomial tree (reduce, then broadcast) for an in-place
# MPI_Iallreduce, which every mpidp allreduce is: each rank's bytes cross the
# network twice. Rabenseifner's reduce-scatter + allgather halved the time of
# a 4-rank gradient allreduce here (26.5 -> 12.8 s/epoch over a 1 Gbit/s link,
# benchmarks/bench_daso.py), took 2.7 ms where the tree took 5.6-6.6 for 11 MB
# at 2 ranks, and is never far from the best above ~256 KiB
# (benchmarks/bench_allreduce.py). Set through MPI's tool interface, so it
# holds whether or not the program imported mpi4py.MPI first; a value the user
# set (in the environment, where mpirun --mca puts it too; 0 restores Open
# MPI's choice) wins. Every rank imports mpidp, so every rank agrees.
if "OMPI_MCA_coll_libnbc_iallreduce_algorithm" not in os.environ:
    _C.iallreduce_algorithm(3)


def _read_env_settings() -> None:
    # MPIDP_HOOK_PROGRESS is a diagnostic switch: 0 stops the gradient hooks
    # from driving MPI progress.
    _C.configure(timeout=config.get("MPIDP_TIMEOUT"),
                 abort_on_timeout=config.get("MPIDP_ON_TIMEOUT") == "abort",
                 hook_progress=config.get("MPIDP_HOOK_PROGRESS"),
                 departure_grace=config.get("MPIDP_DEPARTURE_GRACE"))
    # Unset, the extension chose the spin from MPI's own word on whether the
    # node's ranks share its cores (mpidp/reqtable.h).
    spin_ms = config.get("MPIDP_WAIT_SPIN_MS")
    if spin_ms is not None:
        _C.configure(wait_spin=spin_ms / 1000.0)


_read_env_settings()

_forked = False


def _after_fork_in_child() -> None:
    """A child forked from this rank must not touch MPI (its collectives would
    mismatch or hang the parent's job): every later communication raises."""
    global _forked
    _forked = True
    _C.configure(forked=True)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _abort_at_exit(why: str) -> None:
    sys.stderr.write(f"mpidp: rank {MPI.COMM_WORLD.Get_rank()} is exiting {why}; another rank "
                     "is stuck or gone, so MPI_Finalize would wait forever: aborting the job\n")
    sys.stderr.flush()
    _C.abort_job(3)


def _at_exit() -> None:
    """Lands every pending request while MPI and the buffers still exist,
    then tells the other ranks that this one has ended (mpidp/departures.h):
    a rank that leaves early (sys.exit or SystemExit on one rank) would
    otherwise sit in MPI_Finalize, which waits for every rank, while the
    others wait for it in their next collective until the deadline; told,
    their waits end the job within MPIDP_DEPARTURE_GRACE, naming this rank.

    After a CommTimeout that the program caught (MPIDP_ON_TIMEOUT=raise), some
    rank is stuck or gone: waiting again, and MPI_Finalize (which waits for
    every rank), would hang the job, so the job is ended here instead."""
    if _forked:
        return
    several = MPI.COMM_WORLD.Get_size() > 1
    if _C.process_state()["timed_out"] and several:
        _abort_at_exit("after a communication timeout or a rank that ended (CommTimeout, "
                       "CommError)")
    try:
        _C.finish_pending()
    except (_C.CommError, _C.CommTimeout) as error:
        if not several:
            raise
        _abort_at_exit(f"with communication that cannot complete ({error})")
    _C.departures_announce()


# mpi4py registered MPI_Finalize with atexit when it was imported; handlers run
# last-in first-out, so this one runs first.
atexit.register(_at_exit)



def _install_abort_on_uncaught_exception() -> None:
    """An uncaught exception on one rank must end the whole job.

    Otherwise the failing rank blocks in MPI_Finalize (which waits for every
    rank) while the others wait forever in their next collective. Set
    MPIDP_ABORT_ON_EXCEPTION=0 to keep Python's plain behaviour."""
    # (A replacement that recover(replace=True) spawned is alone in its
    # MPI.COMM_WORLD, but not in its job.)
    alone = MPI.COMM_WORLD.Get_size() == 1 and MPI.Comm.Get_parent() == MPI.COMM_NULL
    if alone or not config.get("MPIDP_ABORT_ON_EXCEPTION"):
        return
    previous = sys.excepthook

    def abort_job(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        # A hook installed after this one may have swapped stderr for a
        # buffer it prints once this hook returns (torch.distributed's
        # init_process_group does, to prefix "[rankN]"); this hook never
        # returns, so the traceback is printed from that buffer here.
        captured = sys.stderr
        if captured is not sys.__stderr__ and hasattr(captured, "getvalue"):
            sys.__stderr__.write(captured.getvalue())
        sys.__stderr__.write(f"mpidp: uncaught {exc_type.__name__} on rank "
                             f"{_world_mpi.Get_rank()} of {_world_mpi.Get_size()}: "
                             "aborting the job so that no rank is left waiting\n")
        sys.__stderr__.flush()
        _C.abort_job(1)

    sys.excepthook = abort_job


_install_abort_on_uncaught_exception()

# mpidp's duplicate of each user communicator, by its MPI handle (py2f:
# mpi4py communicators are not hashable), with a weak reference to the
# mpi4py object it was made for: an entry serves only that object, so a
# handle MPI reuses after a Free, or another object wrapping the same
# handle, gets a duplicate of its own.
_duplicates: "dict[int, tuple[weakref.ref, _C.Comm]]" = {}
_world: _C.Comm | None = None
# The job's ranks: MPI.COMM_WORLD, or in fault-tolerant mode, after ranks
# were lost, the survivors' communicator (mpidp/fault_tolerance/recovery.py).
_world_mpi: MPI.Intracomm = MPI.COMM_WORLD


def world_mpi() -> MPI.Intracomm:
    """The mpi4py communicator of every rank of the job still running
    (MPI.COMM_WORLD until fault-tolerant mode shrinks it)."""
    return _world_mpi


# Set by fault_tolerance.enable(); every rank must agree (_refuse_mixed_modes).
fault_tolerant = False
# Called once each world exists (fault_tolerance makes its agreement
# communicator there, where every rank is).
on_new_world: list = []


def _refuse_mixed_modes() -> None:
    """A rank in fault-tolerant mode agrees at every step's end; one that is
    not would leave it waiting forever (an agreement has no deadline)."""
    modes = _world_mpi.allgather(fault_tolerant)
    if len(set(modes)) > 1:
        on = [r for r, m in enumerate(modes) if m]
        off = [r for r, m in enumerate(modes) if not m]
        raise RuntimeError(f"fault-tolerant mode is on on rank(s) {on} and off on rank(s) {off}: "
                           "set MPIDP_FAULT_TOLERANCE (or call mpidp.enable_fault_tolerance()) "
                           "on every rank alike")


def world() -> _C.Comm:
    """mpidp's duplicate of world_mpi() (created once per world)."""
    global _world
    if _world is None:
        if _world_mpi is MPI.COMM_WORLD:   # a world that lost ranks is smaller than launched
            check_launch(_world_mpi.Get_size())
        _world = _C.Comm(_world_mpi)
        if _world.size > 1:
            _refuse_mixed_modes()
        for hook in on_new_world:
            hook()
        # Ranks that end their program are listened for over the first world;
        # under fault tolerance MPI itself reports them (ULFM).
        if _world.size > 1 and _world_mpi is MPI.COMM_WORLD and not _C.ft_support()[1]:
            _C.departures_start(_world)   # every rank is here: creating _world was collective
    return _world


def is_world(comm) -> bool:
    """Whether `comm` (mpidp's duplicate) is the world's, without making the
    world's (a collective of every rank of the job, which a group's ranks
    alone must not start)."""
    return comm is not None and comm is _world


def replace_world(survivors: MPI.Intracomm) -> None:
    """Fault-tolerant mode: the survivors' communicator becomes the world
    that MPI.COMM_WORLD (and None) stand for in every mpidp call."""
    global _world, _world_mpi
    _world_mpi, _world = revocable(survivors), None
    _duplicates.clear()
    _C.ft_set_job_comm(survivors.py2f())     # what a deadline's abort ends: every rank of it


# Fault-tolerant mode: the mpi4py communicators mpidp made from the world
# (the world itself, topology's splits, the algorithms' node groups). A rank
# that goes to recovery revokes them with the core's own duplicates, so that
# no survivor is left waiting in a call on one of them (mpidp/fault_tolerance/__init__.py, the rule).
# (Weakly held: a communicator the program dropped needs no revoking. mpi4py's
# communicators are not hashable, hence a list.)
_revocable: "list[weakref.ref]" = []


def revocable(comm):
    """`comm`, revoked with the core's communicators when a rank goes to
    recovery (fault-tolerant mode; nothing otherwise)."""
    if fault_tolerant and comm is not None and comm != MPI.COMM_NULL:
        _revocable[:] = [r for r in _revocable if r() is not None] + [weakref.ref(comm)]
    return comm


def revoke_revocable() -> None:
    """Revoke every communicator revocable() was given that is still live."""
    for comm in [r() for r in _revocable]:
        try:
            if comm is not None and comm != MPI.COMM_NULL and not comm.Is_revoked():
                comm.Revoke()
        except MPI.Exception:
            pass    # freed or already unusable: nobody can wait on it


class Communicator:
    """A communicator argument, checked once: `.c` is mpidp's duplicate (what
    the core's engines run on), `.mpi` the mpi4py communicator behind it
    (for splits and topology; None for a duplicate whose source is unknown).
    `.key` names the MPI communicator itself: algorithms given the same
    communicator compete for a module, algorithms given different ones
    compose (mpidp/algorithms/driver.py)."""

    __slots__ = ("c", "mpi")

    def __init__(self, c: _C.Comm, mpi: MPI.Intracomm):
        self.c, self.mpi = c, mpi

    @property
    def key(self):
        return None if self.mpi is None else self.mpi.py2f()


# mpi4py communicator of each duplicate that came from one (a _C.Comm passed
# back in as a `comm` argument keeps its source; _C.Comm takes no weak
# references, hence the id, dropped with the duplicate's cache entry).
_source_of: "dict[int, MPI.Intracomm]" = {}


def communicator(comm, argname: str = "comm") -> Communicator:
    """The one check of a communicator argument: an mpi4py intra-communicator,
    Heat's communicator wrapper (anything with an mpi4py `.handle`), a
    duplicate mpidp made, or None for COMM_WORLD.

    Duplicates are cached per communicator object: MPI_Comm_dup is collective,
    so creating one per call would cost a synchronisation every time."""
    if comm is None or comm is MPI.COMM_WORLD or comm is _world_mpi:
        return Communicator(world(), _world_mpi)
    if isinstance(comm, _C.Comm):
        return Communicator(comm, _source_of.get(id(comm), _world_mpi if comm is _world else None))
    handle = getattr(comm, "handle", None)
    if not isinstance(comm, MPI.Comm) and isinstance(handle, MPI.Comm):
        comm = handle  # Heat's MPICommunication
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"{argname}: expected an mpi4py communicator (e.g. MPI.COMM_WORLD) or an "
                        f"object with an mpi4py .handle, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError(f"{argname}: the communicator is MPI.COMM_NULL")
    if not isinstance(comm, MPI.Intracomm) or comm.Is_inter():
        raise TypeError(f"{argname}: expected an intra-communicator, got an inter-communicator")
    handle = comm.py2f()
    source, cached = _duplicates.get(handle, (None, None))
    if source is None or source() is not comm:
        cached = _C.Comm(comm)
        _duplicates[handle] = (weakref.ref(comm), cached)
        _source_of[id(cached)] = comm
        weakref.finalize(comm, _forget_duplicate, handle, cached)
    return Communicator(cached, comm)


def _forget_duplicate(handle: int, duplicate: _C.Comm) -> None:
    """The mpi4py communicator `duplicate` was made for is gone: so is its
    cache entry (unless a newer object's took the handle's place)."""
    _source_of.pop(id(duplicate), None)
    if _duplicates.get(handle, (None, None))[1] is duplicate:
        del _duplicates[handle]


def resolve_comm(comm, argname: str = "comm") -> _C.Comm:
    """communicator(comm, argname).c: mpidp's duplicate, for the engines."""
    return communicator(comm, argname).c


def as_mpi4py(comm, argname: str = "comm") -> MPI.Intracomm:
    """communicator(comm, argname).mpi: the mpi4py communicator behind it."""
    mpi = communicator(comm, argname).mpi
    if mpi is None:
        raise TypeError(f"{argname}: expected an mpi4py communicator here (this one is an mpidp "
                        "duplicate whose source is unknown)")
    return mpi


def mpi_library_version() -> str:
    """The MPI library this process runs on (MPI_Get_library_version)."""
    return _C.mpi_library_version()
