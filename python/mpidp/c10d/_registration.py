"""The "mpidp" backend's registration and group creation, and the
rendezvous that needs no MASTER_ADDR under an MPI launcher.

Groups are MPI communicators: the default group is MPI.COMM_WORLD (or the
communicator given to mpidp.init_process_group), and a subgroup of it --
dist.new_group, new_subgroups, a DeviceMesh's dimensions -- is made by
MPI_Comm_create_group over its members only (torch calls the creator on
members only). torch hands every creator a store; the backend never uses
it."""

from __future__ import annotations

import importlib
import os
import zlib

import torch
import torch.distributed as dist

from .. import _C
from .._runtime import config, fault_tolerant_groups, fault_tolerant_mode
from .._runtime import mpi as _mpi
from .._runtime.mpi import MPI, revocable
from ..collectives.process_groups import groups, store_for_mpidp_only
from ._process_group import ProcessGroupMPIDP

NAME = "mpidp"

# The module, not the function torch.distributed exports under the same name.
_rendezvous = importlib.import_module("torch.distributed.rendezvous")

try:     # built beside the gradient hook wherever torch was importable at build time
    from .. import _c10d
except ImportError:
    _c10d = None


def _create(opts, pg_options=None) -> dist.ProcessGroup:
    members = list(opts.global_ranks_in_group)
    if not members or not dist.is_initialized():   # the default group
        comm = _default_comm()
        if groups.first_made_by_mpidp is None:     # torch's own dist.init_process_group
            groups.first_made_by_mpidp = groups.next_default is not None
        groups.next_default = None
        if comm.Get_size() != opts.group_size or comm.Get_rank() != opts.group_rank:
            raise ValueError(
                f"init_process_group('mpidp'): rank {opts.group_rank} of {opts.group_size} was "
                f"asked for, but MPI made this process rank {comm.Get_rank()} of "
                f"{comm.Get_size()}: leave rank and world_size out (MPI knows them), or pass the "
                "communicator to mpidp.init_process_group(comm=...)")
        if _mpi.fault_tolerant:
            _enter_fault_tolerant_mode(comm)
        groups.default_source = comm
        groups.default = revocable(comm.Dup())
        return _group(groups.default, opts.timeout, None)
    parent = _parent_comm()
    group = parent.Get_group().Incl(members)
    # Members only take part; a tag from the group's name keeps two groups
    # made at once with overlapping members apart.
    tag = zlib.crc32(str(opts.group_id).encode()) % 32768
    comm = revocable(parent.Create_group(group, tag))
    group.Free()
    if comm.Get_rank() != opts.group_rank:
        raise RuntimeError(f"mpidp backend: group rank {comm.Get_rank()} from MPI, "
                           f"{opts.group_rank} from torch, for ranks {members}")
    return _group(comm, opts.timeout, members)


def _group(comm, timeout, members):
    """The group over `comm`: torch's ProcessGroup over the C++ backend
    (below), or the Python group alone."""
    backend = backend_over(comm, timeout, members)
    return backend if isinstance(backend, ProcessGroupMPIDP) else _c10d.GroupMPIDP(backend)


def backend_over(comm, timeout, members):
    """The backend over `comm` (collective over it): the C++ backend
    (mpidp._c10d) in front of the Python ProcessGroupMPIDP, which runs the
    common calls itself and hands it the rest; the Python group alone with
    MPIDP_C10D_IMPL=python or where mpidp was built without torch."""
    group = ProcessGroupMPIDP(comm, timeout, members)
    cpp = config.get("MPIDP_C10D_IMPL") == "cpp" and _c10d is not None
    _refuse_different_settings(group, cpp)
    if not cpp:
        return group
    return _c10d.BackendMPIDP(group.core_comm, group, group.timeout_s, group.checks,
                              comm.Get_rank(), comm.Get_size(),
                              host_fast_path=config.get("MPIDP_C10D_DEVICE_COMM") != "standin",
                              global_ranks=list(members) if members else [])


_SETTINGS = ("MPIDP_C10D_IMPL (cpp, or python: set so, or a build without torch)",
             "MPIDP_C10D_CHECK", "MPIDP_C10D_DEVICE_COMM")
_DEVICE_COMMS = ("auto", "nccl", "mpi", "staging", "standin")


