"""torch.distributed process groups built from MPI, with nothing to export.

Users of MPI clusters have no MASTER_ADDR/MASTER_PORT: the group's first rank
opens a TCP store on a free port and MPI tells the other ranks where it is."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from .._runtime import config
from .._runtime.args import check_choice
from .._runtime import mpi as _mpi
from .._runtime.mpi import MPI, world_mpi
from .._runtime.topology import node_comm, topology

__all__ = ["init_process_group", "node_process_group"]


class _MPIGroups:
    """The MPI communicators behind torch.distributed's default group, kept
    here for the "mpidp" backend's group creator (mpidp/c10d/_registration.py)."""
    next_default = None     # the next default "mpidp" group is made from it (None: the world)
    default = None          # the default "mpidp" group's (its subgroups' ranks are its ranks)
    default_source = None   # the communicator the default "mpidp" group was made from
    other_default = None    # the one init_process_group made a gloo or NCCL default group from
    # Whether the program made its first default group with
    # mpidp.init_process_group (True) or torch's own dist.init_process_group
    # (False): a replacement's program makes it the same way, whoever made
    # it again later (keep_whole_groups), so growing back follows this.
    first_made_by_mpidp = None


groups = _MPIGroups()


class StoreForMPIDPOnly(dist.Store):
    """The store an "mpidp" default group is made with when the job has no
    MASTER_ADDR (init_process_group below, and the env:// rendezvous in
    mpidp/c10d/_registration.py): the "mpidp" backend never reads it, and any
    other backend that does learns why it cannot work instead of waiting."""

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
    barrier = list_keys = _refuse

    def clone(self) -> "StoreForMPIDPOnly":
        """Itself: a copy would refuse the same (torch's shrink_group clones
        the group's store for the new group, which does not use it)."""
        return self


# torch keeps only the C++ half of a Python store; the Python object, which
# holds the methods above, must be kept alive here, or torch's later calls on
# it (a gloo group's set) fail with an internal assertion.
_stores: list = []


def store_for_mpidp_only() -> StoreForMPIDPOnly:
    """A StoreForMPIDPOnly that lives as long as the process."""
    _stores.append(StoreForMPIDPOnly())
    return _stores[-1]


def _store_host(comm: MPI.Intracomm) -> tuple:
    """(the address this rank would give rank 0's TCP store, whether the
    group spans several nodes); collective over `comm`."""
    explicit = config.get("MPIDP_STORE_ADDR")
    if explicit:
        return explicit, False   # the user's choice, not second-guessed
    on_one_node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = on_one_node.Get_size() == comm.Get_size()
    on_one_node.Free()
    if local:
        return "127.0.0.1", False
    try:
        return socket.gethostbyname(socket.gethostname()), True
    except OSError:
        return socket.getfqdn(), True


def default_backend(cuda_devices: int, ranks_on_node: int) -> str:
    """NCCL for CUDA tensors when every rank of the node can have a GPU of its
    own, with gloo for CPU tensors beside it (torch's own default: a metric
    all_reduced on the CPU or a barrier still works); else gloo for both.

    NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU
    detected"), so a node running more ranks than it has GPUs (several ranks
    sharing one GPU, as in tests and small jobs) falls back to gloo, which
    reduces CUDA tensors through host memory."""
    return "cpu:gloo,cuda:nccl" if 0 < ranks_on_node <= cuda_devices else "gloo"


