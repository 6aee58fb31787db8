"""The planner (python -m mpidp plan) against measured step times on the
emulated cluster (benchmarks/cluster, as root).

    .venv/bin/python benchmarks/bench_plan.py [--nodes 2,4] [--rates 10mbit,100mbit,1gbit]
        [--calibrate-at 100mbit,1gbit]
        [--methods dp,dp-bf16,diloco,eager,sparseloco,muloco,noloco,demo] [--json]

1. Calibrates (python -m mpidp calibrate) on 2 emulated nodes, one rank
   each, at the two --calibrate-at rates only. The network's per-byte cost
   is then fitted as beta(rate) = beta_0 + 1 / (eta x rate): eta the share of
   the shaped rate TCP achieves, beta_0 what the hosts' stacks add.
2. On every held-out cell (--nodes x --rates, one rank per node) runs each
   method for --steps steps of the same model (an MLP of --width, SGD) and
   measures its step time; the compute floor of the cell (no
   communication: the emulated nodes share this machine's cores, so it
   grows with the ranks) is measured too and given to the planner, as a
   user gives --step-ms.
3. Prints, per cell and method, the predicted and measured step times and
   the error; the median and worst absolute error; and whether the
   planner's recommendation is the measured fastest (or within 10% of it).
   For the methods that sync every --period steps, also what a sync costs
   beyond the compute floor, (measured - floor) x period, and that cost
   and the step time against DiLoCo's in the same cell.

The methods run the settings the planner is asked about (printed beside
each): their periods are short (--period) so that a run of --steps holds
several syncs. Without netem in the kernel the links have no added latency
(benchmarks/cluster/README.md), so delay is not on the grid."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "benchmarks" / "cluster"
RESULT_TAG = "BENCH_PLAN_RESULT "
CANNOT_RUN = 77
METHODS = ("dp", "dp-bf16", "diloco", "eager", "sparseloco", "muloco", "noloco", "demo")
PERIODIC = ("diloco", "eager", "sparseloco", "muloco", "noloco")   # a sync every --period steps


def log(msg: str) -> None:
    print(f"[bench_plan] {msg}", file=sys.stderr, flush=True)


# -- the worker: one method's steps on one rank ------------------------------------
def model(width: int = 256, depth: int = 4):
    """The benchmark's model and one rank's batch (also calibrate's --model)."""
    import torch
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers), torch.randn(32, width), torch.randn(32, width)


def calibration_model():
    return model(int(os.environ.get("BENCH_PLAN_WIDTH", "256")))


def worker(args) -> None:
    import torch
    import mpidp
    from mpidp import MPI
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    net, x, y = model(args.width)
    x = x + world.Get_rank()
    loss_fn = torch.nn.functional.mse_loss
    period = args.period
    driver = None
    if args.worker == "local":
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    elif args.worker in ("dp", "dp-bf16"):
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        net = mpidp.DataParallel(net, world, blocking_parameter_updates=True,
                                 wire_dtype=torch.bfloat16 if args.worker == "dp-bf16" else None)
    elif args.worker == "diloco":
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        driver = mpidp.DiLoCo(net, opt, outer, sync_every=period)
    elif args.worker == "eager":        # DiLoCo's outer SGD, the all-reduce under the next phase
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        driver = mpidp.EagerDiLoCo(net, opt, outer, sync_every=period)
    elif args.worker == "sparseloco":
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        driver = mpidp.SparseLoCo(net, opt, sync_every=period)
    elif args.worker == "muloco":       # the paper's outer SGD, every entry in 2-bit codes
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        outer = torch.optim.SGD(net.parameters(), lr=0.8, momentum=0.9, nesterov=True)
        driver = mpidp.MuLoCo(net, opt, outer, sync_every=period)
    elif args.worker == "noloco":       # the authors' outer SGD, pairs
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.5)
        driver = mpidp.NoLoCo(net, opt, outer, sync_every=period)
    elif args.worker == "demo":
        opt = mpidp.DeMo(net.parameters(), lr=1e-3)
    else:
        raise SystemExit(f"unknown method {args.worker}")
    if driver is not None:
        driver.__enter__()

    def step():
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    world.Barrier()
    times = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        t1 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t1)
    world.Barrier()
    # The mean over whole periods (a sync step is part of the cost); the
    # compute floor's median, which one slow step on shared cores cannot move.
    per_step = (statistics.median(times) if args.worker == "local"
                else (time.perf_counter() - t0) / args.steps)
    if driver is not None:
        driver.__exit__(None, None, None)
    params = sum(p.numel() for p in model(args.width)[0].parameters())
    if world.Get_rank() == 0:
        print(RESULT_TAG + json.dumps({"method": args.worker, "step_s": per_step,
                                       "params": params, "ranks": world.Get_size()}), flush=True)


