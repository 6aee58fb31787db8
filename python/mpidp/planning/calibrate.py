"""`python -m mpidp calibrate`: measure the allocation the job runs on and
fit the cost model to it (profile.py), under mpirun or srun at the ranks
of the allocation.

    srun python -m mpidp calibrate --out cluster.json
    mpirun -np 8 python -m mpidp calibrate --model mypkg.models:build

It times allreduce and allgather as mpidp's engines run them, from 1 KB to
--max-bytes: within a node (the node's ranks together, every node at once)
and across nodes (one rank per node, the others idle); then the step of a
model without communication (--model module:function returning (model,
inputs, targets); a 4-layer MLP otherwise), DataParallel's step on it over
every rank, from which the share of the allreduce hidden under the backward
follows, and the compute SparseLoCo's and DeMo's compression adds (each on
one rank alone). Rank 0 writes the profile and prints the fit and its
residuals."""

from __future__ import annotations

import argparse
import copy
import importlib
import math
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import _C
from .._version import __version__
from ..algorithms.data_parallel import DataParallel
from ..algorithms.demo import DeMo
from ..algorithms.sparseloco import SparseLoCo
from .._runtime.mpi import MPI
from .._runtime.topology import cross_node_comm, node_comm, topology
from . import costs
from .profile import Profile, describe, fit_level


def _sizes(max_bytes: int, quick: bool) -> List[int]:
    sizes, n = [], 1024
    while n <= max_bytes:
        sizes.append(n)
        n *= 4 if not quick else 16
    return sizes


def _time(comm, run: Callable[[], None], min_s: float, reps_max: int) -> float:
    """Seconds per call: the median of repetitions, the slowest rank's. The
    number of repetitions (at least 3, enough for min_s by the warm-up
    call's time, at most reps_max) is agreed by every rank first: each
    repetition is a collective."""
    comm.Barrier()
    t0 = time.perf_counter()
    run()                                  # warm-up (connections, buffers)
    first = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    reps = int(min(reps_max, max(3, math.ceil(min_s / max(first, 1e-9)))))
    samples = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
    return comm.allreduce(statistics.median(samples), op=MPI.MAX)


def measure_level(comm, sizes: List[int], min_s: float,
                  progress=None) -> Dict[str, List[Tuple[float, float]]]:
    """Allreduce (n bytes each) and allgather (n bytes out, n/p in) over
    `comm`, each as mpidp's engines run it: MPI's non-blocking allreduce
    (with the algorithm importing mpidp chose), the core's allreduce of
    float32 values over a bf16 wire (DataParallel's wire_dtype, Streaming
    DiLoCo's, DASO's global sync), and the core's allgather
    (point-to-point messages on up to 8 ranks, SparseLoCo's and DeMo's
    payload exchange)."""
    p = comm.Get_size()
    core = _C.Comm(comm)
    out: Dict[str, List[Tuple[float, float]]] = {"allreduce": [], "allreduce_bf16": [],
                                                 "allgather": []}
    for n in sizes:
        count = n // 4
        buf = np.ones(count, dtype=np.float32)
        out["allreduce"].append((float(count * 4), _time(
            comm, lambda: comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM).Wait(), min_s, 200)))
        values = torch.ones(count)
        out["allreduce_bf16"].append((float(count * 4), _time(
            comm, lambda: core.allreduce(values, _C.OP_SUM, _C.DTYPE_BF16, False), min_s, 200)))
        piece = max(1, count // p)
        send, recv = torch.ones(piece), torch.empty(piece * p)
        out["allgather"].append((float(piece * p * 4), _time(
            comm, lambda: core.allgather(send, recv), min_s, 200)))
        if progress is not None:
            progress(1)
    return out


def _default_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                                      torch.nn.ReLU()) for _ in range(4)])
    return model, torch.randn(64, 1024), torch.randn(64, 1024)


def load_model(spec: Optional[str]):
    """(model, inputs, targets, its name) from "module:function", or the default."""
    if spec is None:
        return (*_default_model(), "4 x Linear(1024), batch 64")
    module, _, fn = spec.partition(":")
    if not fn:
        raise ValueError(f"--model: expected module:function, got {spec!r}")
    made = getattr(importlib.import_module(module), fn)()
    if not (isinstance(made, tuple) and len(made) == 3):
        raise ValueError(f"--model {spec}: the function must return (model, inputs, targets)")
    return (*made, spec)


def _loss(out, targets):
    if targets.dtype in (torch.int64, torch.int32):
        return torch.nn.functional.cross_entropy(out, targets)
    return torch.nn.functional.mse_loss(out, targets)


def time_steps(model, inputs, targets, comm, steps: int, wrap=None, make_opt=None) -> float:
    """Seconds per training step (forward, backward, the optimizer's step:
    SGD unless make_opt gives another): the median over `steps`, the
    slowest rank's of `comm`."""
    net = wrap(model) if wrap is not None else model
    opt = make_opt(model) if make_opt is not None else torch.optim.SGD(model.parameters(), lr=1e-3)
    samples = []
    for i in range(steps + 2):
        comm.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        _loss(net(inputs), targets).backward()
        opt.step()
        if i >= 2:
            samples.append(time.perf_counter() - t0)
    return comm.allreduce(statistics.median(samples), op=MPI.MAX)


