"""Worker groups in fault-tolerant mode, as a search with multi-rank workers
runs them (Propulate): the world is split into groups (FT_GROUPS, launched
ranks, e.g. "0,1;2,3"), each training a model of its own over its group's
communicator with FT_ALGORITHM: dp (blocking DataParallel), nonblocking
(non-blocking DataParallel), gradient_allreduce (Bagua's
GradientAllReduceAlgorithm through with_bagua), diloco (DiLoCo over the
group, a sync every PERIOD inner steps; its outer momentum is the one
saved), qadam (Bagua's QAdam through with_bagua, train_ft.py's settings;
its first moment is the momentum saved), daso (DASO under
DataParallelMultiGPU over the group, train_ft.py's settings: its warm-up;
nodes as MPIDP_RANKS_PER_NODE says), slowmo (SlowMo, LOCALSGD base,
over the group: nodes as MPIDP_RANKS_PER_NODE says), decentralized and lowprecision (Bagua's DecentralizedAlgorithm,
"all" peers, and LowPrecisionDecentralizedAlgorithm, flat, over the group),
sparseloco (SparseLoCo over the group, train_ft.py's settings), noloco
(NoLoCo over the group, train_ft.py's settings; its outer momentum is the
one saved), eager (EagerDiLoCo over the group, as train_ft.py's; its outer
momentum is the one saved), desloc (DESLOC over the group, as train_ft.py's;
Adam's first moments saved),
demo (DeMo over the group as the optimizer, train_ft.py's settings),
postlocalsgd (PostLocalSGDOptimizer with a
PeriodicModelAverager(period=2) over the group), hierarchical
(HierarchicalModelAverager(HIERARCHY) over the world, FT_RECOVER=job; its
groups of 2 are FT_GROUPS). Launched by
tests/fault_tolerance/ulfm/test_groups.py through scripts/mpirun_ft.sh.

FT_HABITS=1 (dp, nonblocking, postlocalsgd): AMP's GradScaler, the
gradients unscaled and clipped to train_ft.CLIP before the step, and
DataParallel wrapped twice (the newer takes over).

The ranks of FT_KILL ("<rank>:<step>:<phase>", phases backward: inside
backward, before the last gradient; step: before the optimizer's step) end
themselves with SIGKILL (sync: after the optimizer's step, before SlowMo's
perform_slowmo; rebuild: inside the recovery of that step's loss,
as DataParallel's set-up broadcasts over the group's survivors). FT_RECOVER=group: a group's survivors call
recover(comm=<the group's communicator>), and the other groups must never
see a loss. FT_RECOVER=job: every SYNC_EVERY steps, and at the end, each rank adds 1
over the world (mpidp.allreduce), as a search comparing its workers would,
so every survivor of the job learns of the loss and calls recover(). Each survivor
saves to FT_OUT/rank-<launched rank>.pt its parameters, momentum, the
losses it saw, its recoveries and the world's last sum."""

import os
import signal
import sys
import warnings

import torch
from mpi4py import MPI

import mpidp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_ft import (CLIP, DEMO_DECAY, DEMO_LR, DESLOC_LR, DESLOC_PERIODS,  # noqa: E402
                      EF_CHUNK, EF_TOP_K, NOLOCO_OUTER, PERIOD, QADAM_LR, QADAM_WARMUP, SLOW_LR,
                      SLOW_MOMENTUM, batch, make_model, momenta)

STEPS = int(os.environ.get("FT_STEPS", "8"))
LAUNCHED_RANK = MPI.COMM_WORLD.Get_rank()
# FT_RECOVER=job: the steps at which the world counts its ranks (and the end).
# Each group may be a step ahead of another when a rank dies (its own
# agreements end its steps), and resumes from its own committed step: at
# sync points every few steps, each group's next sync after the recovery is
# the same one.
SYNC_EVERY = 4
HIERARCHY = {PERIOD: 2, 2 * PERIOD: 4}   # FT_ALGORITHM=hierarchical (4 ranks)


