"""Where each rank runs: node index, number of nodes, local rank and local size.

Nodes are found with MPI_Comm_split_type(MPI_COMM_TYPE_SHARED): ranks that
share memory form a node. MPIDP_RANKS_PER_NODE=k instead splits the ranks into
"nodes" of k consecutive ranks, so several nodes can be emulated on one
machine (tests, benchmarks)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from . import config
from .mpi import MPI, revocable, world_mpi

__all__ = ["Topology", "topology", "node_comm", "cross_node_comm", "forget_splits",
           "nodes_are_even"]


@dataclass(frozen=True)
class Topology:
    node: int         # index of this rank's node, 0 .. n_nodes - 1
    n_nodes: int
    local_rank: int   # rank within the node, 0 .. local_size - 1
    local_size: int   # ranks per node (equal on every node)


_cache: dict = {}


def split_by_node(comm: MPI.Intracomm):
    """`comm` split into one communicator per node (MPIDP_RANKS_PER_NODE
    consecutive ranks a node where set, else MPI's shared-memory split)."""
    k = config.get("MPIDP_RANKS_PER_NODE")
    if k is not None:
        if comm.Get_size() % k != 0:
            raise ValueError(f"MPIDP_RANKS_PER_NODE={k} must divide the number of ranks "
                             f"({comm.Get_size()})")
        return revocable(comm.Split(comm.Get_rank() // k, comm.Get_rank()))
    return revocable(comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank()))


def node_comm(comm=None) -> MPI.Intracomm:
    """The mpi4py communicator of this rank's node within `comm` (cached)."""
    comm = world_mpi() if comm is None or comm is MPI.COMM_WORLD else comm
    key = (comm.py2f(), config.get("MPIDP_RANKS_PER_NODE"))
    if key not in _cache:
        local = split_by_node(comm)
        # Node index: the number of distinct nodes whose first rank precedes ours.
        leader = comm.Get_rank() if local.Get_rank() == 0 else -1
        leaders = sorted(r for r in comm.allgather(leader) if r >= 0)
        my_leader = local.bcast(comm.Get_rank() if local.Get_rank() == 0 else None, root=0)
        sizes = comm.allgather(local.Get_size())
        if len(set(sizes)) != 1:
            by_node = {}
            for r, s in enumerate(sizes):
                by_node.setdefault(s, []).append(r)
            detail = "; ".join(f"{len(v)} rank(s) on nodes of {s}" for s, v in sorted(by_node.items()))
            local.Free()
            raise ValueError("mpidp needs the same number of ranks on every node, got " + detail +
                             " (launch the same number of processes per node, or set "
                             "MPIDP_RANKS_PER_NODE)")
        _cache[key] = (local, Topology(node=leaders.index(my_leader), n_nodes=len(leaders),
                                       local_rank=local.Get_rank(), local_size=local.Get_size()))
    return _cache[key][0]


def topology(comm=None) -> Topology:
    """This rank's place in the machine: node, n_nodes, local_rank, local_size.

    comm: the ranks taking part (an mpi4py communicator or MPICommunication;
    None: every rank)."""
    comm = world_mpi() if comm is None or comm is MPI.COMM_WORLD else comm
    node_comm(comm)
    return _cache[(comm.py2f(), config.get("MPIDP_RANKS_PER_NODE"))][1]


_cross_cache: dict = {}


def cross_node_comm(comm=None) -> MPI.Intracomm:
    """The mpi4py communicator of the ranks of `comm` that have this rank's
    local rank, one per node, ordered by node (cached).

    With node-local data parallelism (`DataParallel(model, node_comm())`)
    every rank of a node holds the same replica, so the node is the worker:
    passing this communicator to an algorithm that syncs replicas (`DiLoCo`,
    the model averagers) makes each rank sync with its counterparts on the
    other nodes, which hold the other nodes' replicas."""
    comm = world_mpi() if comm is None or comm is MPI.COMM_WORLD else comm
    key = (comm.py2f(), config.get("MPIDP_RANKS_PER_NODE"))
    if key not in _cross_cache:
        topo = topology(comm)
        _cross_cache[key] = revocable(comm.Split(color=topo.local_rank, key=topo.node))
    return _cross_cache[key]


def useful_hierarchy(comm, who: str, instead: str, *, warn: bool = True, stacklevel: int = 2):
    """(node_comm(comm), cross_node_comm(comm)) where a hierarchy -- within
    each node, then across nodes -- can help: several ranks on each of
    several nodes. Elsewhere None, after warning (unless `warn` is False)
    that `who`'s hierarchical=True cannot help and what happens `instead`."""
    topo = topology(comm)
    if topo.local_size > 1 and topo.n_nodes > 1:
        return node_comm(comm), cross_node_comm(comm)
    if warn:
        warnings.warn(f"{who}: hierarchical=True cannot help with "
                      + ("one rank per node" if topo.local_size == 1 else "a single node")
                      + f"; {instead}", stacklevel=stacklevel + 1)
    return None


def nodes_are_even(comm=None) -> bool:
    """Whether every node holds the same number of ranks of `comm` (what a
    hierarchy needs; after ranks were lost it may no longer hold).
    Collective over comm."""
    comm = world_mpi() if comm is None or comm is MPI.COMM_WORLD else comm
    k = config.get("MPIDP_RANKS_PER_NODE")
    if k is not None and comm.Get_size() % k:
        return False
    local = split_by_node(comm)
    try:
        return len(set(comm.allgather(local.Get_size()))) == 1
    finally:
        local.Free()


def forget_splits() -> None:
    """Drop every cached split: the world changed (fault-tolerant mode lost
    ranks), and a freed communicator's handle may be reused by a new one."""
    _cache.clear()
    _cross_cache.clear()
