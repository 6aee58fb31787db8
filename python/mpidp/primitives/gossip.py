"""fairscale's gossip graphs and mixing for SGP (the SlowMo base), with its
names and arguments: `mpidp.gossip.DynamicDirectedExponentialGraph(rank,
world_size, nprocs_per_node=1, local_rank=0, peers_per_itr=1)` and the
others, and `UniformMixing(graph, device=None)`.

A graph is over `world_size` workers (SlowMo's nodes); who talks to whom at
each gossip round is the core's (mpidp/peer_graphs.h): a pure function of the
round, so every worker computes the same graph and a resumed job meets the
same peers. `get_peers(rotate)` gives the process ranks of the workers'
counterparts (worker * nprocs_per_node + local_rank), both ways; fairscale
gives the out-peers' masters and the in-peers' worker indices.

Differences from fairscale, on purpose: the bipartite graphs need an even
number of workers (fairscale's are not regular otherwise); a peer at a
distance that is a multiple of world_size (NPeer graphs) is dropped rather
than made a worker's own peer; the levels of the exponential graphs use
integer logarithms (fairscale's floating-point log drops a level at
world_size - 1 = 243 for 2 peers per round and 1000 for 9).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import _C
from .._runtime.argument_agreement import agree
from .._runtime.args import check_bool, check_int

__all__ = ["mix", "GraphManager", "DynamicDirectedExponentialGraph", "NPeerDynamicDirectedExponentialGraph",
           "DynamicBipartiteExponentialGraph", "DynamicDirectedLinearGraph",
           "DynamicBipartiteLinearGraph", "RingGraph", "MixingManager", "UniformMixing"]


class GraphManager:
    """A gossip graph over `world_size` workers, seen from worker `rank`.
    Subclasses pick the graph (fairscale's classes); the round advances by
    one with get_peers(rotate=True) (a dynamic graph then moves on to the
    next entries of its phone book)."""

    _kind: int = -1
    _bipartite = False
    _dynamic = True

    def __init__(self, rank: int, world_size: int, nprocs_per_node: int = 1, local_rank: int = 0,
                 peers_per_itr: int = 1):
        if self._kind < 0:
            raise TypeError("GraphManager is abstract: use one of mpidp.gossip's graphs")
        self.world_size = check_int("world_size", world_size, 1)
        self.rank = check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank: expected 0 .. {world_size - 1}, got {rank}")
        self.nprocs_per_node = check_int("nprocs_per_node", nprocs_per_node, 1)
        self.local_rank = check_int("local_rank", local_rank, 0)
        if local_rank >= nprocs_per_node:
            raise ValueError(f"local_rank: expected 0 .. {nprocs_per_node - 1}, got {local_rank}")
        self._peers_per_itr = check_int("peers_per_itr", peers_per_itr, 1)
        self.round = 0
        self.book_len = _C.graph_book_len(self._kind, world_size, peers_per_itr)

    @property
    def peers_per_itr(self) -> int:
        return self._peers_per_itr

    @peers_per_itr.setter
    def peers_per_itr(self, v: int) -> None:
        check_int("peers_per_itr", v, 1)
        self.book_len = _C.graph_book_len(self._kind, self.world_size, v)
        self._peers_per_itr = v
        self.round = 0       # fairscale restarts its group indices

    def worker_peers(self, at: Optional[int] = None) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """The workers this worker sends to and receives from at round `at`
        (default: the current one)."""
        r = self.round if at is None else check_int("at", at, 0)
        return _C.graph_peers(self._kind, self.world_size, self._peers_per_itr, self.rank, r)

    def get_peers(self, rotate: bool = False) -> Tuple[List[int], List[int]]:
        """The process ranks of the out- and in-peers at the current round,
        after moving to the next round when `rotate`."""
        check_bool("rotate", rotate)
        if rotate:
            self.round += 1
        out, inp = self.worker_peers()
        to_rank = lambda w: w * self.nprocs_per_node + self.local_rank  # noqa: E731
        return [to_rank(w) for w in out], [to_rank(w) for w in inp]

    def is_regular_graph(self) -> bool:
        return True

    def is_bipartite_graph(self) -> bool:
        return self._bipartite

    def is_passive(self, rank: Optional[int] = None) -> bool:
        """Whether `rank` (default: this worker) is an even worker of a
        bipartite graph."""
        return self._bipartite and (self.rank if rank is None else rank) % 2 == 0

    def is_dynamic_graph(self) -> bool:
        return self._dynamic

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"nprocs_per_node={self.nprocs_per_node}, local_rank={self.local_rank}, "
                f"peers_per_itr={self._peers_per_itr})")


class DynamicDirectedExponentialGraph(GraphManager):
    """Peers at +-2^i, one distance after the other (fairscale's default)."""
    _kind = _C.GRAPH_DDE


class NPeerDynamicDirectedExponentialGraph(GraphManager):
    """Peers at +j (k + 1)^i for j = 1..k (k = peers_per_itr)."""
    _kind = _C.GRAPH_NPDDE


class DynamicBipartiteExponentialGraph(GraphManager):
    """Even and odd workers only, at +-1 and +-(1 + 2^i)."""
    _kind = _C.GRAPH_DBE
    _bipartite = True


class DynamicDirectedLinearGraph(GraphManager):
    """Peers at every odd distance +-i, in turn."""
    _kind = _C.GRAPH_DDL


class DynamicBipartiteLinearGraph(GraphManager):
    """Even and odd workers only, at every odd distance."""
    _kind = _C.GRAPH_DBL
    _bipartite = True


class RingGraph(GraphManager):
    """Always the next worker (a static graph)."""
    _kind = _C.GRAPH_RING
    _dynamic = False


class MixingManager:
    """How a worker weighs its own value and its in-peers' in a gossip round."""

    def __init__(self, graph: GraphManager, device: Optional[torch.device] = None):
        if not isinstance(graph, GraphManager):
            raise TypeError(f"graph: expected an mpidp.gossip graph, got {type(graph).__name__}")
        self.graph_manager = graph
        self.device = device

    def is_regular(self) -> bool:
        return self.graph_manager.is_regular_graph() and self.is_uniform()

    def is_uniform(self) -> bool:
        raise NotImplementedError

    def get_mixing_weights(self, residual_adjusted: bool = True) -> Dict[str, float]:
        raise NotImplementedError


class UniformMixing(MixingManager):
    """Every out-peer and the worker itself get 1 / (peers_per_itr + 1)."""

    def is_uniform(self) -> bool:
        return True

    def get_mixing_weights(self, residual_adjusted: bool = True) -> Dict[str, float]:
        """{"uniform": w} with w = 1 / (out-degree + 1), fairscale's key, and
        "lo" (the weight the worker keeps) for residual_adjusted."""
        check_bool("residual_adjusted", residual_adjusted)
        w = 1.0 / (self.graph_manager.peers_per_itr + 1)
        return {"uniform": w, "lo": w} if residual_adjusted else {"uniform": w}


def mix(x: torch.Tensor, graph: GraphManager, mixing: MixingManager, comm,
        check: bool = True) -> torch.Tensor:
    """One gossip round: this worker's `x` (a contiguous float32 CPU tensor)
    mixed with its in-peers' over `comm` (an mpidp Comm whose ranks are the
    graph's workers), w x + w x_j summed in a fixed order -- its own first,
    then the in-peers in the graph's order -- so a simulation of all workers
    gives the same bits. Every worker calls it at the same round; the graph
    then moves to the next round. Returns a new tensor. The workers first
    check that their x have the same shape and dtype (one small allreduce;
    check=False skips it where the shapes were agreed before, as SlowMo's
    SGP does at set-up)."""
    if not mixing.is_uniform():
        raise ValueError("mixing: only uniform mixing is supported (mpidp.gossip.UniformMixing)")
    if check:
        agree(comm, "gossip.mix", x)
    out, inp = graph.worker_peers()
    mixed = x * mixing.get_mixing_weights()["uniform"]
    received = tuple(torch.empty_like(mixed) for _ in inp)
    comm.peer_exchange(mixed, out, received, inp).wait()
    for r in received:
        mixed += r
    graph.round += 1
    return mixed
