"""The calibration profile: what `python -m mpidp calibrate` measured on an
allocation and the cost model fitted to it, as one JSON file.

Per level (intra: within a node; inter: across nodes, one rank per node)
the measured times of allreduce and allgather over a range of sizes, and
alpha, beta, gamma fitted to them with the ring forms of costs.py (the
allgather gives alpha and beta, the allreduce's slope then gamma): alpha
from the smallest message, the slopes from the two largest, where
training's traffic is. The allreduce with a bf16 wire, as DataParallel
runs it, gives what that wire adds beyond moving half the bytes
(wire_bf16: its conversions and bf16 sums).
The fit's residuals say how far the closed forms are from the
measurements. Plus the step: the model's parameters, its compute time
without communication, the overlap DataParallel achieved, and the compute
that SparseLoCo's and DeMo's compression adds (per parameter)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._version import __version__
from . import costs
from .costs import Cluster, Level

FORMAT = 1


@dataclass
class LevelFit:
    ranks: int
    alpha: float
    beta: float
    gamma: float
    sizes: Tuple[float, float]                      # smallest and largest message measured
    measured: Dict[str, List[Tuple[float, float]]]  # kind -> [(bytes, seconds)]
    residuals: Dict[str, Dict[str, float]]          # kind -> median/max relative error
    wire_bf16: float = 0.0                          # seconds per float32 byte (costs.Level)

    @property
    def level(self) -> Level:
        return Level(self.alpha, self.beta, self.gamma, self.wire_bf16)


@dataclass
class Profile:
    mpidp_version: str
    world_size: int
    nodes: int
    ranks_per_node: int
    levels: Dict[str, Optional[LevelFit]]
    model: str
    params: int
    step_s: float
    overlap: float
    format: int = FORMAT
    notes: List[str] = field(default_factory=list)
    overheads: Dict[str, float] = field(default_factory=dict)   # algorithms.Workload's

    def cluster(self, nodes: int, ranks_per_node: int, bandwidth: Optional[float] = None,
                latency: Optional[float] = None) -> Cluster:
        """The cluster the profile predicts: its levels, the network's
        bandwidth and latency replaced where given. Raises ValueError naming
        the measurement that is missing."""
        intra = self.levels.get("intra")
        inter = self.levels.get("inter")
        if intra is None and ranks_per_node > 1:
            raise ValueError(
                f"a plan for {ranks_per_node} ranks per node needs the costs within a node, which "
                f"this profile did not measure ({self.ranks_per_node} rank(s) per node "
                "calibrated): calibrate with 2 or more ranks per node")
        if nodes > 1 and inter is None and (bandwidth is None or latency is None):
            raise ValueError(
                f"a plan for {nodes} nodes needs the network's costs, which this profile did not "
                f"measure ({self.nodes} node(s) calibrated): calibrate across 2 or more nodes, or "
                "give both --bandwidth and --latency")
        base_intra = intra.level if intra is not None else inter.level   # unused at 1 rank a node
        gamma = base_intra.gamma
        base_inter = inter.level if inter is not None else Level(0.0, 1.0, gamma)
        cl = Cluster(nodes, ranks_per_node, base_intra, base_inter)
        return cl.with_network(bandwidth=bandwidth, latency=latency)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)


def load(path: str, world_size: Optional[int] = None) -> Profile:
    """The profile at `path`; refuses one of another format or mpidp version,
    or (world_size given) of another world size, naming the difference."""
    with open(path) as f:
        try:
            raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"profile {path}: not a profile from python -m mpidp calibrate "
                             f"(not JSON: {exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"profile {path}: not a profile from python -m mpidp calibrate (a JSON "
                         f"{type(raw).__name__}, not an object)")
    if raw.get("format") != FORMAT:
        raise ValueError(f"profile {path}: format {raw.get('format')!r}, this mpidp reads "
                         f"format {FORMAT}: calibrate again")
    if raw.get("mpidp_version") != __version__:
        raise ValueError(f"profile {path}: made by mpidp {raw.get('mpidp_version')}, this is "
                         f"mpidp {__version__}: calibrate again with this version")
    if world_size is not None and raw["world_size"] != world_size:
        raise ValueError(f"profile {path}: calibrated at {raw['world_size']} ranks, this job has "
                         f"{world_size}: calibrate at this size")
    levels = {k: (None if v is None else LevelFit(
        v["ranks"], v["alpha"], v["beta"], v["gamma"], tuple(v["sizes"]),
        {kk: [tuple(x) for x in vv] for kk, vv in v["measured"].items()}, v["residuals"],
        v.get("wire_bf16", 0.0)))
        for k, v in raw["levels"].items()}
    return Profile(raw["mpidp_version"], raw["world_size"], raw["nodes"], raw["ranks_per_node"],
                   levels, raw["model"], raw["params"], raw["step_s"], raw["overlap"],
                   raw["format"], raw.get("notes", []), raw.get("overheads", {}))


def _fit_line(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(intercept, slope) of t = a + b n: the slope between the two largest
    messages (the bandwidth regime, where training's buckets are; a CPU's
    caches make smaller ones faster per byte), the intercept from the
    smallest (the latency regime). Both kept >= 0; with a slope the noise
    made negative, least squares on relative error over every point, and
    where that is not positive either (a loaded machine where every size
    took the same scheduling delay), the largest message's time over its
    size: a slow link, never an infinitely fast one."""
    pts = sorted(points)
    (n0, t0), (n1, t1), (n2, t2) = pts[0], pts[-2], pts[-1]
    if n2 > n1 and t2 > t1:
        b = (t2 - t1) / (n2 - n1)
    else:
        n = np.array([p[0] for p in pts], dtype=float)
        t = np.array([p[1] for p in pts], dtype=float)
        w = 1.0 / t
        b = float(np.linalg.lstsq(np.stack([w, n * w], axis=1), np.ones_like(t),
                                  rcond=None)[0][1])
    if b <= 0:
        b = t2 / n2
    return max(0.0, t0 - b * n0), b


