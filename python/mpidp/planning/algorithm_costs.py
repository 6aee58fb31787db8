"""What each of mpidp's training algorithms communicates per step, and
what that costs on a cluster (costs.py): the planner's model.

An algorithm is a list of communication components. Each has a cost (a
collective on the cluster), a period (every `every` steps), the compute it
runs under (`hidden_s`: DataParallel's allreduce under the backward,
Streaming DiLoCo's fragment under its delay's steps), and the bytes each
rank sends for it, and the compute the algorithm adds each time (SparseLoCo's
and DeMo's compression, which no communication hides). Per step, a
component costs (max(0, cost - hidden) + compute) / every; the step is the
training compute plus that.

Settings are mpidp's defaults (named in each algorithm's label), DASO in
its cycling phase. Payload sizes of SparseLoCo, MuLoCo and DeMo come from the
core's own payload layout (mpidp/efcomp.h), so the planner and the wire
cannot disagree."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from .. import _C
from . import costs
from .costs import Cluster, Level

FP32, BF16 = costs.FP32_WIRE, costs.BF16_WIRE


@dataclass(frozen=True)
class Workload:
    """params: the model's trainable parameters; step_s: one training step's
    compute without communication; overlap: the share of the backward
    (backward_share of the step) that DataParallel's allreduce runs under;
    overheads: the compute an algorithm adds where it compresses, seconds
    per parameter per occurrence ({"DeMo": per step, "SparseLoCo": per
    sync}, measured by calibrate)."""
    params: int
    step_s: float
    overlap: float = 1.0
    backward_share: float = 2.0 / 3.0
    overheads: Mapping[str, float] = field(default_factory=dict)

    @property
    def backward_s(self) -> float:
        return self.step_s * self.backward_share


@dataclass(frozen=True)
class Component:
    what: str
    seconds: Callable[[Cluster], float]
    every: float
    hidden_s: float
    bytes_sent: float
    compute_s: float = 0.0   # the algorithm's own compute each time (compression), never hidden


@dataclass(frozen=True)
class Algorithm:
    name: str
    settings: str
    components: Callable[[Cluster, Workload], List[Component]]


@dataclass(frozen=True)
class Prediction:
    algorithm: str
    settings: str
    step_s: float
    comm_s: float           # communication per step, hidden or not
    exposed_s: float        # per step, not hidden under compute
    bytes_per_step: float   # each rank sends, per step on average
    utilisation: float      # compute / step
    dominant: str           # compute, compression, latency, bandwidth or reduction


def _ring_sent(p: int, n: float) -> float:
    """Bytes a rank sends in a ring (or Rabenseifner) allreduce of n."""
    return 2 * (p - 1) / p * n if p > 1 else 0.0


def _gather_sent(p: int, payload: float) -> float:
    """Bytes a rank sends in an allgather of payload each (ring: p-1 pieces)."""
    return (p - 1) * payload if p > 1 else 0.0


def data_parallel(wire: int, hierarchical: bool = False):
    def parts(c: Cluster, w: Workload) -> List[Component]:
        n = w.params * FP32
        cost = costs.hierarchical_allreduce if hierarchical else costs.flat_allreduce
        return [Component("allreduce of the gradients", lambda cl: cost(cl, n, wire), 1,
                          w.overlap * w.backward_s, _ring_sent(c.size, w.params * wire))]
    return parts


def daso(global_skip: int, batches_to_wait: int):
    def parts(c: Cluster, w: Workload) -> List[Component]:
        n = w.params * FP32
        node = Component("node-local allreduce", lambda cl: costs.node_allreduce(cl, n), 1,
                         w.overlap * w.backward_s, _ring_sent(c.ranks_per_node, n))
        glob = Component("global sync (bf16) across nodes",
                         lambda cl: costs.across_nodes_allreduce(cl, w.params * FP32, BF16),
                         global_skip, batches_to_wait * w.step_s,
                         _ring_sent(c.nodes, w.params * BF16) / c.ranks_per_node)
        return [node, glob]
    return parts


def periodic(every: int, node_local_each_step: bool, extra_every: Optional[int] = None):
    """LocalSGD (every H steps an average over every rank) and SlowMo (its
    node-local DataParallel each step, LocalSGD across nodes every
    localsgd_frequency steps, and the slow momentum's average)."""
    def parts(c: Cluster, w: Workload) -> List[Component]:
        n = w.params * FP32
        out = []
        if node_local_each_step and c.ranks_per_node > 1:
            out.append(Component("node-local allreduce", lambda cl: costs.node_allreduce(cl, n),
                                 1, w.overlap * w.backward_s, _ring_sent(c.ranks_per_node, n)))
        across = costs.across_nodes_allreduce if node_local_each_step else costs.flat_allreduce
        p = c.nodes if node_local_each_step else c.size
        share = c.ranks_per_node if node_local_each_step else 1
        out.append(Component("parameter average", lambda cl: across(cl, n), every, 0.0,
                             _ring_sent(p, n) / share))
        if extra_every:
            out.append(Component("slow momentum's average", lambda cl: across(cl, n),
                                 extra_every, 0.0, _ring_sent(p, n) / share))
        return out
    return parts


def diloco(every: int, wire: int, fragments: int = 1, delay: int = 0):
    def parts(c: Cluster, w: Workload) -> List[Component]:
        n = w.params * FP32 / fragments
        return [Component("outer-gradient allreduce" + (" (one fragment)" if fragments > 1
                                                         else ""),
                          lambda cl: costs.flat_allreduce(cl, n, wire), every / fragments,
                          delay * w.step_s, _ring_sent(c.size, n * wire / FP32))]
    return parts


def desloc(param_every: int, exp_avg_every: int, exp_avg_sq_every: int):
    """DES-LOC (and Local Adam, the three periods equal): an average over
    every rank of the float32 parameters, of Adam's first moments and of
    its second moments, each on its own period (averages due at the same
    step travel in one allreduce; costed apart, which counts their latency
    twice)."""
    def parts(c: Cluster, w: Workload) -> List[Component]:
        n = w.params * FP32
        return [Component(f"average of the {what}", lambda cl: costs.flat_allreduce(cl, n),
                          every, 0.0, _ring_sent(c.size, n))
                for what, every in (("parameters", param_every),
                                    ("first moments", exp_avg_every),
                                    ("second moments", exp_avg_sq_every))]
    return parts


def sparseloco_payload(params: int, top_k: int = 128, chunk: int = 64, bins: int = 4) -> int:
    """Bytes one rank sends per sync: the core's payload for params
    float32 values in chunk x chunk tiles (the last tile's share kept)."""
    tile = chunk * chunk
    ntiles = max(1, math.ceil(params / tile))
    return int(_C.ef_payload_bytes(ntiles, tile, min(top_k, tile), bins))


def sparseloco(every: int, top_k: int, chunk: int, bins: int, delay: int = 0):
    """SparseLoCo, and MuLoCo (top_k = chunk²: every entry, its payload
    without slots; its compression's compute taken as SparseLoCo's)."""
    def parts(c: Cluster, w: Workload) -> List[Component]:
        payload = sparseloco_payload(w.params, top_k, chunk, bins)
        return [Component("allgather of the compressed outer gradients",
                          lambda cl: costs.node_route_allgather(cl, payload * cl.size), every,
                          delay * w.step_s, _gather_sent(c.size, payload),
                          w.overheads.get("SparseLoCo", 0.0) * w.params)]
    return parts


def noloco_peers(size: int, group_size: int) -> Tuple[int, float]:
    """The peers of NoLoCo's groups over `size` ranks (algorithms/noloco.py:
    size // group_size groups, the ranks dealt round-robin, so a group has
    size // groups ranks or one more): the most any rank has, and the mean
    over the ranks."""
    groups = max(1, size // group_size)
    small, larger = divmod(size, groups)      # `larger` groups have small + 1 ranks
    most = small if larger else small - 1
    mean = ((groups - larger) * small * (small - 1) + larger * (small + 1) * small) / size
    return most, mean


def noloco(every: int, group_size: int = 2):
    """NoLoCo: each rank sends its float32 replica to every other member of
    its group (one after another through its link, while it receives as
    much) and adds up what it receives; no collective over every rank. The
    sync takes as long as the largest group's exchange (a size the group
    size does not divide leaves some a rank larger); the bytes are the
    ranks' mean. Across nodes the groups are costed at the network's rate
    (the draw puts most on two nodes)."""
    def parts(c: Cluster, w: Workload) -> List[Component]:
        n = w.params * FP32
        most, mean = noloco_peers(c.size, group_size)

        def seconds(cl: Cluster) -> float:
            lv = cl.intra if cl.nodes == 1 else cl.inter
            return most * (lv.alpha + n * (lv.beta + lv.gamma))
        return [Component("exchange of the replicas within each group", seconds, every, 0.0,
                          mean * n)]
    return parts


def eager_diloco(every: int, wire: int):
    """DiLoCo with eager outer updates: DiLoCo's allreduce, under the whole
    next inner phase (`every` steps of compute) rather than blocking the
    sync."""
    def parts(c: Cluster, w: Workload) -> List[Component]:
        [allreduce] = diloco(every, wire)(c, w)
        return [dataclasses.replace(allreduce, what="outer-gradient allreduce, overlapped",
                                    hidden_s=every * w.step_s)]
    return parts


def demo(top_k: int, chunk: int):
    def parts(c: Cluster, w: Workload) -> List[Component]:
        payload = sparseloco_payload(w.params, top_k, chunk, 0)
        return [Component("allgather of the DCT coefficients",
                          lambda cl: costs.node_route_allgather(cl, payload * cl.size), 1, 0.0,
                          _gather_sent(c.size, payload), w.overheads.get("DeMo", 0.0) * w.params)]
    return parts


ALGORITHMS: Tuple[Algorithm, ...] = (
    Algorithm("DataParallel", "fp32 wire", data_parallel(FP32)),
    Algorithm("DataParallel", "bf16 wire", data_parallel(BF16)),
    Algorithm("DataParallel", "hierarchical", data_parallel(FP32, hierarchical=True)),
    Algorithm("DASO", "cycling: global sync every 8 steps, 2 to wait", daso(8, 2)),
    Algorithm("LocalSGD", "H=8", periodic(8, False)),
    Algorithm("SlowMo", "localsgd_frequency=3, slowmo_frequency=48", periodic(3, True, 48)),
    Algorithm("DiLoCo", "H=100, fp32", diloco(100, FP32)),
    Algorithm("Streaming DiLoCo", "H=100, 4 fragments, delay 5, bf16", diloco(100, BF16, 4, 5)),
    Algorithm("SparseLoCo", "H=50, top 128 of 64x64, 2-bit", sparseloco(50, 128, 64, 4)),
    Algorithm("MuLoCo", "H=30, every entry 2-bit", sparseloco(30, 64 * 64, 64, 4)),
    Algorithm("Eager DiLoCo", "H=100, fp32, under the next inner phase",
              eager_diloco(100, FP32)),
    Algorithm("NoLoCo", "H=50, pairs", noloco(50, 2)),
    Algorithm("Local Adam", "H=32, parameters and both moments", desloc(32, 32, 32)),
    Algorithm("DES-LOC", "parameters every 32, moments every 96 and 192", desloc(32, 96, 192)),
    Algorithm("DeMo", "top 32 of 64x64 DCT", demo(32, 64)),
)


def _only(level: Level, keep: str) -> Level:
    """The level with one term kept; a bf16 wire's conversions and sums
    count as reduction."""
    return Level(level.alpha if keep == "latency" else 0.0,
                 level.beta if keep == "bandwidth" else 0.0,
                 level.gamma if keep == "reduction" else 0.0,
                 level.wire_bf16 if keep == "reduction" else 0.0)


def predict(algorithm: Algorithm, cluster: Cluster, work: Workload) -> Prediction:
    parts = algorithm.components(cluster, work)
    comm = sum(p.seconds(cluster) / p.every for p in parts)
    exposed = sum((max(0.0, p.seconds(cluster) - p.hidden_s) + p.compute_s) / p.every
                  for p in parts)
    sent = sum(p.bytes_sent / p.every for p in parts)
    terms = {"compute": work.step_s, "compression": sum(p.compute_s / p.every for p in parts)}
    for keep in ("latency", "bandwidth", "reduction"):
        alone = Cluster(cluster.nodes, cluster.ranks_per_node, _only(cluster.intra, keep),
                        _only(cluster.inter, keep))
        terms[keep] = sum(p.seconds(alone) / p.every for p in parts)
    step = work.step_s + exposed
    return Prediction(algorithm.name, algorithm.settings, step, comm, exposed, sent,
                      work.step_s / step, max(terms, key=terms.get))


def bandwidth_for(algorithm: Algorithm, cluster: Cluster, work: Workload,
                  utilisation: float) -> Optional[float]:
    """The network bandwidth (bytes/s, the inter-node level's) at which the
    algorithm reaches `utilisation`, or None where even 10^14 B/s does not
    (its latency or its own compression keeps it below). Bisection: the
    step time falls as bandwidth grows."""
    def util(bw: float) -> float:
        return predict(algorithm, cluster.with_network(bandwidth=bw), work).utilisation

    lo, hi = 1e3, 1e14
    if util(hi) < utilisation:
        return None
    if util(lo) >= utilisation:
        return lo
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        if util(mid) >= utilisation:
            hi = mid
        else:
            lo = mid
    return hi


def predict_all(cluster: Cluster, work: Workload,
                algorithms: Sequence[Algorithm] = ALGORITHMS) -> List[Prediction]:
    return [predict(a, cluster, work) for a in algorithms]