def init_process_group(comm=None, backend: str | None = None,
                       timeout: datetime.timedelta | None = None) -> None:
    """Create torch.distributed's default process group from MPI.

    comm: the ranks of the group (an mpi4py communicator); default: every
    rank of the job (MPI.COMM_WORLD), so that torch's defaults
    (DistributedSampler, dist.all_reduce) mean the whole job, as under
    torchrun. backend: "mpidp" (torch.distributed over MPI through mpidp's
    core: the group is `comm` itself, with no store and no ports), "gloo"
    or "nccl"; default NCCL for CUDA tensors and
    gloo for CPU ones when the node has at least one GPU for each of its ranks
    (each rank then uses GPU `local_rank`), else gloo; in fault-tolerant mode
    "mpidp" where it would be NCCL. Calling it again with the same ranks does
    nothing; with other ranks it raises.

    timeout: the group's timeout, for its store and torch's collectives (a
    datetime.timedelta; None: MPIDP_TIMEOUT, mpidp's own deadline)."""
    # (The job's world is mpidp's: in fault-tolerant mode, its survivors and
    # the replacements that joined them.)
    group = world_mpi() if comm is None or comm is MPI.COMM_WORLD else comm
    if not isinstance(group, MPI.Intracomm):
        raise TypeError(f"comm: expected an mpi4py intra-communicator, got {type(group).__name__}")
    if backend is not None:
        check_choice("backend", backend, ("gloo", "nccl", "mpidp"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus == 0:
        raise RuntimeError("init_process_group: backend='nccl' needs CUDA GPUs, and this process "
                           "sees none (CUDA_VISIBLE_DEVICES, or a CPU-only torch?); use "
                           "backend='gloo', or leave backend=None to choose")
    if dist.is_initialized():   # before anything collective: a second call does nothing
        if dist.get_world_size() != group.Get_size() or dist.get_rank() != group.Get_rank():
            raise RuntimeError(
                f"init_process_group: torch.distributed is already initialised with rank "
                f"{dist.get_rank()} of {dist.get_world_size()}, not rank {group.Get_rank()} of "
                f"{group.Get_size()} as asked")
        made = dist.get_backend()
        if backend is not None and backend not in made.replace(",", ":").split(":"):
            raise RuntimeError(
                f"init_process_group: torch.distributed is already initialised with backend "
                f"{made!r}, not {backend!r} as asked; dist.destroy_process_group() first to "
                "change it")
        return
    if backend is None:
        same_machine = group.Split_type(MPI.COMM_TYPE_SHARED)
        backend = default_backend(gpus, same_machine.Get_size())
        same_machine.Free()
        if "nccl" in backend and _mpi.fault_tolerant:
            # NCCL has no ULFM: a dead peer would leave the others inside
            # its kernels; "mpidp" takes CUDA tensors through host memory.
            backend = "mpidp"
    if "nccl" in backend:
        torch.cuda.set_device(topology().local_rank % gpus)
    timeout = timeout or datetime.timedelta(seconds=config.get("MPIDP_TIMEOUT"))
    global _made
    _made = (backend, timeout)
    if groups.first_made_by_mpidp is None:
        groups.first_made_by_mpidp = True
    if backend == "mpidp":   # the group is `group` itself: no store, no ports
        groups.next_default = group     # the "mpidp" backend's creator takes it (mpidp/c10d)
        dist.init_process_group("mpidp", store=store_for_mpidp_only(),
                                rank=group.Get_rank(), world_size=group.Get_size(),
                                timeout=timeout)
        return
    host, spans_nodes = _store_host(group)
    if host == "127.0.0.1" and not spans_nodes:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rank, size = group.Get_rank(), group.Get_size()
    store, error = None, None
    if rank == 0:
        try:
            store = dist.TCPStore(host, 0, size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
        except Exception as exc:  # tell the others instead of leaving them waiting
            error = f"rank 0 could not open a TCP store on {host}: {exc}"
    # Every rank connects to rank 0's address: each rank resolving its own
    # hostname would send the other nodes' ranks to themselves.
    host, port, error = group.bcast((host, store.port if store else None, error), root=0)
    if error is None and spans_nodes and host.startswith("127."):
        # The group spans nodes, but rank 0's hostname resolves to a loopback
        # address (127.0.1.1 in Debian's /etc/hosts): the other nodes would
        # wait for it until the timeout.
        error = (f"rank 0's hostname resolves to {host}, which the other nodes cannot reach; "
                 "set MPIDP_STORE_ADDR to an address of rank 0's node that they can (and "
                 "GLOO_SOCKET_IFNAME to the interface the nodes share)")
    if error:
        raise RuntimeError(f"init_process_group: {error}")
    if rank != 0:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    groups.other_default = group     # for "mpidp" subgroups beside it


def default_group_source():
    """The mpi4py communicator torch.distributed's default group was made from
    by mpidp (the "mpidp" backend's creator or init_process_group), else None:
    recover() makes the group again over that communicator's survivors (the
    job's, or a worker group's)."""
    if not dist.is_initialized():
        return None
    if dist.get_backend() == "mpidp":
        return groups.default_source
    return groups.other_default if _made is not None else None


# (backend, timeout) of the default group init_process_group made, for
# continue_on; None where the program made it (or none exists).
_made = None


def continue_on(world: MPI.Intracomm, growing: bool = False) -> None:
    """Fault-tolerant mode, after mpidp.recover() shrank or grew the world
    (or a worker group the default group was made over, then `world` is the
    group's survivors): the default group that init_process_group made over
    the old world (a dead rank's store or connections in it) is destroyed and
    made again over `world`, with the same backend; the node groups made from it go too. So
    is an "mpidp" default group, whoever made it (its ranks are MPI's). A
    gloo or NCCL group the program made itself is its to remake, and so are
    the subgroups (torch destroys them with the default group).

    A default group over the job's ranks in another order than the world's
    (mpidp.init_process_group(comm=reordered)) keeps its survivors' order
    after a shrink; after a growth (`growing`) it is made in the world's
    order, the replacements last, as their program's first
    init_process_group() makes it (their place in it is a lost rank's only
    where the program orders it again, as keep_whole_groups does)."""
    global _made
    how = made_again_by_recovery()
    if how is None:
        return
    key = None if growing else _key_keeping_order(world)
    _node_groups.clear()
    dist.destroy_process_group()
    _made = None
    if key is not None:
        world = world.Split(0, key)
    init_process_group(world, backend=how[0], timeout=how[1])


def _key_keeping_order(survivors: MPI.Intracomm):
    """This survivor's key for splitting `survivors` into the default group's
    old order, or None where theirs serves (the same on every survivor)."""
    source = default_group_source()
    if source is None:
        return None
    old = MPI.Group.Translate_ranks(survivors.Get_group(), list(range(survivors.Get_size())),
                                    source.Get_group())
    return None if old == sorted(old) else old[survivors.Get_rank()]


def made_by_init_process_group() -> bool:
    """Whether mpidp.init_process_group made the default group, and the
    program made its first one so (not with torch's own dist.init_process_group,
    as a replacement's script then does)."""
    return dist.is_initialized() and _made is not None and bool(groups.first_made_by_mpidp)


def made_again_by_recovery():
    """(backend, timeout) of the default group continue_on makes again (for
    init_process_group), or None where it makes none."""
    if not dist.is_initialized():
        return None
    if _made is not None:
        backend, timeout = _made
    elif dist.get_backend() == "mpidp":   # dist.init_process_group("mpidp") made it
        backend, timeout = "mpidp", None
    else:
        return None
    return (None if "," in backend else backend), timeout


# Node-local groups made so far, by the nodes' ranks: (the default group they
# belong to, the group). A group of an earlier default group (destroyed and
# made again) is never handed out.
_node_groups: dict = {}


def node_process_group(comm: MPI.Intracomm, backend: str | None = None) -> dist.ProcessGroup:
    """The torch.distributed group of this rank's node (mpidp.topology), within
    the default group, which must be `comm`'s ranks in `comm`'s order, on
    `backend` (None: the default group's). Every rank of `comm` must call it
    (creating groups is collective); later calls for the same layout and
    backend return the same group."""
    members = tuple(node_comm(comm).allgather(comm.Get_rank()))
    nodes = tuple(sorted(set(comm.allgather(members))))
    world, group = _node_groups.get((nodes, backend), (None, None))
    if world is not dist.group.WORLD:
        group, _ = dist.new_subgroups_by_enumeration([list(n) for n in nodes], backend=backend)
        _node_groups[(nodes, backend)] = (dist.group.WORLD, group)
    return group
