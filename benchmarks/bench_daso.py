"""DASO against torch DDP and mpidp.DataParallel on an emulated 2-node cluster.

    sudo .venv/bin/python benchmarks/bench_daso.py --rate 1gbit [--json]
    sudo .venv/bin/python benchmarks/bench_daso.py --rate 1gbit,100mbit,none
    .venv/bin/python benchmarks/bench_daso.py --report benchmarks/out/bench_daso_1gbit.json ...

Brings up an emulated cluster of 2 nodes (benchmarks/cluster/up.sh: network
namespaces, links shaped with tc tbf to --rate in each direction), then runs
every method as its own mpirun job of 4 ranks, 2 per node
(benchmarks/cluster/run.sh; --ranks-per-node 1: 2 ranks, one per node, so
that on a 2-core machine every rank has a core and no node-local average
runs), and reads the bytes that crossed the inter-node links before and after
each job (benchmarks/cluster/netstats.py). Every method trains the same model
(ResNet-18 for 32x32 inputs, channels scaled by --width, one input channel)
from the same seed on the same data: scikit-learn's digits, upscaled from 8x8
to 32x32, the same shards per rank and epoch (DistributedSampler), SGD with
momentum and a per-epoch cosine learning rate. Methods:

  ddp           torch DistributedDataParallel over all 4 ranks (gloo, its defaults)
  dp-block      mpidp.DataParallel, blocking, fp32 gradients on the wire
  dp-block-bf16 the same, gradients sent as bf16
  dp-nb         mpidp.DataParallel, non-blocking (update applied by the next forward)
  dp-nb-bf16    the same, gradients sent as bf16
  dp-block-u8   (not in the default set) blocking, gradients quantized to 8 bits
  dp-hier       (not in the default set) blocking, hierarchical: node reduce-
                scatter, slices across the nodes, node allgather
  dp-hier-u8    (not in the default set) the same with the cross-node phase
                quantized to 8 bits (Bagua's ByteGrad)
  qadam         (not in the default set) mpidp.algorithms.QAdamAlgorithm
                (hierarchical): Adam on averaged gradients for --qadam-warmup
                steps, then each rank's momentum averaged in 8 bits across the
                nodes; Adam's lr --qadam-lr on the same cosine schedule
  daso          mpidp.DASO + DataParallelMultiGPU: node-local DDP (gloo), bf16
                parameter syncs between the nodes; --warmup/--cooldown epochs
  local         (not in the default set) no communication at all: each rank
                trains alone on its shard; the compute floor
  localsgd      mpidp.SlowMoDistributedDataParallel without slow momentum: the
                node's ranks average gradients, the nodes average parameters
                every --local-every steps
  slowmo        the same with slow momentum 0.5 every --slow-every steps
  diloco        mpidp.DiLoCo, every rank a worker: an outer Nesterov step
                (--outer-lr 0.8, --outer-momentum 0.5) on the averaged outer
                gradient every --sync-every steps
  diloco-stream the same in 2 fragments taking turns, each sent --delay steps
                before its turn, bf16 on the wire
  sparseloco    mpidp.SparseLoCo, every rank a worker, the same inner SGD: every
                --sl-sync-every steps each rank sends the top --sl-top-k entries
                of each 64x64 tile of its error-feedback buffer as 2-bit codes
                (outer lr 1, error decay --sl-error-decay: the paper's run)
  eager         (not in the default set) mpidp.EagerDiLoCo: diloco's settings,
                the outer all-reduce under the next inner phase
  muloco        (not in the default set) mpidp.MuLoCo with the same inner SGD
                (ResNet's convolutions are 4-D: Muon takes matrices only) and
                diloco's outer SGD and period; every entry in 2-bit codes
  noloco        (not in the default set) mpidp.NoLoCo, pairs, the authors'
                outer SGD (lr 0.7, momentum 0.5), diloco's period
  desloc        (not in the default set) mpidp.DESLOC with AdamW (lr
                --adam-lr): parameters every --desloc-every steps, moments
                every 3 and 6 times that
  localadam     (not in the default set) the same with the three periods equal
                (Local Adam)
  demo          mpidp.DeMo instead of the SGD, no gradient allreduce: each step
                every rank sends the top --demo-topk DCT coefficients of each
                64x64 tile of its momentum; a sign step of lr --demo-lr
  sgp           (not in the default set) SlowMo's SGP base without slow
                momentum: node masters gossip every step
  decentralized (not in the default set) Bagua's DecentralizedAlgorithm, its
                defaults: the nodes' weights averaged every step (D-PSGD)
  decentralized-shift  the same, every rank a worker, one shift_one partner
                per step
  lowprec       (not in the default set) LowPrecisionDecentralizedAlgorithm:
                8-bit differences with the ring neighbours (nodes) every step
  async         (not in the default set) AsyncModelAverageAlgorithm: a
                background thread averages all ranks' weights every
                --sync-interval-ms while each rank trains on its own

Per method it reports the training time per epoch (test evaluation excluded),
total training time, final test accuracy (every rank evaluates a quarter of
the test set with its replica; the counts are summed), the bytes that crossed
the links during the whole job (launch and evaluation included; the
allreduce probe of the table's footer runs for the methods outside
SLOW_LINK_METHODS only) and, from
rank 0, where the time of a step went (forward, backward, optimizer step, as
measured around those calls) and how busy the 2 cores were. The results of
each rate are saved to benchmarks/out/bench_daso_<rate>.json; a plot of test
accuracy against training wall time, one panel per rate, goes to
benchmarks/out/daso_accuracy_vs_time.png (needs matplotlib; skipped with a
note without it). --report FILE... prints the table and draws the plot again
from saved results, with no cluster and no root.

The cluster is torn down at the end unless --keep-up. It is named
"mpidpbench" (MPIDP_CLUSTER_NAME overrides), so a cluster someone else uses is
left alone. Exits 77 where the cluster cannot be built (not root, no
namespaces, no Open MPI), with the reason.

The table's "to ddp-1" column is the training time a method took to first
reach DDP's final test accuracy minus 1 point (at an epoch end; "-" if never).

--json prints one line: for the first rate, ddp_epoch_s, daso_epoch_s,
ddp_acc, daso_acc, daso_over_ddp and <method>_{epoch_s,total_s,acc,link_mb,
to_target_s} for every method; results of further rates under "rates".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CLUSTER = HERE / "cluster"
OUT = HERE / "out"
NODES = 2
CANNOT_RUN = 77
RESULT_TAG = "BENCH_DASO_RESULT "
DEFAULT_METHODS = ("ddp", "dp-block", "dp-block-bf16", "dp-nb", "dp-nb-bf16", "daso")
SLOW_LINK_METHODS = ("localsgd", "slowmo", "diloco", "diloco-stream", "sparseloco", "demo",
                     "eager", "muloco", "noloco", "desloc", "localadam")
COMPRESSED_METHODS = ("dp-block-u8", "dp-hier", "dp-hier-u8", "qadam")
DECENTRALIZED_METHODS = ("sgp", "decentralized", "decentralized-shift", "lowprec", "async")
ALL_METHODS = (DEFAULT_METHODS + ("local",) + SLOW_LINK_METHODS + COMPRESSED_METHODS
               + DECENTRALIZED_METHODS)


# --------------------------------------------------------------------------- worker
# Runs inside the MPI job (one process per rank); imports torch and mpidp only here.

def worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch.utils.data.distributed import DistributedSampler

    sys.path.insert(0, str(HERE))
    import mpidp
    from models import ResNet18
    from mpidp import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    method = args.worker
    # Ranks outnumber cores here: one compute thread each.
    torch.set_num_threads(args.threads)

    # --- data: digits 8x8 -> 32x32 (bilinear), standardised; the same split everywhere
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(np.arange(len(y)), test_size=0.2,
                                           random_state=args.seed, stratify=digits.target)
    if args.train_images:
        train_idx = train_idx[:args.train_images]
    x_train, y_train = x[train_idx], y[train_idx]
    x_test, y_test = x[test_idx], y[test_idx]
    sampler = DistributedSampler(range(len(y_train)), num_replicas=size, rank=rank,
                                 shuffle=True, seed=args.seed)
    n_batches = math.ceil(len(sampler) / args.batch_size)
    my_test = torch.arange(rank, len(y_test), size)

    # --- model and method
    torch.manual_seed(args.seed)
    model = ResNet18(width=args.width, in_channels=1)
    n_params = sum(p.numel() for p in model.parameters())
    base_lr = {"qadam": args.qadam_lr, "demo": args.demo_lr, "desloc": args.adam_lr,
               "localadam": args.adam_lr}.get(method, args.lr)
    if method == "demo":
        inner = mpidp.DeMo(model.parameters(), lr=base_lr, compression_topk=args.demo_topk,
                           comm=comm)
    elif method == "qadam":
        from mpidp.algorithms import QAdamOptimizer
        inner = QAdamOptimizer(model.parameters(), lr=base_lr, warmup_steps=args.qadam_warmup,
                               weight_decay=5e-4)
    elif method in ("desloc", "localadam"):
        inner = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=5e-4)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=5e-4)
    daso = None
    sync = None              # completes a pending non-blocking update before the clock stops
    after_step = None        # SlowMo's perform_slowmo after every optimizer step
    if method == "ddp":
        mpidp.init_process_group(comm, backend="gloo")
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = inner
    elif method.startswith("dp-"):
        opt = mpidp.DataParallelOptimizer(inner)
        wire = (torch.bfloat16 if method.endswith("bf16") else
                torch.uint8 if method.endswith("u8") else None)
        net = mpidp.DataParallel(model, comm, opt,
                                 blocking_parameter_updates=not method.startswith("dp-nb"),
                                 wire_dtype=wire, hierarchical=method.startswith("dp-hier"))
        if method.startswith("dp-nb"):
            sync = net.synchronize
    elif method == "daso":
        daso = mpidp.DASO(inner, total_epochs=args.epochs, comm=comm,
                          warmup_epochs=args.warmup, cooldown_epochs=args.cooldown,
                          downcast_type=torch.bfloat16)
        net = mpidp.DataParallelMultiGPU(model, daso, comm=comm)
        daso.last_batch = n_batches - 1
        opt = daso
    elif method in ("local", "demo"):
        net, opt = model, inner
    elif method == "qadam":
        net = mpidp.with_bagua(model, [inner], mpidp.algorithms.QAdamAlgorithm(inner), comm)
        opt = inner
    elif method in ("decentralized", "decentralized-shift", "lowprec", "async"):
        algos = mpidp.algorithms
        algorithm = {"decentralized": lambda: algos.DecentralizedAlgorithm(),
                     "decentralized-shift": lambda: algos.DecentralizedAlgorithm(
                         hierarchical=False, peer_selection_mode="shift_one"),
                     "lowprec": lambda: algos.LowPrecisionDecentralizedAlgorithm(),
                     "async": lambda: algos.AsyncModelAverageAlgorithm(
                         sync_interval_ms=args.sync_interval_ms)}[method]()
        net, opt = mpidp.with_bagua(model, [inner], algorithm, comm), inner
    elif method == "sgp":
        net = mpidp.SlowMoDistributedDataParallel(
            model, comm=comm, slowmo_base_algorithm=mpidp.SlowMoBaseAlgorithm.SGP,
            slowmo_momentum=0.0)
        opt = inner
        after_step = lambda: net.perform_slowmo(inner)  # noqa: E731
    elif method in ("localsgd", "slowmo"):
        net = mpidp.SlowMoDistributedDataParallel(
            model, comm=comm, slowmo_momentum=0.5 if method == "slowmo" else 0.0,
            localsgd_frequency=args.local_every, slowmo_frequency=args.slow_every)
        opt = inner
        after_step = lambda: net.perform_slowmo(inner)  # noqa: E731
    elif method.startswith("diloco"):
        outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                                nesterov=args.outer_momentum > 0)
        stream = method == "diloco-stream"
        fragments = None
        if stream:  # the model's top-level blocks in two halves by parameter count
            blocks = [c for c in model.children() if any(True for _ in c.parameters())]
            sizes = [sum(p.numel() for p in c.parameters()) for c in blocks]
            cut = next(i for i in range(1, len(blocks)) if sum(sizes[:i]) * 2 >= sum(sizes))
            fragments = [torch.nn.ModuleList(blocks[:cut]), torch.nn.ModuleList(blocks[cut:])]
        diloco = mpidp.DiLoCo(model, inner, outer, args.sync_every, comm,
                              model_fragments=fragments,
                              fragment_sync_delay=args.delay if stream else 0,
                              wire_dtype=torch.bfloat16 if stream else None)
        diloco.__enter__()     # syncs after the inner optimizer's steps from here on
        net, opt = model, inner
    elif method in ("eager", "muloco", "noloco"):
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5) if method == "noloco" \
            else torch.optim.SGD(model.parameters(), lr=args.outer_lr,
                                 momentum=args.outer_momentum, nesterov=args.outer_momentum > 0)
        make = {"eager": mpidp.EagerDiLoCo, "muloco": mpidp.MuLoCo, "noloco": mpidp.NoLoCo}[method]
        make(model, inner, outer, args.sync_every, comm).__enter__()
        net, opt = model, inner
    elif method in ("desloc", "localadam"):
        k = args.desloc_every
        mpidp.DESLOC(model, inner, k, comm, exp_avg_every=k if method == "localadam" else 3 * k,
                     exp_avg_sq_every=k if method == "localadam" else 6 * k).__enter__()
        net, opt = model, inner
    elif method == "sparseloco":
        mpidp.SparseLoCo(model, inner, args.sl_sync_every, comm, top_k=args.sl_top_k,
                         error_decay=args.sl_error_decay).__enter__()
        net, opt = model, inner
    else:
        raise SystemExit(f"unknown method {method!r}")
    topo = mpidp.topology(comm)

    def allreduce_ms(fn, reps=3):
        """Median wall time of an fp32 allreduce of the model's gradient size."""
        flat = torch.zeros(n_params)
        times = []
        for _ in range(reps + 1):
            comm.Barrier()
            t = time.perf_counter()
            fn(flat)
            times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
        return 1e3 * sorted(times[1:])[reps // 2]

    probe = {}
    # The probe moves 4 gradients' worth of bytes: the methods that send little
    # skip it, so that the bytes counted across the link are their own.
    if method not in ("local",) + SLOW_LINK_METHODS and size > 1:
        probe["mpi_allreduce_ms"] = allreduce_ms(lambda t: mpidp.allreduce(t, comm=comm))
        if dist.is_initialized() and dist.get_world_size() == size:
            probe["gloo_allreduce_ms"] = allreduce_ms(dist.all_reduce)

    def set_lr(epoch):  # cosine over the epochs, per epoch, the same for every method
        lr = base_lr * 0.5 * (1.0 + math.cos(math.pi * epoch / args.epochs))
        for group in inner.param_groups:
            group["lr"] = lr

    @torch.no_grad()
    def accuracy():
        net.eval()               # a non-blocking DataParallel finishes its update here
        correct = 0
        for chunk in my_test.split(128):
            correct += (net(x_test[chunk]).argmax(1) == y_test[chunk]).sum().item()
        net.train()
        return 100.0 * comm.allreduce(correct) / len(y_test)

    def cpu_seconds():
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    def machine_busy_seconds():
        """CPU seconds the whole machine has been busy (all processes, all
        cores, from /proc/stat), or None where that cannot be read."""
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    clock = time.perf_counter
    history = []             # per epoch: train seconds, cumulative train seconds, acc, loss, phase
    parts = {"fwd": 0.0, "bwd": 0.0, "step": 0.0, "data": 0.0}
    elapsed = 0.0
    cpu_start = cpu_seconds()
    comm.Barrier()
    busy_start = machine_busy_seconds()
    loop_start = clock()
    for epoch in range(args.epochs):
        set_lr(epoch)
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), dtype=torch.long)
        phase = daso.phase if daso is not None else method
        gs, btw = (daso.global_skip, daso.batches_to_wait) if daso is not None else (None, None)
        loss_sum = torch.zeros(2, dtype=torch.float64)
        parts_before = dict(parts)
        comm.Barrier()
        t0 = clock()
        for b in range(n_batches):
            ta = clock()
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            xb, yb = x_train[idx], y_train[idx]
            opt.zero_grad()
            tb = clock()
            loss = F.cross_entropy(net(xb), yb)
            tc = clock()
            loss.backward()
            td = clock()
            opt.step()
            if after_step is not None:
                after_step()
            te = clock()
            parts["data"] += tb - ta
            parts["fwd"] += tc - tb
            parts["bwd"] += td - tc
            parts["step"] += te - td
            loss_sum[0] += loss.item() * len(yb)
            loss_sum[1] += len(yb)
        if sync is not None:
            sync()
        comm.Barrier()
        dt = clock() - t0
        elapsed += dt
        # Off the clock: the epoch's loss over all ranks, DASO's epoch logic, the test.
        comm.Allreduce(MPI.IN_PLACE, loss_sum.numpy(), op=MPI.SUM)
        mean_loss = (loss_sum[0] / loss_sum[1]).item()
        if daso is not None:
            daso.epoch_loss_logic(mean_loss, loss_globally_averaged=True)
        acc = accuracy()
        history.append({"epoch": epoch, "train_s": dt, "wall_s": elapsed, "acc": acc,
                        "loss": mean_loss, "phase": phase,
                        "global_skip": gs, "batches_to_wait": btw,
                        "parts_ms": {k: 1e3 * (parts[k] - parts_before[k]) / n_batches
                                     for k in parts}})
        if rank == 0:
            print(f"  {method} epoch {epoch}: {phase:<8} {dt:7.2f} s  loss {mean_loss:.4f}  "
                  f"test accuracy {acc:6.2f}%", file=sys.stderr, flush=True)
    cpu = comm.allreduce(cpu_seconds() - cpu_start)
    busy_end = machine_busy_seconds()
    loop_s = clock() - loop_start      # training and the evaluations between epochs
    daso_bytes = comm.allreduce(daso.bytes_sent) if daso is not None else None
    hosts = sorted(set(comm.allgather(MPI.Get_processor_name())))
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        steps = args.epochs * n_batches
        result = {
            "method": method, "ranks": size, "nodes": topo.n_nodes, "local_size": topo.local_size,
            "hosts": hosts,
            "params": n_params, "grad_mb": 4 * n_params / 1e6,
            "epochs": args.epochs, "batches_per_epoch": n_batches, "batch_size": args.batch_size,
            "train_images": len(y_train), "test_images": len(y_test),
            "total_s": elapsed, "epoch_s": elapsed / args.epochs,
            "step_ms": 1e3 * elapsed / steps,
            "parts_ms": {k: 1e3 * v / steps for k, v in parts.items()},
            "cpu_busy": cpu / (loop_s * (os.cpu_count() or 1)),
            # What the rest of the machine used meanwhile (other jobs, and the
            # kernel's work for the emulated links), as a share of all cores.
            "cpu_other": ((busy_end - busy_start - cpu) / (loop_s * (os.cpu_count() or 1))
                          if None not in (busy_start, busy_end) else None),
            "final_acc": history[-1]["acc"], "history": history,
            "daso_wire_bytes": daso_bytes, **probe,
        }
        print(RESULT_TAG + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- driver

def log(msg: str) -> None:
    print(f"[bench_daso] {msg}", file=sys.stderr, flush=True)


def load_netstats():
    sys.path.insert(0, str(CLUSTER))
    import netstats  # noqa: E402
    return netstats


def child_env(name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "OPAL_"))}
    env["MPIDP_CLUSTER_NAME"] = name
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def cluster_script(name: str, script: str, *args, timeout=300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(CLUSTER / script), *map(str, args)], env=child_env(name), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if proc.returncode == CANNOT_RUN:
        log(f"{script}: {proc.stdout.strip()}")
        raise SystemExit(CANNOT_RUN)
    if proc.returncode != 0:
        raise SystemExit(f"[bench_daso] {script} {' '.join(map(str, args))} failed "
                         f"({proc.returncode}):\n{proc.stdout}")
    return proc