def fit_level(p: int, measured: Dict[str, List[Tuple[float, float]]]) -> LevelFit:
    """alpha, beta from the allgather (ring: (p-1) alpha + (p-1)/p n beta, n
    its output), gamma from the allreduce's slope (2(p-1)/p beta + (p-1)/p
    gamma), and the residuals of costs.allreduce / allgather against every
    measurement."""
    if p < 2:
        raise ValueError(f"fit_level: a level of {p} rank has no communication to fit")
    a_g, b_g = _fit_line(measured["allgather"])
    alpha = a_g / (p - 1)
    beta = b_g * p / (p - 1)
    _, b_r = _fit_line(measured["allreduce"])
    gamma = max(0.0, (b_r - 2 * (p - 1) / p * beta) * p / (p - 1))
    wire_bf16 = _wire_bf16(p, Level(alpha, beta, gamma), measured.get("allreduce_bf16", []))
    level = Level(alpha, beta, gamma, wire_bf16)
    forms = {"allreduce": costs.allreduce, "allgather": costs.allgather,
             "allreduce_bf16": lambda p, n, lv: costs.wire_allreduce(p, n, lv, costs.BF16_WIRE)}
    residuals = {}
    for kind, points in measured.items():
        errors = [abs(forms[kind](p, n, level) - t) / t for n, t in points]
        residuals[kind] = {"median": float(np.median(errors)), "max": float(max(errors))}
    sizes = [n for pts in measured.values() for n, _ in pts]
    return LevelFit(p, alpha, beta, gamma, (min(sizes), max(sizes)), measured, residuals,
                    wire_bf16)


def _wire_bf16(p: int, level: Level, points: Sequence[Tuple[float, float]]) -> float:
    """Seconds per float32 byte that the bf16 wire's allreduce took beyond
    the level's allreduce of half the bytes: the mean over the two largest
    messages (where its conversions show); 0 where not measured."""
    largest = sorted(points)[-2:]
    extra = [(t - costs.allreduce(p, n / 2, level)) / n for n, t in largest]
    return max(0.0, float(np.mean(extra))) if extra else 0.0


def describe(fit: LevelFit) -> str:
    bw = 1.0 / fit.beta if fit.beta > 0 else math.inf
    red = 1.0 / fit.gamma if fit.gamma > 0 else math.inf
    res = ", ".join(f"{k} median {v['median']:.0%} max {v['max']:.0%}"
                    for k, v in fit.residuals.items())
    return (f"{fit.ranks} ranks: latency {fit.alpha * 1e6:.1f} us, bandwidth "
            f"{bw / 1e9:.3g} GB/s, reduction {red / 1e9:.3g} GB/s, a bf16 wire adds "
            f"{fit.wire_bf16 * 1e9:.3g} ns per float32 byte; fit's error: {res}")
