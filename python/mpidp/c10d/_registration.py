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

import torch.distributed as dist

from .. import _mpi
from .._mpi import MPI, revocable
from ._process_group import ProcessGroupMPIDP

NAME = "mpidp"

# The module, not the function torch.distributed exports under the same name.
_rendezvous = importlib.import_module("torch.distributed.rendezvous")

# The communicator the next default group is made from (mpidp.init_process_group(comm=...)).
_next_default_comm = None
# The default group's communicator: subgroups' ranks are ranks of it.
_default_comm = None
# The communicator of a gloo or NCCL default group mpidp.init_process_group made.
_other_default_comm = None


def use_for_default_group(comm) -> None:
    """Makes the next default "mpidp" group from `comm` (None: MPI.COMM_WORLD)."""
    global _next_default_comm
    _next_default_comm = comm


def _create(opts, pg_options=None) -> ProcessGroupMPIDP:
    global _default_comm, _next_default_comm
    members = list(opts.global_ranks_in_group)
    if not members or not dist.is_initialized():   # the default group
        comm = _next_default_comm if _next_default_comm is not None else MPI.COMM_WORLD
        _next_default_comm = None
        if comm.Get_size() != opts.group_size or comm.Get_rank() != opts.group_rank:
            raise ValueError(
                f"init_process_group('mpidp'): rank {opts.group_rank} of {opts.group_size} was "
                f"asked for, but MPI made this process rank {comm.Get_rank()} of "
                f"{comm.Get_size()}: leave rank and world_size out (MPI knows them), or pass the "
                "communicator to mpidp.init_process_group(comm=...)")
        if _mpi.fault_tolerant:
            _enter_fault_tolerant_mode(comm)
        _default_comm = revocable(comm.Dup())
        return ProcessGroupMPIDP(_default_comm, opts.timeout, None)
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
    return ProcessGroupMPIDP(comm, opts.timeout, members)


def _enter_fault_tolerant_mode(comm) -> None:
    """Fault-tolerant mode: a default group over the job's ranks joins the
    job's agreement (mpidp's world, made here if the program used nothing
    else of mpidp, so that recover() finds it); one over fewer ranks is
    refused, since recover() rebuilds the default group over the job's
    survivors."""
    world = _mpi.world_mpi()
    if MPI.Comm.Compare(comm, world) not in (MPI.IDENT, MPI.CONGRUENT):
        raise NotImplementedError(
            "init_process_group('mpidp'): in fault-tolerant mode the default group spans the "
            f"whole job ({world.Get_size()} ranks), not {comm.Get_size()}; make it over every "
            "rank and split the ranks with dist.new_group(...)")
    _mpi.world()


def _parent_comm():
    """The communicator whose ranks are torch's default group's: the "mpidp"
    default group's, else the one mpidp.init_process_group made a gloo or
    NCCL default group from, else MPI.COMM_WORLD when torch's ranks are its
    ranks (an "mpidp" subgroup beside a gloo default group)."""
    if _default_comm is not None and dist.get_backend() == NAME:
        return _default_comm
    if _other_default_comm is not None:
        return _other_default_comm
    world = MPI.COMM_WORLD
    if dist.get_world_size() != world.Get_size() or dist.get_rank() != world.Get_rank():
        raise RuntimeError(
            f"mpidp backend: torch's default group (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}) is not MPI's world (rank {world.Get_rank()} of "
            f"{world.Get_size()}), so its ranks cannot be found in MPI: make the default group "
            "with mpidp.init_process_group(comm=...)")
    return world


def note_default_comm(comm) -> None:
    """mpidp.init_process_group made a default group of another backend from `comm`."""
    global _other_default_comm
    _other_default_comm = comm


class StoreForMPIDPOnly(dist.Store):
    """The store the rendezvous below hands torch when the job has no
    MASTER_ADDR: the "mpidp" backend never reads it, and any other backend
    that does learns why it cannot work instead of waiting."""

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(
            "torch.distributed was initialised without MASTER_ADDR/MASTER_PORT, which only the "
            "'mpidp' backend supports (it needs no store: MPI gives the ranks); a gloo or nccl "
            "group needs one. A side group for CPU tensors: dist.new_group(ranks, "
            "backend='mpidp') serves them. Else set MASTER_ADDR and MASTER_PORT before "
            "init_process_group('mpidp') (torch's env:// store then serves gloo and nccl groups "
            "beside it), or make the default group with mpidp.init_process_group(backend='gloo'), "
            "which builds the store from MPI")

    # Every method torch's backends may call (the ones left out would fail
    # inside torch with an internal assertion instead of this message).
    set = get = add = compare_set = wait = check = delete_key = num_keys = _refuse
    multi_get = multi_set = append = queue_push = queue_pop = queue_len = _refuse
    clone = barrier = list_keys = _refuse


# torch keeps only the C++ half of a Python store; the Python object, which
# holds the methods above, must be kept alive here, or torch's later calls on
# it (a gloo group's set) fail with an internal assertion.
_stores: list = []


def store_for_mpidp_only() -> StoreForMPIDPOnly:
    """A StoreForMPIDPOnly that lives as long as the process."""
    _stores.append(StoreForMPIDPOnly())
    return _stores[-1]


_torch_env_handler = None


def _env_rendezvous(url: str, timeout=None, **kwargs):
    """torch's env:// rendezvous where MASTER_ADDR is set (with the rank and
    world size from MPI where RANK and WORLD_SIZE are not); otherwise the
    rank and world size come from MPI (mpirun, srun, or one process alone)
    and the store is one that only the "mpidp" backend can do without."""
    comm = _next_default_comm if _next_default_comm is not None else MPI.COMM_WORLD
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
