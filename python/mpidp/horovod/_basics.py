"""Horovod's lifecycle and rank queries over mpidp: init / shutdown,
rank / size / local_* / cross_*, the capability queries, process sets.

Horovod's world is the communicator given to init() (default: every rank);
local_* count the ranks of this node within it, cross_* the ranks with this
rank's local rank (one per node). Each process set is an MPI communicator
of its ranks, on which its collectives run (mpidp.horovod._controller)."""

from __future__ import annotations

import os
from typing import List, Optional

import torch

from .._runtime import mpi as _mpi
from .._runtime.mpi import MPI
from .._runtime.topology import split_by_node

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported",
           "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
           "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set",
           "add_process_set", "remove_process_set", "HorovodInternalError",
           "HostsUpdatedInterrupt"]


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's name): mismatched tensors across ranks,
    a lost rank, a deadline passed. hvd.elastic.run recovers from those
    caused by a lost rank."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that hosts were added or removed; mpidp's elastic mode
    only loses ranks (ULFM) and raises HorovodInternalError for that."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class _World:
    comm: Optional[MPI.Intracomm] = None       # Horovod's world (init's comm)
    local: Optional[MPI.Intracomm] = None      # this node's ranks of it
    cross: Optional[MPI.Intracomm] = None      # the ranks with this local rank
    dynamic = False                            # add/remove_process_set allowed
    sets: dict = {}                            # id -> registered ProcessSet
    next_id = 1
    on_shutdown: list = []                     # callbacks (controller, timeline)
    on_init: list = []                         # callbacks (timeline: HOROVOD_TIMELINE)


_world = _World()


def _need_init():
    if _world.comm is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _world.comm


class ProcessSet:
    """The ranks that run a collective together (Horovod's ProcessSet):
    `ProcessSet([0, 2])` (ranks of the world) or `ProcessSet(mpi4py_comm)`.
    Register it with hvd.init(process_sets=[...]) or hvd.add_process_set();
    then `process_set_id` is set and the ops accept it as process_set=."""

    def __init__(self, ranks_or_comm):
        self.process_set_id: Optional[int] = None
        self.mpi_comm: Optional[MPI.Intracomm] = None   # this rank's; None: not a member
        if isinstance(ranks_or_comm, MPI.Comm):
            self._source_comm = ranks_or_comm
            self.ranks: Optional[List[int]] = None
            return
        try:
            ranks = [int(r) for r in ranks_or_comm]
        except TypeError:
            raise TypeError("ranks_or_comm: expected a list of ranks or an mpi4py communicator, "
                            f"got {type(ranks_or_comm).__name__}") from None
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"ranks_or_comm: expected distinct ranks, got {ranks!r}")
        self._source_comm = None
        self.ranks = sorted(ranks)

    def _register(self, world: MPI.Intracomm, pid: int) -> None:
        if self._source_comm is not None:
            comm = self._source_comm
            members = world.allgather(comm.Get_rank() if comm != MPI.COMM_NULL else -1)
            self.ranks = [r for r, m in enumerate(members) if m >= 0]
            self.mpi_comm = comm.Dup() if comm != MPI.COMM_NULL else None
        else:
            bad = [r for r in self.ranks if not 0 <= r < world.Get_size()]
            if bad:
                raise ValueError(f"ProcessSet: ranks {bad} are not in the world of "
                                 f"{world.Get_size()} ranks")
            group = world.Get_group().Incl(self.ranks)
            comm = world.Create(group)
            group.Free()
            self.mpi_comm = None if comm == MPI.COMM_NULL else comm
        self.process_set_id = pid

    def _unregister(self) -> None:
        if self.mpi_comm is not None and self.process_set_id != 0:
            self.mpi_comm.Free()
        self.mpi_comm = None
        self.process_set_id = None

    def size(self) -> int:
        """The number of ranks in the set."""
        self._check_registered()
        return len(self.ranks)

    def rank(self) -> int:
        """This rank's index in the set (ValueError where it is no member)."""
        self._check_registered()
        if self.mpi_comm is None:
            raise ValueError(f"ProcessSet {self.process_set_id}: this rank ({rank()}) is not in "
                             f"it (ranks {self.ranks})")
        return self.mpi_comm.Get_rank()

    def included(self) -> bool:
        """Whether this rank is in the set."""
        self._check_registered()
        return self.mpi_comm is not None

    def _check_registered(self) -> None:
        if self.process_set_id is None:
            raise ValueError("ProcessSet: not registered; pass it to hvd.init(process_sets=...) "
                             "or hvd.add_process_set() first")

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([0])   # its ranks and communicator are set by init()


