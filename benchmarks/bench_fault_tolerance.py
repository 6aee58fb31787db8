"""Fault-tolerant mode (MPIDP_FAULT_TOLERANCE=1, ULFM): what a lost rank costs,
and what the mode costs when no rank is lost.

    python benchmarks/bench_fault_tolerance.py [--ranks 4] [--rounds 3] [--steps 20] [--quick]

Runs jobs under scripts/mpirun_ft.sh (Open MPI 5 with ULFM, .venv-ft; run
scripts/setup_ft_env.sh first) from this one process, taking turns:

1. Step time of blocking mpidp.DataParallel on bench_step.py's models (the
   500-tensor MLP, ResNet-18), and of DASO in its warm-up on the MLP (emulated
   nodes of 2 ranks), SGD with momentum, every rank's slowest median counting: launched with ULFM and fault-tolerant mode on, against
   the same launch with the mode off (MPIDP_FAULT_TOLERANCE=0), and a launch
   without ULFM (plain mpirun of the same Open MPI, mode off).
   With --algorithms, the same for every other algorithm (those that sync
   every SYNC_EVERY steps: DiLoCo, Streaming DiLoCo (two fragments, each
   sent a step before its turn), SparseLoCo, PostLocalSGD's averager,
   with_bagua's LocalSGD, SlowMo; those that communicate every step: DeMo,
   Bagua's decentralized algorithms and QAdam, torch's DDP on the "mpidp"
   backend by the recipe of docs/fault-tolerance.md), on the MLP, each in a
   job of its own (in one job after the others their times drifted by up to
   10 % between the kinds of launch, more than the mode's cost);
   --algorithms=a,b names some of them.
2. Recovery: the last rank SIGKILLs itself in the middle of a backward pass
   (gradient buckets in flight); the survivors' times from the kill (a clock
   reading the victim wrote just before) to RanksLost (detection), through
   recover()'s phases (agreement, shrink, rebuild over the survivors), to the
   end of their first step at the new size; and how many steps' work was
   lost (steps begun and not applied). Then the same with recover(replace=
   True): a replacement is spawned (its start-up, Python and torch imports
   included, is the "spawn" phase) and the job goes on at its full size.
   The same loss under each algorithm of step 1 (shrinking; with --grow
   also growing back): for the
   ones that sync every SYNC_EVERY steps, the survivors find the loss at
   the next sync, so "detection" includes the inner steps up to it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FT_PYTHON = os.path.join(ROOT, ".venv-ft", "bin", "python")


SYNC_EVERY = 4
# The algorithms timed beside DataParallel, and what each step steps.
# "torch ddp" is torch's DistributedDataParallel on the "mpidp" backend by
# the recipe of docs/fault-tolerance.md (the step's agreement before the
# optimizer steps; DDP built again after recover()).
ALGORITHMS = ("diloco", "streaming diloco", "sparseloco", "demo", "decentralized",
              "lowprecision", "qadam", "postlocalsgd", "localsgd", "slowmo", "torch ddp")


# -- the workers (run on every rank) -------------------------------------------

def build_algorithm(name, model, mpidp, torch):
    """(module to call, optimizer to step, what to detach afterwards, what
    gives the module to call after recover() or None: the same) for `name`
    ("dataparallel" or one of ALGORITHMS) on `model`."""
    built = _build_algorithm(name, model, mpidp, torch)
    return built if len(built) == 4 else built + (None,)


def _build_algorithm(name, model, mpidp, torch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    algorithms = mpidp.algorithms
    if name == "dataparallel":
        net = mpidp.DataParallel(model)
        return net, opt, net.detach
    if name == "lowprecision":
        net = mpidp.with_bagua(model, [opt], algorithms.LowPrecisionDecentralizedAlgorithm(
            hierarchical=False))
        return net, opt, net.bagua_driver.detach
    if name == "qadam":
        opt = algorithms.QAdamOptimizer(model.parameters(), lr=0.001, warmup_steps=2)
        net = mpidp.with_bagua(model, [opt], algorithms.QAdamAlgorithm(opt, hierarchical=False))
        return net, opt, net.bagua_driver.detach
    if name == "postlocalsgd":
        return model, mpidp.PostLocalSGDOptimizer(
            opt, mpidp.PeriodicModelAverager(period=SYNC_EVERY)), lambda: None
    if name == "localsgd":
        net = mpidp.with_bagua(model, [opt], algorithms.LocalSGDAlgorithm(period=SYNC_EVERY))
        return net, opt, net.bagua_driver.detach
    if name == "slowmo":     # LocalSGD every SYNC_EVERY steps, the slow step every 2 of them
        net = mpidp.SlowMoDistributedDataParallel(model, localsgd_frequency=SYNC_EVERY,
                                                  slowmo_frequency=2 * SYNC_EVERY)
        opt.register_step_post_hook(lambda o, _a, _k: net.perform_slowmo(o))
        return net, opt, net.detach
    if name == "torch ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        if not dist.is_initialized():
            dist.init_process_group("mpidp")
        opt.register_step_pre_hook(lambda _o, _a, _k: mpidp.fault_tolerance.step_boundary())
        return (DistributedDataParallel(model), opt, lambda: None,
                lambda: DistributedDataParallel(model))
    if name in ("diloco", "streaming diloco"):
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        kwargs = {}
        if name == "streaming diloco":
            owners = [m for m in model.modules() if list(m.parameters(recurse=False))]
            half = len(owners) // 2
            kwargs = dict(model_fragments=[torch.nn.ModuleList(owners[:half]),
                                           torch.nn.ModuleList(owners[half:])],
                          fragment_sync_delay=1)
        algo = mpidp.DiLoCo(model, opt, outer, sync_every=SYNC_EVERY, **kwargs).__enter__()
        return model, opt, algo.detach
    if name == "sparseloco":
        algo = mpidp.SparseLoCo(model, opt, sync_every=SYNC_EVERY).__enter__()
        return model, opt, algo.detach
    if name == "demo":
        return model, mpidp.DeMo(model.parameters(), lr=0.001), lambda: None
    if name == "decentralized":
        net = mpidp.with_bagua(model, [opt], mpidp.algorithms.DecentralizedAlgorithm(
            hierarchical=False))
        return net, opt, net.bagua_driver.detach
    raise ValueError(f"algorithm: unknown {name!r}")


def _worker_setup():
    import torch
    sys.path.insert(0, HERE)
    import mpidp
    from bench_step import make_case
    return torch, mpidp, make_case


def worker_steps(args):
    torch, mpidp, make_case = _worker_setup()
    import torch.nn.functional as F
    comm = mpidp.MPI.COMM_WORLD
    result = {}

    def timed(step):
        for _ in range(3):
            step()
        samples = []
        for _ in range(args.repeats):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            comm.Barrier()
            samples.append((time.perf_counter() - t0) / args.steps)
        return max(comm.allgather(statistics.median(samples)))

    if args.only:            # one algorithm of ALGORITHMS, alone in this job
        torch.manual_seed(0)
        model, x, y = make_case("mlp", args.quick, torch.device("cpu"))
        net, opt, _, _ = build_algorithm(args.only, model, mpidp, torch)

        def algorithm_step():
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        result[args.only] = timed(algorithm_step)
        if comm.Get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    for name in ("mlp", "resnet18"):
        torch.manual_seed(0)
        model, x, y = make_case(name, args.quick, torch.device("cpu"))
        net = mpidp.DataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step():
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        result[name] = timed(step)
        net.detach()
    # DASO in its warm-up (a blocking global average every batch) on emulated
    # nodes: the mode keeps a copy of the parameters before each sync's merge
    # and adds a second agreement after it.
    torch.manual_seed(0)
    model, x, y = make_case("mlp", args.quick, torch.device("cpu"))
    daso = mpidp.DASO(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                      total_epochs=1, warmup_epochs=1, cooldown_epochs=0)
    net = mpidp.DataParallelMultiGPU(model, daso)
    daso.last_batch = 10**9

    def daso_step():
        daso.zero_grad()
        F.cross_entropy(net(x), y).backward()
        daso.step()
    result["daso mlp"] = timed(daso_step)
    if mpidp.fault_tolerance.enabled():    # DASO's addition: the parameters kept before a merge
        t0 = time.perf_counter()
        for _ in range(20):
            daso._kept.keep(daso._written_by_syncs())
        result["daso kept copy"] = max(comm.allgather((time.perf_counter() - t0) / 20))
    if mpidp.fault_tolerance.enabled():    # the one thing the mode adds to a step: an agreement
        agree = mpidp.fault_tolerance._state.agree_comm
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(200):
            agree.Agree(1)
        result["agreement"] = max(comm.allgather((time.perf_counter() - t0) / 200))
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def worker_recovery(args):
    torch, mpidp, make_case = _worker_setup()
    import torch.nn.functional as F
    ft = mpidp.fault_tolerance
    comm = mpidp.MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    replacement = ft.is_replacement()
    torch.manual_seed(0)
    model, x, y = make_case("mlp", args.quick, torch.device("cpu"))
    net, opt, _, rebuild = build_algorithm(args.algorithm, model, mpidp, torch)
    kill_at = 6
    state = {"step": 0}

    def die_in_backward(grad):
        if rank == size - 1 and state["step"] == kill_at and not replacement:
            with open(args.stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return grad
    model.layers[len(model.layers) // 2].weight.register_hook(die_in_backward)
    begun = applied = 0
    step_times, caught, first_after = [], None, None
    if replacement:     # spawned by recover(replace=True)
        shared = ft.share_state()
        opt.load_state_dict(shared["optimizer"])
        applied = begun = state["step"] = shared["step"]
    while applied < kill_at + 4:
        try:
            t0 = time.perf_counter()
            begun += 1
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
            applied += 1
            state["step"] = applied
            if caught is not None and first_after is None:
                first_after = time.time()
            elif caught is None:
                step_times.append(time.perf_counter() - t0)
        except mpidp.RanksLost:
            caught = time.time()
            membership = ft.recover(replace=args.replace)
            if rebuild is not None:
                net = None
                gc.collect()     # the old wrapper's hooks go with it before the new one's
                net = rebuild()
            applied = ft.steps_committed()
            if membership.joined:
                ft.share_state({"optimizer": opt.state_dict(), "step": applied})
    mine = None
    if not replacement:
        with open(args.stamp) as f:
            killed = float(f.read())
        phases = ft.recovery_times()
        recovered = caught + sum(phases.values())
        mine = {"detection": caught - killed, **phases, "first step": first_after - recovered,
                "kill to first step": first_after - killed, "steps lost": begun - applied,
                "step": statistics.median(step_times[2:])}
    every = [m for m in ft.world_comm().allgather(mine) if m is not None]
    if ft.world_comm().Get_rank() == 0:
        print("RESULT " + json.dumps({k: max(m[k] for m in every) for k in mine}), flush=True)


# -- the driver ------------------------------------------------------------------

def run_job(ranks, worker, extra, ft_mode=True, ulfm=True):
    env = dict(os.environ, MPIDP_FAULT_TOLERANCE="1" if ft_mode else "0")
    if worker == "steps":
        env["MPIDP_RANKS_PER_NODE"] = "2"    # DASO's nodes (DataParallel runs flat)
    cmd = [os.path.join(ROOT, "scripts", "mpirun_ft.sh"), str(ranks)]
    if not ulfm:
        env["FT_LAUNCH_WITHOUT_ULFM"] = "1"
    cmd += [FT_PYTHON, os.path.abspath(__file__), "--worker", worker] + extra
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{worker} job failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n"
                       + "\n".join(line for line in out.stderr.splitlines()
                                   if "NBC_Progress" not in line)[-3000:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="jobs of each kind, taking turns")
    p.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per job (median)")
    p.add_argument("--quick", action="store_true", help="smaller ResNet-18")
    p.add_argument("--worker", choices=["steps", "recovery"], help=argparse.SUPPRESS)
    p.add_argument("--stamp", help=argparse.SUPPRESS)
    p.add_argument("--replace", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--algorithm", default="dataparallel", help=argparse.SUPPRESS)
    p.add_argument("--only", default="", help=argparse.SUPPRESS)
    p.add_argument("--algorithms", nargs="?", const=",".join(ALGORITHMS), default="",
                   help="also the step time (each in a job of its own) and the recovery under each "
                        "algorithm of ALGORITHMS, or of those named (comma-separated)")
    p.add_argument("--grow", action="store_true",
                   help="under each of --algorithms, also the recovery with recover(replace=True)")
    args = p.parse_args()
    if args.worker == "steps":
        return worker_steps(args)
    if args.worker == "recovery":
        return worker_recovery(args)
    if not os.path.exists(FT_PYTHON):
        sys.exit("bench_fault_tolerance: .venv-ft is missing: run scripts/setup_ft_env.sh first")

    common = ["--steps", str(args.steps), "--repeats", str(args.repeats)] + \
        (["--quick"] if args.quick else [])
    kinds = {"ulfm, mode on": dict(ft_mode=True), "ulfm, mode off": dict(ft_mode=False),
             "no ulfm, mode off": dict(ft_mode=False, ulfm=False)}
    steps = {k: [] for k in kinds}
    recoveries, grown = [], []
    chosen = [n for n in args.algorithms.split(",") if n]
    unknown = sorted(set(chosen) - set(ALGORITHMS))
    if unknown:
        sys.exit(f"bench_fault_tolerance: --algorithms: unknown {unknown}; choose from "
                 f"{', '.join(ALGORITHMS)}")
    by_algorithm = {name: [] for name in chosen}
    grown_by_algorithm = {name: [] for name in chosen} if args.grow else {}
    for _ in range(args.rounds):
        for kind, how in kinds.items():
            steps[kind].append(run_job(args.ranks, "steps", common, **how))
        for name in by_algorithm:
            for kind, how in kinds.items():
                steps[kind][-1].update(run_job(args.ranks, "steps", common + ["--only", name],
                                               **how))
        jobs = [([], recoveries), (["--replace"], grown)] + [
            (["--algorithm", name], results) for name, results in by_algorithm.items()] + [
            (["--algorithm", name, "--replace"], results)
            for name, results in grown_by_algorithm.items()]
        for extra, results in jobs:
            with tempfile.NamedTemporaryFile(suffix=".stamp") as stamp:
                results.append(run_job(args.ranks, "recovery",
                                       common + ["--stamp", stamp.name] + extra))

    print(f"\nStep time of blocking DataParallel (and of DASO in its warm-up on nodes of 2, and "
          f"of the algorithms below on the MLP, syncing every {SYNC_EVERY} steps) at "
          f"{args.ranks} ranks, median of {args.rounds} jobs (ms):")
    print(f"{'model':18s}" + "".join(f"{k:>20s}" for k in kinds) + f"{'on / off':>10s}"
          f"{'on / no ulfm':>14s}")
    agreement = 1e3 * statistics.median(r["agreement"] for r in steps["ulfm, mode on"])
    for model in ("mlp", "resnet18", "daso mlp") + tuple(by_algorithm):
        ms = {k: 1e3 * statistics.median(r[model] for r in steps[k]) for k in kinds}
        print(f"{model:18s}" + "".join(f"{ms[k]:20.2f}" for k in kinds)
              + f"{ms['ulfm, mode on'] / ms['ulfm, mode off']:10.3f}"
              + f"{ms['ulfm, mode on'] / ms['no ulfm, mode off']:14.3f}")
    print(f"The mode's one addition per step, an agreement of every rank: {agreement:.3f} ms "
          f"({100 * agreement / (1e3 * statistics.median(r['mlp'] for r in steps['ulfm, mode off'])):.2f} % "
          "of the MLP's step with the mode off)")
    kept = 1e3 * statistics.median(r["daso kept copy"] for r in steps["ulfm, mode on"])
    daso_off = 1e3 * statistics.median(r["daso mlp"] for r in steps["ulfm, mode off"])
    print(f"DASO's further addition, beside a second agreement: the parameters kept before "
          f"a merge, {kept:.3f} ms ({100 * kept / daso_off:.2f} % of DASO's MLP step with the "
          "mode off)")
    print(f"\nRecovery from one SIGKILLed rank of {args.ranks} in backward (500-tensor MLP), the "
          f"slowest survivor, median of {args.rounds} jobs (ms; steps lost: steps begun but not "
          "applied):")
    print(f"  {'':20s}{'shrink':>12s}{'grow back':>12s}")
    for key in grown[0]:
        row = []
        for results in (recoveries, grown):
            values = [r[key] for r in results if key in r]
            if not values:
                row.append(f"{'-':>12s}")
            elif key == "steps lost":
                row.append(f"{statistics.median(values):12.0f}")
            else:
                row.append(f"{1e3 * statistics.median(values):12.2f}")
        print(f"  {key:20s}" + "".join(row))
    for how, results_of, keys in (("shrinking", by_algorithm, recoveries[0]),
                                  ("growing back", grown_by_algorithm, grown[0])):
        if not results_of:
            continue
        print(f"\nThe same loss under each algorithm ({how}; the kill at step 6, syncs every "
              f"{SYNC_EVERY} steps), median of {args.rounds} jobs (ms):")
        names = list(results_of)
        print(f"  {'':20s}" + "".join(f"{n:>18s}" for n in names))
        for key in keys:
            row = []
            for name in names:
                values = [r[key] for r in results_of[name] if key in r]
                scale = 1 if key == "steps lost" else 1e3
                row.append(f"{scale * statistics.median(values):18.{0 if key == 'steps lost' else 2}f}"
                           if values else f"{'-':>18s}")
            print(f"  {key:20s}" + "".join(row))


if __name__ == "__main__":
    main()