def run_method(args, name: str, method: str, netstats) -> dict:
    worker_args = [sys.executable, str(Path(__file__).resolve()), "--worker", method,
                   "--epochs", args.method_epochs.get(method, args.epochs), "--batch-size", args.batch_size, "--width", args.width,
                   "--lr", args.lr, "--seed", args.seed, "--warmup", args.warmup,
                   "--cooldown", args.cooldown, "--threads", args.threads,
                   "--train-images", args.train_images, "--local-every", args.local_every,
                   "--slow-every", args.slow_every, "--sync-every", args.sync_every,
                   "--delay", args.delay, "--outer-lr", args.outer_lr,
                   "--outer-momentum", args.outer_momentum, "--qadam-lr", args.qadam_lr,
                   "--qadam-warmup", args.qadam_warmup,
                   "--sync-interval-ms", args.sync_interval_ms,
                   "--sl-sync-every", args.sl_sync_every, "--sl-top-k", args.sl_top_k,
                   "--sl-error-decay", args.sl_error_decay, "--demo-lr", args.demo_lr,
                   "--demo-topk", args.demo_topk]
    mpirun_opts = list(args.mpirun_args)
    if method == "ddp":
        # The global gloo group's TCP store is opened by rank 0 on node 0's
        # cluster address, where the ranks of every node can reach it.
        mpirun_opts += ["-x", "MPIDP_STORE_ADDR=198.18.0.1"]
    cmd = [str(CLUSTER / "run.sh"), "--nodes", str(NODES),
           "--ranks-per-node", str(args.ranks_per_node), *mpirun_opts, "--", *map(str, worker_args)]
    before = netstats.snapshot(name)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=child_env(name), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=None, text=True, start_new_session=True)
    # A hung job must not hang the benchmark: end run.sh's process group
    # (mpirun takes its daemons and ranks with it) after --job-timeout.
    watchdog = threading.Timer(args.job_timeout, os.killpg, (proc.pid, signal.SIGTERM))
    watchdog.start()
    lines = []
    for line in proc.stdout:      # rank 0's per-epoch lines go to stderr, live
        lines.append(line)
    rc = proc.wait()
    watchdog.cancel()
    job_s = time.perf_counter() - t0
    traffic = netstats.delta(before, netstats.snapshot(name))
    results = [json.loads(line[len(RESULT_TAG):]) for line in lines if line.startswith(RESULT_TAG)]
    if rc != 0 or len(results) != 1:
        raise SystemExit(f"[bench_daso] {method}: the job exited {rc} without a result:\n"
                         + "".join(lines[-40:]))
    result = results[0]
    if result["nodes"] != NODES or result["local_size"] != args.ranks_per_node:
        raise SystemExit(f"[bench_daso] {method}: ranks saw {result['nodes']} nodes x "
                         f"{result['local_size']}, expected {NODES} x {args.ranks_per_node}")
    result["job_s"] = job_s
    # Other work on the machine competes for its cores: keep the 1-minute load
    # average at the start and end of the job with the result.
    result["loadavg"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    result["link_bytes"] = traffic["total_bytes"]
    return result


def run_rate(args, name: str, rate: str, netstats, saved: Path) -> dict:
    log(f"cluster {name}: {NODES} nodes, rate {rate}")
    cluster_script(name, "up.sh", "--nodes", NODES, "--rate", rate)
    res = {"rate": rate, "config": {k: getattr(args, k) for k in (
               "epochs", "batch_size", "width", "lr", "seed", "warmup", "cooldown", "threads",
               "train_images", "mpirun_args", "repeat", "method_epochs", "ranks_per_node")},
           "runs": {}, "repeats": {}}
    for rep in range(args.repeat):
        # Repeats alternate the order of the methods, so a drift in what else
        # the machine is doing weighs on every method alike.
        for method in (args.methods if rep % 2 == 0 else args.methods[::-1]):
            log(f"{method} at {rate}: {NODES} nodes x {args.ranks_per_node} ranks, "
                f"{args.method_epochs.get(method, args.epochs)} epochs"
                + (f" (repeat {rep + 1} of {args.repeat})" if args.repeat > 1 else ""))
            r = run_method(args, name, method, netstats)
            runs = res["repeats"].setdefault(method, [])
            runs.append(r)
            # The run with the median time per epoch stands for the method.
            res["runs"][method] = sorted(runs, key=lambda x: x["epoch_s"])[(len(runs) - 1) // 2]
            res["runs"] = {m: res["runs"][m] for m in args.methods if m in res["runs"]}
            res.update(model={"params": r["params"], "grad_mb": r["grad_mb"]},
                       batches_per_epoch=r["batches_per_epoch"], train_images=r["train_images"])
            saved.write_text(json.dumps(res, indent=1))   # after every job: a crash keeps the rest
            log(f"{method} at {rate}: {r['epoch_s']:.2f} s/epoch, accuracy {r['final_acc']:.2f}%, "
                f"{r['link_bytes'] / 1e6:.1f} MB between the nodes (load average {r['loadavg']})")
    return res


def to_target_s(run: dict, ddp: dict):
    """Training seconds until `run` first reached DDP's final accuracy minus 1
    point at an epoch end, or None (also without a ddp run)."""
    if ddp is None:
        return None
    goal = ddp["final_acc"] - 1.0
    return next((e["wall_s"] for e in run["history"] if e["acc"] >= goal), None)


def per_node(res: dict) -> int:
    """The ranks per node of saved results (files saved before the option: 2)."""
    return res["config"].get("ranks_per_node", 2)


def table(res: dict) -> str:
    runs = res["runs"]
    ref = runs.get("ddp")
    cfg = res["config"]
    ranks = NODES * per_node(res)
    lines = [f"rate {res['rate']}: {NODES} nodes x {per_node(res)} ranks, ResNet-18 width "
             f"{cfg['width']} ({res['model']['params'] / 1e6:.2f} M parameters, "
             f"{res['model']['grad_mb']:.1f} MB fp32), {res['train_images']} training images, "
             f"{res['batches_per_epoch']} batches of {cfg['batch_size']} per rank per epoch, "
             f"{cfg['epochs']} epochs"
             + "".join(f", {m} {n}" for m, n in (cfg.get("method_epochs") or {}).items())
             + (f", mpirun {' '.join(cfg['mpirun_args'])}" if cfg.get("mpirun_args") else ""),
             f"{'method':<14}{'s/epoch':>9}{'vs ddp':>8}{'total s':>9}{'acc %':>8}"
             f"{'to ddp-1':>9}{'link MB':>9}{'ms/step':>9}{'fwd':>7}{'bwd':>7}{'step':>7}"
             f"{'cpu':>6}{'other':>6}"]
    for m, r in runs.items():
        p = r["parts_ms"]
        vs = f"{r['epoch_s'] / ref['epoch_s']:8.3f}" if ref else f"{'-':>8}"
        other = f"{100 * r['cpu_other']:5.0f}%" if r.get("cpu_other") is not None else f"{'-':>6}"
        target = to_target_s(r, ref)
        target = f"{target:9.1f}" if target is not None else f"{'-':>9}"
        lines.append(f"{m:<14}{r['epoch_s']:9.2f}{vs}{r['total_s']:9.1f}{r['final_acc']:8.2f}"
                     f"{target}{r['link_bytes'] / 1e6:9.1f}{r['step_ms']:9.1f}{p['fwd']:7.1f}"
                     f"{p['bwd']:7.1f}{p['step']:7.1f}{100 * r['cpu_busy']:5.0f}%{other}")
    reps = res.get("repeats") or {}
    if any(len(v) > 1 for v in reps.values()):
        lines.append("repeats (s/epoch; the median run is shown above): " + "; ".join(
            f"{m} " + " ".join(f"{r['epoch_s']:.2f}" for r in v) for m, v in reps.items()))
    if "daso" in runs:
        h = runs["daso"]["history"]
        lines.append("daso per epoch: " + ", ".join(
            f"{e['phase']}{'' if e['global_skip'] is None else '/gs' + str(e['global_skip'])}"
            f" {e['train_s']:.1f}s" for e in h))
    probes = [f"{k.split('_')[0]} {r[k]:.0f} ms ({m})" for m, r in runs.items()
              for k in ("gloo_allreduce_ms", "mpi_allreduce_ms") if k in r]
    if probes:
        lines.append(f"one fp32 allreduce of the gradients over the {ranks} ranks: "
                     + ", ".join(probes))
    lines.append("fwd/bwd/step: rank 0's mean ms per batch inside forward, backward and "
                 f"optimizer step; cpu: CPU time of the {ranks} ranks / (wall time x cores); "
                 "other: CPU time of everything else on the machine (other jobs, kernel work "
                 "for the links) / (wall time x cores), both over the epochs' loop")
    return "\n".join(lines)


def summary(results: list) -> dict:
    def flat(res):
        out = {"rate": res["rate"]}
        for m, r in res["runs"].items():
            key = m.replace("-", "_")
            out[f"{key}_epoch_s"] = round(r["epoch_s"], 3)
            out[f"{key}_total_s"] = round(r["total_s"], 2)
            out[f"{key}_acc"] = round(r["final_acc"], 2)
            out[f"{key}_link_mb"] = round(r["link_bytes"] / 1e6, 2)
            target = to_target_s(r, res["runs"].get("ddp"))
            out[f"{key}_to_target_s"] = None if target is None else round(target, 2)
        if "ddp" in res["runs"] and "daso" in res["runs"]:
            out["daso_over_ddp"] = round(res["runs"]["daso"]["epoch_s"]
                                         / res["runs"]["ddp"]["epoch_s"], 3)
        return out

    out = flat(results[0])
    if len(results) > 1:
        out["rates"] = {res["rate"]: flat(res) for res in results[1:]}
    return out


def plot(results: list, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no matplotlib: plot skipped (.venv/bin/pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    for ax, res in zip(axes[0], results):
        for m, r in res["runs"].items():
            t = [0.0] + [e["wall_s"] for e in r["history"]]
            acc = [None] + [e["acc"] for e in r["history"]]
            style = {"linewidth": 2.5} if m in ("daso", "ddp") else {"linewidth": 1.2}
            ax.plot(t[1:], acc[1:], marker="o", markersize=3, label=m, **style)
        ax.set_title(f"{NODES} nodes x {per_node(res)} ranks, link {res['rate']}")
        ax.set_xlabel("training wall time, s (test evaluation excluded)")
        ax.set_ylabel("test accuracy, %")
        ax.grid(alpha=0.3)
        lo = min(e["acc"] for r in res["runs"].values() for e in r["history"])
        ax.set_ylim(max(0.0, min(lo, 90.0) - 2), 100.5)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def report(results: list, args) -> None:
    if args.json:
        print(json.dumps(summary(results)), flush=True)
    else:
        for res in results:
            print(table(res), flush=True)
            print(flush=True)
    plot(results, Path(args.plot))


def driver(args) -> None:
    if args.report:
        results = [json.loads(Path(f).read_text()) for f in args.report]
        report(results, args)
        return
    name = os.environ.get("MPIDP_CLUSTER_NAME") or "mpidpbench"
    if os.geteuid() != 0:
        log(f"cannot run here: the emulated cluster needs root (you are uid {os.geteuid()}); "
            "run: sudo .venv/bin/python benchmarks/bench_daso.py ...")
        raise SystemExit(CANNOT_RUN)
    if not shutil.which("mpirun"):
        log("cannot run here: no mpirun (Debian: apt-get install openmpi-bin)")
        raise SystemExit(CANNOT_RUN)
    netstats = load_netstats()
    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    start = time.perf_counter()
    try:
        for rate in args.rate:
            saved = OUT / f"bench_daso_{re.sub(r'[^A-Za-z0-9.]+', '_', rate)}{args.tag}.json"
            results.append(run_rate(args, name, rate, netstats, saved))
            log(f"results saved: {saved}")
    finally:
        if not args.keep_up:
            subprocess.run([str(CLUSTER / "down.sh")], env=child_env(name), cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log(f"done in {time.perf_counter() - start:.0f} s")
    report(results, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--rate", default="1gbit",
                        help="link rate(s), comma-separated, each a tc rate or 'none' (default 1gbit)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma-separated, from {','.join(ALL_METHODS)}")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--epochs-of", default="", metavar="METHOD=N,...",
                        help="other epoch counts for some methods, e.g. diloco=24: the "
                             "methods that communicate little can train longer in DDP's time; "
                             "the cosine lr spans each method's own epochs")
    parser.add_argument("--warmup", type=int, default=1, help="DASO warm-up epochs")
    parser.add_argument("--cooldown", type=int, default=1, help="DASO cool-down epochs")
    parser.add_argument("--local-every", type=int, default=3,
                        help="localsgd/slowmo: steps between parameter averages (fairscale's 3)")
    parser.add_argument("--slow-every", type=int, default=48,
                        help="slowmo: steps between slow momentum steps (fairscale's 48)")
    parser.add_argument("--sync-every", type=int, default=48,
                        help="diloco: inner steps between outer steps")
    # DiLoCo's own 0.7 / 0.9 fit hundreds of outer steps; this benchmark takes 8
    # (one per epoch), where momentum 0.9 overshoots: 22% test accuracy at a
    # training loss of 0.24. 0.8 / 0.5 gave 95.8% (chosen on this benchmark).
    parser.add_argument("--outer-lr", type=float, default=0.8,
                        help="diloco: the outer SGD's lr (DiLoCo's paper: 0.7)")
    parser.add_argument("--outer-momentum", type=float, default=0.5,
                        help="diloco: the outer SGD's Nesterov momentum (the paper: 0.9; 0: none)")
    parser.add_argument("--delay", type=int, default=4,
                        help="diloco-stream: steps between a fragment's send and its turn")
    parser.add_argument("--sl-sync-every", type=int, default=12,
                        help="sparseloco: inner steps between syncs (its authors run 15-30)")
    parser.add_argument("--sl-top-k", type=int, default=128,
                        help="sparseloco: entries sent per 64x64 tile (the paper's 128: 3.1%%)")
    parser.add_argument("--sl-error-decay", type=float, default=0.95,
                        help="sparseloco: the error-feedback decay (the paper's 0.95)")
    parser.add_argument("--demo-lr", type=float, default=2e-3,
                        help="demo: the sign step's lr, on the same cosine schedule")
    parser.add_argument("--demo-topk", type=int, default=32,
                        help="demo: DCT coefficients sent per 64x64 tile (DeMo's 32)")
    parser.add_argument("--adam-lr", type=float, default=2e-3,
                        help="desloc, localadam: AdamW's lr, on the same cosine schedule")
    parser.add_argument("--desloc-every", type=int, default=48,
                        help="desloc, localadam: steps between parameter averages")
    parser.add_argument("--qadam-lr", type=float, default=1e-3, help="qadam: Adam's lr (Bagua's)")
    parser.add_argument("--qadam-warmup", type=int, default=100,
                        help="qadam: steps of Adam on averaged gradients (Bagua's 100)")
    parser.add_argument("--sync-interval-ms", type=int, default=500,
                        help="async: the background thread's pause between averages (Bagua's)")
    parser.add_argument("--ranks-per-node", type=int, choices=(1, 2), default=2,
                        help="2: 4 ranks, 2 per node (the default); 1: 2 ranks, so that on a "
                             "2-core machine every rank has a core of its own")
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--width", type=int, default=32, help="ResNet-18 channels of the stem")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--train-images", type=int, default=768,
                        help="use the first N of the 1437 training images (0: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--job-timeout", type=float, default=1200,
                        help="seconds one method's job may take before it is ended")
    parser.add_argument("--mpirun-args", default="",
                        help="extra mpirun options for every job, one string, e.g. "
                             "'-x OMPI_MCA_coll_libnbc_iallreduce_algorithm=0' (Open MPI's own "
                             "choice instead of mpidp's default, Rabenseifner)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every method N times (alternating the order); report the median")
    parser.add_argument("--tag", default="", help="suffix of the saved results' file names")
    parser.add_argument("--keep-up", action="store_true", help="leave the cluster up at the end")
    parser.add_argument("--plot", default=str(OUT / "daso_accuracy_vs_time.png"))
    parser.add_argument("--report", nargs="+", metavar="FILE",
                        help="no runs: table/JSON and plot from saved bench_daso_<rate>.json files")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    args.mpirun_args = args.mpirun_args.split()
    args.rate = [r.strip() for r in args.rate.split(",") if r.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.method_epochs = {}
    for item in filter(None, (i.strip() for i in args.epochs_of.split(","))):
        m, _, n = item.partition("=")
        if m not in ALL_METHODS or not n.isdigit() or int(n) < 1:
            parser.error(f"--epochs-of: expected METHOD=N with a method of {ALL_METHODS} "
                         f"and N >= 1, got {item!r}")
        args.method_epochs[m] = int(n)
    bad = [m for m in args.methods if m not in ALL_METHODS]
    if bad:
        parser.error(f"unknown method(s) {bad}; choose from {ALL_METHODS}")
    if args.warmup + args.cooldown >= args.epochs:
        log(f"note: warm-up {args.warmup} + cool-down {args.cooldown} >= {args.epochs} epochs: "
            "DASO never leaves its blocking phases")
    driver(args)


if __name__ == "__main__":
    main()