# -- the driver ---------------------------------------------------------------------
def child_env(name: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "OPAL_"))}
    env.update(MPIDP_CLUSTER_NAME=name, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = str(ROOT / "benchmarks") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def on_cluster(args, nodes: int, rate: str, command, timeout: float, **env) -> str:
    cmd = [str(CLUSTER / "run.sh"), "--nodes", str(nodes), "--ranks-per-node", "1",
           "--rate", rate, "--", *map(str, command)]
    proc = subprocess.run(cmd, env=child_env(args.cluster, **env), cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode == CANNOT_RUN:
        log(proc.stdout.strip()[-500:])
        raise SystemExit(CANNOT_RUN)
    if proc.returncode != 0:
        raise SystemExit(f"[bench_plan] {' '.join(map(str, command[:4]))} at {nodes} nodes, "
                         f"{rate}: exit {proc.returncode}\n{proc.stdout[-3000:]}")
    return proc.stdout


def measure(args, nodes: int, rate: str, method: str) -> float:
    out = on_cluster(args, nodes, rate, [sys.executable, Path(__file__).resolve(), "--worker",
                                         method, "--steps", args.steps, "--warmup", args.warmup,
                                         "--width", args.width, "--period", args.period],
                     args.job_timeout)
    results = [json.loads(line[len(RESULT_TAG):]) for line in out.splitlines()
               if line.startswith(RESULT_TAG)]
    if len(results) != 1:
        raise SystemExit(f"[bench_plan] {method}: no result\n{out[-3000:]}")
    return results[0]["step_s"]


def calibrate(args, rate: str) -> "object":
    from mpidp.planning.profile import load
    path = Path(args.out) / f"plan_profile_{rate}.json"
    on_cluster(args, 2, rate, [sys.executable, "-m", "mpidp", "calibrate", "--out", path,
                               "--max-bytes", args.max_bytes, "--model",
                               "bench_plan:calibration_model", "--steps", 5],
               args.job_timeout, BENCH_PLAN_WIDTH=str(args.width))
    return load(str(path))


def network_fit(profiles: dict, parse) -> tuple:
    """(latency, eta, beta_0) from the inter-node fits at two rates:
    beta = beta_0 + 1 / (eta rate)."""
    (r1, p1), (r2, p2) = sorted(profiles.items(), key=lambda kv: parse(kv[0]))
    b1, b2 = p1.levels["inter"].beta, p2.levels["inter"].beta
    x1, x2 = 1 / parse(r1), 1 / parse(r2)
    slope = (b1 - b2) / (x1 - x2) if x1 != x2 else 1.0
    eta = 1 / slope if slope > 0 else 1.0
    beta0 = max(0.0, b2 - x2 / eta)
    latency = statistics.mean(p.levels["inter"].alpha for p in profiles.values())
    return latency, eta, beta0


def planner_algorithms(period: int):
    from mpidp.planning import algorithm_costs as alg
    return {"dp": alg.Algorithm("DataParallel", "fp32 wire", alg.data_parallel(alg.FP32)),
            "dp-bf16": alg.Algorithm("DataParallel", "bf16 wire", alg.data_parallel(alg.BF16)),
            "diloco": alg.Algorithm("DiLoCo", f"H={period}", alg.diloco(period, alg.FP32)),
            "eager": alg.Algorithm("Eager DiLoCo", f"H={period}",
                                   alg.eager_diloco(period, alg.FP32)),
            "sparseloco": alg.Algorithm("SparseLoCo", f"H={period}, top 128 of 64x64, 2-bit",
                                        alg.sparseloco(period, 128, 64, 4)),
            "muloco": alg.Algorithm("MuLoCo", f"H={period}, every entry 2-bit",
                                    alg.sparseloco(period, 64 * 64, 64, 4)),
            "noloco": alg.Algorithm("NoLoCo", f"H={period}, pairs", alg.noloco(period, 2)),
            "demo": alg.Algorithm("DeMo", "top 32 of 64x64 DCT", alg.demo(32, 64))}


def driver(args) -> None:
    from mpidp.planning import algorithm_costs as alg
    from mpidp.planning.plan import parse_bandwidth
    Path(args.out).mkdir(parents=True, exist_ok=True)
    cal_rates = args.calibrate_at.split(",")
    profiles = {r: calibrate(args, r) for r in cal_rates}
    latency, eta, beta0 = network_fit(profiles, parse_bandwidth)
    # CPU work, the same at every rate: the calibrations' mean.
    wire_bf16 = statistics.mean(p.levels["inter"].wire_bf16 for p in profiles.values())
    log(f"network fit: latency {latency * 1e6:.0f} us, TCP gets {eta:.0%} of the shaped rate, "
        f"hosts add {beta0 * 1e9:.3f} ns/byte; a bf16 wire adds {wire_bf16 * 1e9:.3f} ns "
        "per float32 byte")
    prof = profiles[cal_rates[0]]
    algos = planner_algorithms(args.period)
    rows = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for rate in args.rates.split(","):
            floor = measure(args, nodes, rate, "local")
            beta = beta0 + 1 / (eta * parse_bandwidth(rate))
            # The emulated nodes share this machine's cores: the algorithms'
            # own compute (the compression, the bf16 wire's conversions and
            # sums) slows as the training's does.
            slower = floor / prof.step_s
            cluster = prof.cluster(nodes, 1, bandwidth=1 / beta, latency=latency)
            cluster = dataclasses.replace(cluster, inter=dataclasses.replace(
                cluster.inter, wire_bf16=wire_bf16 * slower))
            work = alg.Workload(prof.params, floor, prof.overlap,
                                overheads={k: v * slower for k, v in prof.overheads.items()})
            cell = []
            for m in args.methods.split(","):
                measured = measure(args, nodes, rate, m)
                predicted = alg.predict(algos[m], cluster, work).step_s
                cell.append({"nodes": nodes, "rate": rate, "method": m,
                             "settings": algos[m].settings, "floor_s": floor,
                             "predicted_s": predicted, "measured_s": measured,
                             "error": (predicted - measured) / measured})
                log(f"{nodes} nodes, {rate}, {m}: predicted {predicted * 1e3:.1f} ms, measured "
                    f"{measured * 1e3:.1f} ms")
            fastest = min(cell, key=lambda r: r["measured_s"])
            chosen = min(cell, key=lambda r: r["predicted_s"])
            for r in cell:
                r["recommended"] = r is chosen
                r["recommendation_ok"] = chosen["measured_s"] <= 1.1 * fastest["measured_s"]
            rows += cell
    errors = [abs(r["error"]) for r in rows]
    cells = {(r["nodes"], r["rate"]): r["recommendation_ok"] for r in rows}
    summary = {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
               "recommendation_ok": sum(cells.values()), "cells": len(cells),
               "network": {"latency_s": latency, "eta": eta, "beta0": beta0,
                           "wire_bf16_s_per_byte": wire_bf16},
               "calibrated_at": cal_rates, "params": prof.params}
    (Path(args.out) / "bench_plan.json").write_text(json.dumps({"summary": summary, "rows": rows}))
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        print(json.dumps({"summary": summary, "rows": rows}))
        return
    print(f"{'nodes':>5} {'rate':>8} {'method':<11}{'predicted ms':>13}{'measured ms':>12}"
          f"{'error':>8}  settings")
    for r in rows:
        mark = "*" if r["recommended"] else " "
        print(f"{r['nodes']:>5} {r['rate']:>8} {mark}{r['method']:<10}"
              f"{r['predicted_s'] * 1e3:>13.1f}{r['measured_s'] * 1e3:>12.1f}"
              f"{r['error']:>8.0%}  {r['settings']}")
    syncs = [r for r in rows if r["method"] in PERIODIC]
    if syncs:
        print(f"\nper sync beyond the floor, (measured - floor) x {args.period}; step and sync "
              "against DiLoCo's in the same cell:")
        for r in syncs:
            base = next((d for d in rows if d["method"] == "diloco" and
                         (d["nodes"], d["rate"]) == (r["nodes"], r["rate"])), None)
            sync = (r["measured_s"] - r["floor_s"]) * args.period
            line = (f"{r['nodes']:>5} {r['rate']:>8} {r['method']:<11}{sync * 1e3:>9.1f} ms"
                    f"  step {r['measured_s'] / r['floor_s']:.3f}x the floor")
            if base is not None and base is not r:
                base_sync = (base["measured_s"] - base["floor_s"]) * args.period
                line += (f", sync {sync / base_sync:.2f}x DiLoCo's" if base_sync > 0 else "")
            print(line)
    print(f"\nstep time error: median {summary['median_abs_error']:.0%}, worst "
          f"{summary['worst_abs_error']:.0%} (goals: 10%, 25%); the recommendation (*) is the "
          f"measured fastest or within 10% of it in {summary['recommendation_ok']} of "
          f"{summary['cells']} cells (goal: 90%)")


def plot(rows, path: str) -> None:
    """Predicted against measured step time, one point per cell and method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 5.5))
    for m in sorted({r["method"] for r in rows}):
        pts = [r for r in rows if r["method"] == m]
        ax.scatter([r["measured_s"] * 1e3 for r in pts], [r["predicted_s"] * 1e3 for r in pts],
                   label=m, s=28)
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.5
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.5
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.15,
                    label="within 10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("mpidp plan on the emulated cluster")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--rates", default="10mbit,100mbit,1gbit")
    ap.add_argument("--calibrate-at", default="100mbit,1gbit")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--period", type=int, default=8,
                    help="DiLoCo's, SparseLoCo's, MuLoCo's and NoLoCo's H")
    ap.add_argument("--width", type=int, default=256, help="the MLP's width (4 layers)")
    ap.add_argument("--max-bytes", type=int, default=4 << 20, help="calibration's largest message")
    ap.add_argument("--job-timeout", type=float, default=900)
    ap.add_argument("--cluster", default="mpidpplan", help="the emulated cluster's name")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", default=None, help="draw predicted against measured to this PNG")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