def groups():
    return [[int(r) for r in g.split(",")] for g in os.environ["FT_GROUPS"].split(";")]


def world_count() -> float:
    """1 summed over the world's ranks (mpidp's world: the survivors')."""
    one = torch.ones(1)
    mpidp.allreduce(one)
    return one.item()


def main(out_dir: str) -> None:
    kills = {(int(r), int(s), p) for r, s, p in
             (k.split(":") for k in filter(None, os.environ.get("FT_KILL", "").split(";")))}
    mode = os.environ.get("FT_RECOVER", "group")
    algorithm = os.environ.get("FT_ALGORITHM", "dp")
    color = next(i for i, g in enumerate(groups()) if LAUNCHED_RANK in g)
    worker = MPI.COMM_WORLD.Split(color, LAUNCHED_RANK)

    def maybe_die(step, phase):
        if (LAUNCHED_RANK, step, phase) in kills:
            os.kill(os.getpid(), signal.SIGKILL)

    model = make_model()
    sgd = saved_opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    habits = bool(os.environ.get("FT_HABITS"))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if habits else None
    sparseloco = None
    if algorithm == "hierarchical":     # over the world: the groups are its levels
        net = model
        opt = mpidp.PostLocalSGDOptimizer(sgd, mpidp.HierarchicalModelAverager(HIERARCHY))
    elif algorithm == "gradient_allreduce":   # Bagua's, through with_bagua over the group
        net = mpidp.with_bagua(model, [sgd], mpidp.algorithms.GradientAllReduceAlgorithm(),
                               comm=worker)
        opt = sgd
    elif algorithm in ("decentralized", "lowprecision"):    # Bagua's, flat, over the group
        net = mpidp.with_bagua(
            model, [sgd], mpidp.algorithms.DecentralizedAlgorithm(hierarchical=False)
            if algorithm == "decentralized" else
            mpidp.algorithms.LowPrecisionDecentralizedAlgorithm(hierarchical=False), comm=worker)
        opt = sgd
    elif algorithm == "qadam":           # Bagua's QAdam through with_bagua over the group
        sgd = opt = saved_opt = mpidp.algorithms.QAdamOptimizer(
            model.parameters(), lr=QADAM_LR, warmup_steps=QADAM_WARMUP)
        net = mpidp.with_bagua(model, [sgd], mpidp.algorithms.QAdamAlgorithm(
            sgd, hierarchical=False), comm=worker)
    elif algorithm == "slowmo":          # SlowMo (LOCALSGD base) over the group, train_ft.py's
        net = mpidp.SlowMoDistributedDataParallel(
            model, comm=worker, localsgd_frequency=PERIOD, slowmo_frequency=2 * PERIOD,
            slowmo_lr=SLOW_LR, slowmo_momentum=SLOW_MOMENTUM)
        opt = sgd
    elif algorithm == "diloco":          # over the group, entered for the whole run
        net, opt = model, sgd
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        mpidp.DiLoCo(model, sgd, outer, sync_every=PERIOD, comm=worker).__enter__()
        saved_opt = outer
    elif algorithm == "noloco":          # over the group, entered for the whole run
        net, opt = model, sgd
        outer = torch.optim.SGD(model.parameters(), **NOLOCO_OUTER)
        mpidp.NoLoCo(model, sgd, outer, sync_every=PERIOD, comm=worker).__enter__()
        saved_opt = outer
    elif algorithm == "desloc":          # over the group, entered for the whole run
        net = model
        sgd = opt = saved_opt = torch.optim.Adam(model.parameters(), lr=DESLOC_LR)
        mpidp.DESLOC(model, sgd, DESLOC_PERIODS[0], comm=worker, exp_avg_every=DESLOC_PERIODS[1],
                     exp_avg_sq_every=DESLOC_PERIODS[2]).__enter__()
    elif algorithm == "eager":           # over the group, entered for the whole run
        net, opt = model, sgd
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        mpidp.EagerDiLoCo(model, sgd, outer, sync_every=PERIOD, comm=worker).__enter__()
        saved_opt = outer
    elif algorithm == "sparseloco":      # over the group, entered for the whole run
        net, opt = model, sgd
        sparseloco = mpidp.SparseLoCo(model, sgd, sync_every=PERIOD, top_k=EF_TOP_K,
                                      chunk_size=EF_CHUNK, comm=worker)
        sparseloco.__enter__()
    elif algorithm == "demo":            # DeMo over the group as the optimizer
        net = model
        opt = saved_opt = mpidp.DeMo(model.parameters(), lr=DEMO_LR,
                                     compression_decay=DEMO_DECAY, compression_topk=3,
                                     compression_chunk=EF_CHUNK, comm=worker)
    elif algorithm == "daso":            # DASO in its warm-up over the group, train_ft.py's
        daso = mpidp.DASO(sgd, total_epochs=1, warmup_epochs=1, cooldown_epochs=0,
                          max_global_skips=4, downcast_type=torch.float32, comm=worker)
        net = mpidp.DataParallelMultiGPU(model, daso, comm=worker)
        daso.last_batch = STEPS - 1
        opt = daso
    elif algorithm == "postlocalsgd":
        net = model
        opt = mpidp.PostLocalSGDOptimizer(
            sgd, mpidp.PeriodicModelAverager(period=PERIOD, process_group=worker))
    else:
        opt = mpidp.DataParallelOptimizer(sgd, blocking=False) if algorithm == "nonblocking" \
            else sgd
        for _ in range(2 if habits else 1):    # habits: wrapped twice, the newer takes over
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                net = mpidp.DataParallel(model, comm=worker,
                                         optimizer=opt if algorithm == "nonblocking" else None)
    if any(p == "rebuild" for _, _, p in kills):
        # Phase "rebuild": inside recover() of the failure at that step, as
        # the algorithm's set-up broadcasts over the group's survivors.
        from mpidp.algorithms import driver as _driver
        broadcast = _driver.broadcast_state
        _driver.broadcast_state = lambda *a, **k: maybe_die(step, "rebuild") or broadcast(*a, **k)
    first_weight = list(model.parameters())[0]
    losses, recoveries, world_sum = 0, [], None
    step = 0
    while True:
        try:
            if mode == "job" and step % SYNC_EVERY == 0:
                world_sum = world_count()
            if step >= STEPS:
                break
            x, y = batch(LAUNCHED_RANK, step)
            out = net(x)
            hook = first_weight.register_hook(
                lambda g, s=step: maybe_die(s, "backward") or g)
            loss = torch.nn.functional.mse_loss(out, y)
            try:
                (loss if scaler is None else scaler.scale(loss)).backward()
            finally:
                hook.remove()
            maybe_die(step, "step")
            if scaler is None:
                opt.step()
            else:       # AMP's scaler, the gradients unscaled and clipped before the step
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            maybe_die(step, "sync")
            if algorithm == "slowmo":
                net.perform_slowmo(sgd)
            step += 1
        except mpidp.RanksLost:
            losses += 1
            m = mpidp.recover(comm=worker if mode == "group" else None)
            if scaler is not None:
                mpidp.fault_tolerance.reset_grad_scaler(scaler)
            # The group's survivors (a recovery of the job made every group again).
            worker = m.comm if mode == "group" else mpidp.fault_tolerance.survivors_of(worker)
            recoveries.append({"lost": list(m.lost), "rank": m.rank, "size": m.size,
                               "previous_size": m.previous_size,
                               "times": mpidp.fault_tolerance.recovery_times()})
            step = mpidp.fault_tolerance.steps_committed()
    if algorithm == "nonblocking":
        opt.synchronize()
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "momentum": momenta([saved_opt], model),
                "sparseloco": sparseloco.state_dict() if algorithm == "sparseloco" else None,
                "losses": losses, "recoveries": recoveries, "world_sum": world_sum,
                "steps": step, "group_size": worker.Get_size()},
               os.path.join(out_dir, f"rank-{LAUNCHED_RANK}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
