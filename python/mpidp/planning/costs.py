"""Closed forms of the collectives' cost, and a two-level cluster's.

The forms are Thakur, Rabenseifner and Gropp's ("Optimization of Collective
Communication Operations in MPICH", 2005): p ranks, a message of n bytes,
alpha the time per message, beta per byte moved (the inverse bandwidth) and
gamma per byte reduced. nccl-tests' "bus bandwidth" convention converts a
measured time into the rate a link sustained, comparable across p.

A cluster has two levels: within a node (shared memory, or NVLink) and
across nodes (the network). Open MPI's allreduce does not see the levels:
its ring or recursive steps cross the network, so a flat collective over
ranks on several nodes is costed at the network's alpha and beta. mpidp's
hierarchical allreduce is a reduce-scatter in the node, an allreduce across
the nodes of 1/r of the data by each of the node's r ranks at once (so the
node's link carries the whole message), and an allgather in the node; its
allgather of compressed payloads, across the nodes then in the node."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


FP32_WIRE, BF16_WIRE = 4, 2   # bytes a float32 value takes on the wire


@dataclass(frozen=True)
class Level:
    """One level of a network: seconds per message (alpha), per byte moved
    (beta) and per byte reduced (gamma); and what a bf16 wire adds to an
    allreduce of float32 values beyond moving and reducing half the bytes
    (wire_bf16, seconds per float32 byte): the conversions each way and
    mpidp's own bf16 sum, CPU work that a fast link leaves exposed."""
    alpha: float
    beta: float
    gamma: float = 0.0
    wire_bf16: float = 0.0

    def with_bandwidth(self, bytes_per_s: float) -> "Level":
        return replace(self, beta=1.0 / bytes_per_s)

    def with_latency(self, seconds: float) -> "Level":
        return replace(self, alpha=seconds)


# -- one level: p ranks ------------------------------------------------------------
def ring_allreduce(p: int, n: float, lv: Level) -> float:
    """2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * lv.alpha + 2 * (p - 1) / p * n * lv.beta + (p - 1) / p * n * lv.gamma


def recursive_doubling_allreduce(p: int, n: float, lv: Level) -> float:
    """lg p (alpha + n beta + n gamma); p not a power of two adds one step
    (the ranks beyond it fold in first and take the result after)."""
    if p <= 1:
        return 0.0
    steps = math.ceil(math.log2(p)) + (0 if p & (p - 1) == 0 else 1)
    return steps * (lv.alpha + n * lv.beta + n * lv.gamma)


def rabenseifner_allreduce(p: int, n: float, lv: Level) -> float:
    """Reduce-scatter by recursive halving, then allgather by recursive
    doubling: 2 lg p alpha + 2(p-1)/p n beta + (p-1)/p n gamma (two extra
    steps of n/2 where p is not a power of two)."""
    if p <= 1:
        return 0.0
    t = (2 * math.ceil(math.log2(p)) * lv.alpha + 2 * (p - 1) / p * n * lv.beta
         + (p - 1) / p * n * lv.gamma)
    if p & (p - 1):
        t += 2 * (lv.alpha + n / 2 * lv.beta) + n / 2 * lv.gamma
    return t


def allreduce(p: int, n: float, lv: Level) -> float:
    """The best of the three, as MPI's tuned selection aims to be."""
    return min(ring_allreduce(p, n, lv), recursive_doubling_allreduce(p, n, lv),
               rabenseifner_allreduce(p, n, lv))


def wire_allreduce(p: int, n: float, lv: Level, wire: int = FP32_WIRE) -> float:
    """An allreduce of n bytes of float32 values sent `wire` bytes a value:
    a bf16 wire moves and reduces half the bytes and adds its conversions
    and sums (lv.wire_bf16 per float32 byte)."""
    if wire == FP32_WIRE or p <= 1:
        return allreduce(p, n, lv)
    return allreduce(p, n * wire / FP32_WIRE, lv) + n * lv.wire_bf16


def ring_allgather(p: int, n: float, lv: Level) -> float:
    """n: the bytes every rank ends with (p pieces): (p-1) alpha + (p-1)/p n beta."""
    if p <= 1:
        return 0.0
    return (p - 1) * lv.alpha + (p - 1) / p * n * lv.beta