def _refuse_different_settings(group: ProcessGroupMPIDP, cpp: bool) -> None:
    """Collective, once per group: the ranks run the same implementation
    with the same check. A rank that checks would otherwise pair its
    agreement with another rank's data collective (MPI matches collectives
    by order alone): wrong bytes or a hang instead of an error."""
    c = group.core_comm
    if c.size == 1:
        return
    table = torch.zeros(c.size, len(_SETTINGS), dtype=torch.float64)
    device_comm = _DEVICE_COMMS.index(config.get("MPIDP_C10D_DEVICE_COMM"))
    table[c.rank] = torch.tensor([float(cpp), float(group.checks), float(device_comm)],
                                 dtype=torch.float64)
    c.allreduce(table, _C.OP_SUM, _C.NO_WIRE, False)
    for col, name in enumerate(_SETTINGS):
        differ = [r for r in range(c.size) if table[r, col] != table[0, col]]
        if differ:
            raise ValueError(
                f"mpidp backend: {name} differs across the group's ranks: rank(s) {differ} "
                f"of the group do not match its rank 0, so their collectives would pair up "
                "wrongly; set it the same on every rank")


def _enter_fault_tolerant_mode(comm) -> None:
    """Fault-tolerant mode: a default group over the job's ranks joins the
    job's agreement (mpidp's world, made here if the program used nothing
    else of mpidp, so that recover() finds it); one over a worker group's
    communicator (mpidp.init_process_group(comm=worker)) makes that a group
    (mpidp/_runtime/fault_tolerant_groups.py), which recover(comm=worker)
    recovers alone."""
    world = _mpi.world_mpi()
    # SIMILAR: the job's ranks in another order (a recipe that orders them by
    # their places, keep_whole_groups): still the job's, recovered with it.
    if MPI.Comm.Compare(comm, world) in (MPI.IDENT, MPI.CONGRUENT, MPI.SIMILAR):
        _mpi.world()
    elif comm is MPI.COMM_WORLD:
        raise ValueError(
            "init_process_group('mpidp'): the job lost ranks, and MPI.COMM_WORLD still holds "
            f"them ({comm.Get_size()} ranks, {world.Get_size()} alive): make the group over "
            "the survivors (mpidp.init_process_group(comm=mpidp.fault_tolerance.world_comm()))")
    else:
        fault_tolerant_groups.join(comm)


def _parent_comm():
    """The communicator whose ranks are torch's default group's: the "mpidp"
    default group's, else the one mpidp.init_process_group made a gloo or
    NCCL default group from, else MPI.COMM_WORLD when torch's ranks are its
    ranks (an "mpidp" subgroup beside a gloo default group)."""
    if groups.default is not None and dist.get_backend() == NAME:
        return groups.default
    if groups.other_default is not None:
        return groups.other_default
    world = MPI.COMM_WORLD
    if dist.get_world_size() != world.Get_size() or dist.get_rank() != world.Get_rank():
        raise RuntimeError(
            f"mpidp backend: torch's default group (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}) is not MPI's world (rank {world.Get_rank()} of "
            f"{world.Get_size()}), so its ranks cannot be found in MPI: make the default group "
            "with mpidp.init_process_group(comm=...)")
    return world


_torch_env_handler = None


def _default_comm():
    """The ranks of a default group made without mpidp.init_process_group:
    the job's. (A replacement's MPI.COMM_WORLD is its own spawn; the job is
    mpidp's world, which it joined.)"""
    if groups.next_default is not None:
        return groups.next_default
    return _mpi.world_mpi() if fault_tolerant_mode.is_replacement() else MPI.COMM_WORLD


def _env_rendezvous(url: str, timeout=None, **kwargs):
    """torch's env:// rendezvous where MASTER_ADDR is set (with the rank and
    world size from MPI where RANK and WORLD_SIZE are not); otherwise the
    rank and world size come from MPI (mpirun, srun, or one process alone)
    and the store is one that only the "mpidp" backend can do without."""
    comm = _default_comm()
    if "MASTER_ADDR" in os.environ:
        os.environ.setdefault("RANK", str(comm.Get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(comm.Get_size()))
        yield from _torch_env_handler(url, timeout=timeout, **kwargs)
        return
    yield (store_for_mpidp_only(), comm.Get_rank(), comm.Get_size())
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


def register() -> None:
    """Registers the backend (once) and the MPI-aware env:// rendezvous."""
    global _torch_env_handler
    if not hasattr(dist.Backend, NAME.upper()):
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    handlers = _rendezvous._rendezvous_handlers
    if _torch_env_handler is None and handlers.get("env") is not _env_rendezvous:
        _torch_env_handler = handlers["env"]
        handlers["env"] = _env_rendezvous