def calibrate(max_bytes: int = 64 << 20, model_spec: Optional[str] = None, steps: int = 10,
              min_s: float = 0.2, quick: bool = False) -> Optional[Profile]:
    """Measures and fits (collective over every rank); the profile on rank 0."""
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    topo = topology()
    local = node_comm()
    across = cross_node_comm()
    sizes = _sizes(max_bytes, quick)
    bar = _progress(rank == 0, len(sizes) * ((local.Get_size() > 1) + (topo.n_nodes > 1)) + 2)
    measured = {}
    if local.Get_size() > 1:
        measured["intra"] = measure_level(local, sizes, min_s, bar)
    world.Barrier()
    if topo.n_nodes > 1:
        if topo.local_rank == 0:
            measured["inter"] = measure_level(across, sizes, min_s, bar)
        elif bar is not None:
            bar(len(sizes))
    world.Barrier()
    model, inputs, targets, name = load_model(model_spec)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    step_s = time_steps(model, inputs, targets, world, steps)
    # Before DataParallel puts its hooks on the model: the copies must train alone.
    overheads = compression_overheads(model, inputs, targets, steps, step_s)
    if bar is not None:
        bar(1)
    dp_s = time_steps(model, inputs, targets, world, steps,
                      wrap=lambda m: DataParallel(m, world))
    if bar is not None:
        bar(1)
    if rank != 0:
        return None
    levels = {k: fit_level(_ranks_of(k, topo), v) for k, v in measured.items()}
    levels.setdefault("intra", None)
    levels.setdefault("inter", None)
    prof = Profile(__version__, world.Get_size(), topo.n_nodes, topo.local_size, levels, name,
                   params, step_s, 1.0, overheads=overheads)
    notes = []
    if world.Get_size() > 1:
        comm_s = costs.flat_allreduce(prof.cluster(topo.n_nodes, topo.local_size), params * 4)
        hidden = step_s + comm_s - dp_s
        window = min(comm_s, step_s * 2 / 3)
        prof.overlap = float(min(1.0, max(0.0, hidden / window))) if window > 0 else 1.0
        notes.append(f"DataParallel step {dp_s * 1e3:.2f} ms, without communication "
                     f"{step_s * 1e3:.2f} ms, predicted allreduce {comm_s * 1e3:.2f} ms")
    else:
        notes.append("one rank: no communication measured; overlap taken as 1")
    prof.notes = notes
    return prof


def compression_overheads(model, inputs, targets, steps: int, step_s: float) -> dict:
    """Seconds per parameter that DeMo adds to a step and SparseLoCo to a
    sync, by compressing: each run alone (MPI.COMM_SELF, nothing to send),
    the step's time less step_s (the plain SGD step's)."""
    self_comm = MPI.COMM_SELF
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out = {}
    demo = copy.deepcopy(model)
    out["DeMo"] = time_steps(demo, inputs, targets, self_comm, steps,
                             make_opt=lambda m: DeMo(m.parameters(), lr=1e-3, comm=self_comm))
    sparse = copy.deepcopy(model)
    inner = torch.optim.SGD(sparse.parameters(), lr=1e-3)
    with SparseLoCo(sparse, inner, sync_every=1, comm=self_comm):
        out["SparseLoCo"] = time_steps(sparse, inputs, targets, self_comm, steps,
                                       make_opt=lambda m: inner)
    world = MPI.COMM_WORLD
    return {k: world.allreduce(max(0.0, v - step_s), op=MPI.MAX) / params
            for k, v in out.items()}


def _ranks_of(level: str, topo) -> int:
    return topo.local_size if level == "intra" else topo.n_nodes


def _progress(on: bool, total: int):
    if not on:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = tqdm(total=total, desc="calibrating", file=sys.stderr, leave=False)
    return bar.update


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpidp calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="mpidp-profile.json", help="the profile to write")
    ap.add_argument("--max-bytes", type=int, default=64 << 20,
                    help="the largest message (default 64 MiB)")
    ap.add_argument("--model", default=None, help="module:function returning "
                    "(model, inputs, targets) for one rank's step")
    ap.add_argument("--steps", type=int, default=10, help="training steps timed (default 10)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes, shorter timings (tests)")
    args = ap.parse_args(argv)
    if args.max_bytes < 1024:
        ap.error(f"--max-bytes: at least 1024, got {args.max_bytes}")
    if args.steps < 1:
        ap.error(f"--steps: at least 1, got {args.steps}")
    prof = calibrate(args.max_bytes, args.model, args.steps, 0.05 if args.quick else 0.2,
                     args.quick)
    if prof is None:
        return 0
    prof.save(args.out)
    print(f"profile: {args.out} ({prof.world_size} ranks: {prof.nodes} node(s) x "
          f"{prof.ranks_per_node})")
    for name, fit in prof.levels.items():
        print(f"  {name}: " + (describe(fit) if fit else "not measured"))
    print(f"  step: {prof.model}, {prof.params / 1e6:.2f} M parameters, "
          f"{prof.step_s * 1e3:.2f} ms without communication; DataParallel hides "
          f"{prof.overlap:.0%} of its allreduce")
    for name, per_param in prof.overheads.items():
        print(f"  {name}'s compression: {per_param * prof.params * 1e3:.2f} ms "
              f"({'a step' if name == 'DeMo' else 'a sync'}, this model)")
    for note in prof.notes:
        print(f"  ({note})")
    return 0