def recursive_doubling_allgather(p: int, n: float, lv: Level) -> float:
    """ceil(lg p) alpha + (p-1)/p n beta."""
    if p <= 1:
        return 0.0
    return math.ceil(math.log2(p)) * lv.alpha + (p - 1) / p * n * lv.beta


def allgather(p: int, n: float, lv: Level) -> float:
    return min(ring_allgather(p, n, lv), recursive_doubling_allgather(p, n, lv))


def reduce_scatter(p: int, n: float, lv: Level) -> float:
    """n: every rank's input; ring: (p-1) alpha + (p-1)/p n (beta + gamma)."""
    if p <= 1:
        return 0.0
    return (p - 1) * lv.alpha + (p - 1) / p * n * (lv.beta + lv.gamma)


# -- nccl-tests' bus bandwidth -------------------------------------------------------
def bus_bandwidth(kind: str, p: int, n: float, seconds: float) -> float:
    """Bytes per second a link sustained: algorithm bandwidth n / t times
    2(p-1)/p (allreduce) or (p-1)/p (allgather, n the output)."""
    factor = {"allreduce": 2 * (p - 1) / p, "allgather": (p - 1) / p}[kind]
    return n / seconds * factor


# -- a two-level cluster ------------------------------------------------------------
@dataclass(frozen=True)
class Cluster:
    """nodes x ranks_per_node ranks; `intra` within a node, `inter` across."""
    nodes: int
    ranks_per_node: int
    intra: Level
    inter: Level

    @property
    def size(self) -> int:
        return self.nodes * self.ranks_per_node

    def with_network(self, bandwidth: float | None = None,
                     latency: float | None = None) -> "Cluster":
        inter = self.inter
        if bandwidth is not None:
            inter = inter.with_bandwidth(bandwidth)
        if latency is not None:
            inter = inter.with_latency(latency)
        return Cluster(self.nodes, self.ranks_per_node, self.intra, inter)


def flat_allreduce(c: Cluster, n: float, wire: int = FP32_WIRE) -> float:
    """An allreduce over every rank (n bytes of float32 values, sent `wire`
    bytes a value): within a node at the node's costs, else at the
    network's (its steps cross it)."""
    return wire_allreduce(c.size, n, c.intra if c.nodes == 1 else c.inter, wire)


def flat_allgather(c: Cluster, n: float) -> float:
    return allgather(c.size, n, c.intra if c.nodes == 1 else c.inter)


def node_route_allgather(c: Cluster, n: float) -> float:
    """The error-feedback wire's allgather (n: the bytes every rank ends
    with). Over several nodes of several ranks it takes mpidp's node route
    (_engines/node_gather.py): each rank gathers its counterparts' pieces
    across the nodes, the node's r ranks at once through its link (which
    so carries every piece once), then the node's ranks gather those among
    themselves. Elsewhere the flat allgather."""
    if c.nodes == 1 or c.ranks_per_node == 1:
        return flat_allgather(c, n)
    return allgather(c.nodes, n, c.inter) + allgather(c.ranks_per_node, n, c.intra)


def node_allreduce(c: Cluster, n: float) -> float:
    """An allreduce within each node (all nodes at once, independent)."""
    return allreduce(c.ranks_per_node, n, c.intra)


def hierarchical_allreduce(c: Cluster, n: float, wire: int = FP32_WIRE) -> float:
    """Reduce-scatter in the node, the nodes' allreduce of each rank's 1/r
    share (r at once through the node's link: the link carries n), and an
    allgather in the node; n bytes of float32 values sent `wire` bytes a
    value at every stage, a bf16 wire's conversions and sums costed at the
    node's rate (the network's at one rank a node)."""
    r = c.ranks_per_node
    sent = n * wire / FP32_WIRE
    across = allreduce(c.nodes, sent, c.inter) if c.nodes > 1 else 0.0
    extra = 0.0 if wire == FP32_WIRE else n * (c.intra if r > 1 else c.inter).wire_bf16
    return reduce_scatter(r, sent, c.intra) + across + allgather(r, sent, c.intra) + extra


def across_nodes_allreduce(c: Cluster, n: float, wire: int = FP32_WIRE) -> float:
    """The nodes' allreduce of n bytes of float32 values (sent `wire` bytes a
    value) through each node's link (one rank per node, or the node's ranks
    sharing the link with n in all)."""
    return wire_allreduce(c.nodes, n, c.inter, wire) if c.nodes > 1 else 0.0