def init(comm=None, process_sets=None) -> None:
    """Start Horovod over MPI (collective over the ranks of `comm`).

    comm: None (every rank), a list of world ranks, or an mpi4py
    communicator (duplicated). process_sets: ProcessSets to register now
    (every rank passes the same), or "dynamic" to allow add_process_set /
    remove_process_set later (also HOROVOD_DYNAMIC_PROCESS_SETS=1). A second
    init() without shutdown() does nothing, as in Horovod."""
    if _world.comm is not None:
        return
    world = _mpi.world_mpi()
    if comm is None:
        mine = world.Dup()
    elif isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_NULL:
            raise ValueError("comm: the communicator is MPI.COMM_NULL")
        mine = comm.Dup()
    else:
        try:
            ranks = sorted(int(r) for r in comm)
        except TypeError:
            raise TypeError("comm: expected None, a list of ranks or an mpi4py communicator, got "
                            f"{type(comm).__name__}") from None
        group = world.Get_group().Incl(ranks)
        mine = world.Create(group)
        group.Free()
        if mine == MPI.COMM_NULL:
            raise ValueError(f"comm: this rank ({world.Get_rank()}) is not in the ranks {ranks} "
                             "given to hvd.init()")
    dynamic = process_sets == "dynamic" or os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1"
    if process_sets is not None and process_sets != "dynamic":
        if isinstance(process_sets, ProcessSet) or not all(
                isinstance(p, ProcessSet) for p in process_sets):
            raise TypeError("process_sets: expected a list of hvd.ProcessSet or \"dynamic\"")
    _world.comm = mine
    _world.local = split_by_node(mine)   # MPIDP_RANKS_PER_NODE counts too (tests)
    _world.cross = mine.Split(_world.local.Get_rank(), mine.Get_rank())
    _world.dynamic = dynamic
    global_process_set.ranks = list(range(mine.Get_size()))
    global_process_set.mpi_comm = mine
    global_process_set.process_set_id = 0
    global_process_set._source_comm = None
    _world.sets = {0: global_process_set}
    _world.next_id = 1
    for ps in (process_sets if isinstance(process_sets, (list, tuple)) else ()):
        _add(ps)
    # Registered by the modules above this one (imports run one way).
    for callback in list(_world.on_init):
        callback()


def shutdown() -> None:
    """End Horovod: pending operations fail, process sets are freed; init()
    may be called again."""
    if _world.comm is None:
        return
    for callback in list(_world.on_shutdown):
        callback()
    for pid, ps in list(_world.sets.items()):
        ps._unregister()
    _world.cross.Free()
    _world.local.Free()
    _world.comm.Free()
    _world.comm = _world.local = _world.cross = None
    _world.sets = {}


def is_initialized() -> bool:
    return _world.comm is not None


def size() -> int:
    """The number of Horovod ranks."""
    return _need_init().Get_size()


def rank() -> int:
    """This process's Horovod rank."""
    return _need_init().Get_rank()


def local_size() -> int:
    """The number of Horovod ranks on this node."""
    _need_init()
    return _world.local.Get_size()


def local_rank() -> int:
    """This rank's index among the Horovod ranks of its node."""
    _need_init()
    return _world.local.Get_rank()


def cross_size() -> int:
    """The number of nodes holding a rank with this rank's local rank."""
    _need_init()
    return _world.cross.Get_size()


def cross_rank() -> int:
    """This rank's node index among the ranks with its local rank."""
    _need_init()
    return _world.cross.Get_rank()


def is_homogeneous() -> bool:
    """Whether every node holds the same number of ranks."""
    _need_init()
    sizes = _world.comm.allgather(_world.local.Get_size())
    return len(set(sizes)) == 1


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE."""
    _need_init()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    """NCCL's version code (e.g. 22703) where torch carries NCCL, else 0:
    mpidp's device path uses torch's NCCL."""
    if torch.version.cuda is None:
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]
    except Exception:  # torch built without NCCL
        return 0
    return major * 10000 + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return torch.version.hip is not None


def _add(ps: ProcessSet) -> ProcessSet:
    if not isinstance(ps, ProcessSet):
        ps = ProcessSet(ps)
    if ps.process_set_id is not None:
        raise ValueError(f"process_set: {ps!r} is registered already")
    for other in _world.sets.values():
        if ps.ranks is not None and other.ranks == ps.ranks:
            raise ValueError(f"process_set: a process set with ranks {ps.ranks} exists already "
                             f"(id {other.process_set_id})")
    ps._register(_world.comm, _world.next_id)
    _world.sets[_world.next_id] = ps
    _world.next_id += 1
    return ps


def add_process_set(process_set) -> ProcessSet:
    """Register a ProcessSet (or a list of ranks) after init(); collective
    over every rank. Needs dynamic process sets (init(process_sets="dynamic")
    or HOROVOD_DYNAMIC_PROCESS_SETS=1). Returns the registered set."""
    _need_init()
    if not _world.dynamic:
        raise ValueError("add_process_set: dynamic process sets are off; call "
                         "hvd.init(process_sets=\"dynamic\") or set HOROVOD_DYNAMIC_PROCESS_SETS=1")
    if isinstance(process_set, ProcessSet) and process_set._source_comm is not None:
        raise ValueError("add_process_set: a process set made from a communicator can only be "
                         "registered by hvd.init(process_sets=[...])")
    return _add(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a ProcessSet (collective); False when it was not
    registered. The global set cannot be removed."""
    _need_init()
    if not _world.dynamic:
        raise ValueError("remove_process_set: dynamic process sets are off; call "
                         "hvd.init(process_sets=\"dynamic\") or set HOROVOD_DYNAMIC_PROCESS_SETS=1")
    pid = process_set.process_set_id
    if pid is None or pid == 0 or _world.sets.get(pid) is not process_set:
        return False
    _world.comm.Barrier()
    del _world.sets[pid]
    process_set._unregister()
    return True


def comm_of(process_set) -> Optional[MPI.Intracomm]:
    """The mpi4py communicator of a registered process set (None: this rank
    is no member), or a clear error."""
    _need_init()
    if process_set is None:
        process_set = global_process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set: expected a hvd.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None or \
            _world.sets.get(process_set.process_set_id) is not process_set:
        raise ValueError(f"process_set: {process_set!r} is not registered (hvd.add_process_set)")
    return process_set.mpi_comm
