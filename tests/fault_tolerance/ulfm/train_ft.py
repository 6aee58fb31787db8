"""One fault-tolerant training job, launched by tests/fault_tolerance/ulfm/test_fault_tolerance.py
through scripts/mpirun_ft.sh: blocking DataParallel on a small MLP, plain SGD
with momentum stepped directly, every rank on its own data stream (seeded by
its rank in the launched job). The ranks named in FT_KILL end themselves
with SIGKILL at a chosen step and phase; the survivors catch RanksLost,
recover() and finish the run. Every survivor saves its final parameters and
what it saw to FT_OUT/rank-<launched rank>.pt.

FT_NONBLOCKING=1: non-blocking DataParallel; FT_HIERARCHICAL=1: hierarchical
averaging; FT_ALGORITHM=bytegrad: Bagua's ByteGrad through with_bagua,
postlocalsgd: PostLocalSGDOptimizer with a PeriodicModelAverager (with
FT_HIERARCHICAL=1 a HierarchicalModelAverager), localsgd:
the same rule as Bagua's LocalSGDAlgorithm through with_bagua, diloco:
DiLoCo (outer SGD with Nesterov momentum; its momentum is the one saved;
FT_FRAGMENTS=1: Streaming DiLoCo, FRAGMENTS taking turns every PERIOD steps,
each sent a step before its turn),
daso: DASO under DataParallelMultiGPU (one epoch of FT_STEPS batches),
slowmo: SlowMoDistributedDataParallel (LocalSGD every PERIOD steps, the
slow momentum step every 2 PERIOD; nodes as MPIDP_RANKS_PER_NODE says;
FT_SGP=1: the SGP base, gossiping every step over the default graph, or
with FT_SGP_GRAPH=1 over the script's own DynamicDirectedExponentialGraph
object, built for the node the script computes from its rank),
qadam: Bagua's QAdam through with_bagua (Adam for QADAM_WARMUP steps, then
the 8-bit averaged first moment; the first moment is the momentum saved),
sparseloco: SparseLoCo (a sync every PERIOD inner steps, FT_SYNC_DELAY
steps after its send; chunks of EF_CHUNK; θ̃ and the error feedback saved),
muloco: MuLoCo as sparseloco, every entry in 2-bit codes, the outer SGD
MULOCO_OUTER, noloco: NoLoCo (pairs drawn every PERIOD inner steps, each
rank's outer SGD NOLOCO_OUTER; its momentum is the one saved), eager:
EagerDiLoCo (a sync every PERIOD inner steps, each rank's outer SGD
DiLoCo's; its momentum is the one saved; FT_FRAGMENTS=1: FRAGMENTS taking
turns every PERIOD steps), desloc: DES-LOC with Adam (lr
DESLOC_LR; parameters averaged every PERIOD steps, first moments every
DESLOC_PERIODS[1], second every DESLOC_PERIODS[2]; the first moments saved),
demo: DeMo as the optimizer (its momentum is the one saved),
decentralized: Bagua's DecentralizedAlgorithm through with_bagua, flat,
peer_selection_mode FT_PEERS ("all" or "shift_one"), lowprecision: its
LowPrecisionDecentralizedAlgorithm, flat.
FT_DIST_INIT=1: torch.distributed's default group made first by
dist.init_process_group("mpidp") (recover() makes it again; an all_reduce
over it at the end is saved). FT_SUSPECT="<rank>:<step>[,<step>...]": that
rank takes an error for a failure at those steps, though none failed.
FT_NO_RECOVER=<rank>: that rank, told of a loss, never calls recover().
FT_REPLACEMENT_FAILS=1: a replacement raises before it builds anything.
FT_HABITS=1: AMP's GradScaler and the gradients unscaled and clipped to
norm CLIP before the step; the model wrapped twice (DeMo: two over the
parameters; the newer takes over), except under DASO; with DataParallel
two optimizers (the first layer's own).
FT_KILL: "<ranks>:<step>:<phase>[;...]", ranks comma-separated (launched
ranks), each entry a failure of its own, phase one of
forward (before the forward), backward (inside backward, gradient buckets in
flight), step (backward done, before the optimizer's step), sync (after the
optimizer's step, before SlowMo's perform_slowmo), average (QAdam: inside
the step, before its momentum average), between (after the step, before the
next forward), outer (DiLoCo: its outer-gradient allreduce posted, before
its wait; NoLoCo: its peer exchange posted, before its wait; EagerDiLoCo:
the last round's all-reduce in flight, before the sync waits for it; SparseLoCo and
DeMo: their allgather posted, before its wait; DASO: its local step taken,
before the global sync's merge), checkpoint (inside a checkpoint write,
which every rank starts after that step), rebuild (inside recover() of the
failure at that step, once the survivors shrank, as the algorithm's set-up
broadcasts over them), agreement (in the survivors' agreement that a rank
failed: FT_DELAY_MS after the first loss, in place of its own recover()),
shrink (inside the survivors' MPI shrink: FT_DELAY_MS after it agreed, in
place of its own shrink). A rank of the last two never takes its part, so
the survivors cannot have left that phase when it dies (with
FT_KILL_FROM_THREAD=1 it dies from a thread instead, FT_DELAY_MS after the
same point, while it goes on into the phase: the death then lands anywhere
from that phase to the rebuild, as the machine's load has it).
FT_DELAY_MS: default 2."""

import os
import signal
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

import mpidp
from mpi4py import MPI

STEPS = int(os.environ.get("FT_STEPS", "8"))
PERIOD = 2      # of the replica algorithms' syncs
CLIP = 0.5      # FT_HABITS: the gradients' norm is clipped to this
BASE_LR = 0.05   # the learning rate of the job's SGD (momentum 0.9)
SLOW_LR, SLOW_MOMENTUM = 0.8, 0.5     # SlowMo's α and β
QADAM_LR, QADAM_WARMUP = 0.01, 3
EF_CHUNK, EF_TOP_K = 8, 8        # SparseLoCo's tiles and entries kept per tile (DeMo: 3)
MULOCO_OUTER = dict(lr=0.8, momentum=0.9, nesterov=True)   # MuLoCo's outer SGD (dense, 2-bit)
NOLOCO_OUTER = dict(lr=0.7, momentum=0.5)     # NoLoCo's outer SGD (the authors' configuration)
DEMO_LR, DEMO_DECAY = 0.01, 0.9
DESLOC_LR, DESLOC_PERIODS = 0.01, (PERIOD, 3, 4)    # DES-LOC: Adam's lr; K_x, K_u, K_v
FRAGMENTS = [[0], [2, 4]]        # Streaming DiLoCo's (FT_FRAGMENTS): the model's layers
LAUNCHED_RANK = MPI.COMM_WORLD.Get_rank()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(launched_rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * launched_rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def kill_plan(spec=None):
    """[(ranks, step, phase)] from `spec` (default: FT_KILL)."""
    plan = []
    spec = os.environ.get("FT_KILL", "") if spec is None else spec
    for spec in filter(None, spec.split(";")):
        ranks, step, phase = spec.split(":")
        plan.append(({int(r) for r in ranks.split(",")}, int(step), phase))
    return plan


def take_key(key, launched: int, comm) -> int:
    """The data stream of each rank after a grow: the survivors keep theirs,
    the replacements (key None) take the lost ranks' in order."""
    return mpidp.fault_tolerance.places_after_growth(comm, key, launched)[comm.Get_rank()]


def main(out_dir: str) -> None:
    plan = kill_plan()
    replacement = mpidp.fault_tolerance.is_replacement()
    replace = bool(os.environ.get("FT_REPLACE"))
    key = None if replacement else LAUNCHED_RANK      # this rank's data stream
    if replacement and os.environ.get("FT_REPLACEMENT_FAILS"):
        raise RuntimeError("FT_REPLACEMENT_FAILS: a replacement's program fails")

    def dies(step: int, phase: str) -> bool:
        return not replacement and (key, step, phase) in {
            (r, s, p) for ranks, s, p in plan for r in ranks}

    def maybe_die(step: int, phase: str) -> None:
        if dies(step, phase):
            os.kill(os.getpid(), signal.SIGKILL)

    def die_instead(step: int, phase: str) -> None:
        """Phases agreement and shrink: die FT_DELAY_MS from now instead of
        taking part (FT_KILL_FROM_THREAD=1: from a thread, taking part)."""
        if dies(step, phase):
            delay = float(os.environ.get("FT_DELAY_MS", "2")) / 1000
            if os.environ.get("FT_KILL_FROM_THREAD") == "1":
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
                return
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGKILL)

    suspect_rank, _, suspect_steps = os.environ.get("FT_SUSPECT", "").partition(":")
    suspicions = [int(t) for t in suspect_steps.split(",") if t] \
        if suspect_rank and int(suspect_rank) == key else []

    def maybe_suspect(step: int) -> None:
        """FT_SUSPECT: this rank takes an MPI error for a failure, as the
        core does with an error that a peer's death can cause, where no rank
        has failed (each listed step once)."""
        if suspicions and suspicions[0] == step:
            suspicions.pop(0)
            mpidp.fault_tolerance.revoke_everything()
            raise mpidp.RanksLost(f"rank {key} suspects a failure at step {step}")

    if os.environ.get("FT_DIST_INIT"):   # torch.distributed's own call, not mpidp's
        dist.init_process_group("mpidp")
    model = make_model()
    algorithm = os.environ.get("FT_ALGORITHM", "")
    habits = bool(os.environ.get("FT_HABITS"))
    params = list(model.parameters())
    # FT_HABITS: with DataParallel the first layer has an optimizer of its
    # own (one training step then steps two optimizers).
    two = habits and not algorithm
    sgd = torch.optim.SGD(params[2:] if two else params, lr=BASE_LR, momentum=0.9)
    first_sgd = torch.optim.SGD(params[:2], lr=BASE_LR, momentum=0.9) if two else None
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if habits else None
    nonblocking = bool(os.environ.get("FT_NONBLOCKING"))
    # Non-blocking: Heat's DataParallelOptimizer, the update applied by the next forward.
    opt = mpidp.DataParallelOptimizer(sgd, blocking=False) if nonblocking else sgd
    hierarchical = bool(os.environ.get("FT_HIERARCHICAL"))
    saved_opt = [sgd, first_sgd] if two else [sgd]     # whose momentum is saved at the end
    if algorithm == "bytegrad":      # Bagua's, through with_bagua
        net = mpidp.with_bagua(model, [sgd],
                               mpidp.algorithms.ByteGradAlgorithm(hierarchical=hierarchical))
    elif algorithm == "localsgd":        # Bagua's LocalSGD (torch's rule), through with_bagua
        net = mpidp.with_bagua(model, [sgd], mpidp.algorithms.LocalSGDAlgorithm(period=PERIOD))
    elif algorithm == "postlocalsgd":    # torch's post-local SGD: average every PERIOD steps
        net = model
        # FT_HIERARCHICAL=1: a HierarchicalModelAverager, pairs every PERIOD
        # steps, the whole world every 2 PERIOD (4 ranks).
        averager = mpidp.HierarchicalModelAverager({PERIOD: 2, 2 * PERIOD: 4}) if hierarchical \
            else mpidp.PeriodicModelAverager(period=PERIOD)
        opt = mpidp.PostLocalSGDOptimizer(sgd, averager)
    elif algorithm == "diloco":          # the outer sync every PERIOD inner steps
        net = model
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        def make_diloco():
            if os.environ.get("FT_FRAGMENTS"):   # Streaming DiLoCo: FRAGMENTS, one sent a step early
                return mpidp.DiLoCo(model, sgd, outer, sync_every=PERIOD * len(FRAGMENTS),
                                    model_fragments=[torch.nn.ModuleList([model[i] for i in f])
                                                     for f in FRAGMENTS], fragment_sync_delay=1)
            return mpidp.DiLoCo(model, sgd, outer, sync_every=PERIOD)
        # For the whole job (a with-block around the loop does the same).
        diloco = twice(make_diloco, habits, enter=True)
        # Phase "outer": the outer-gradient allreduce posted, before its wait.
        outer_gradient = diloco._outer_gradient
        diloco._outer_gradient = lambda f: maybe_die(step, "outer") or outer_gradient(f)
        saved_opt = [outer]
    elif algorithm == "noloco":          # pairs every PERIOD inner steps
        net = model
        outer = torch.optim.SGD(model.parameters(), **NOLOCO_OUTER)
        diloco = twice(lambda: mpidp.NoLoCo(model, sgd, outer, sync_every=PERIOD), habits,
                       enter=True)
        # Phase "outer": the peer exchange posted, before its wait.
        outer_gradient = diloco._outer_gradient
        diloco._outer_gradient = lambda f: maybe_die(step, "outer") or outer_gradient(f)
        saved_opt = [outer]
    elif algorithm == "eager":           # a sync every PERIOD inner steps
        net = model
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        if os.environ.get("FT_FRAGMENTS"):
            diloco = twice(lambda: mpidp.EagerDiLoCo(
                model, sgd, outer, sync_every=PERIOD * len(FRAGMENTS),
                model_fragments=[torch.nn.ModuleList([model[i] for i in f])
                                 for f in FRAGMENTS]), habits, enter=True)
        else:
            diloco = twice(lambda: mpidp.EagerDiLoCo(model, sgd, outer, sync_every=PERIOD),
                           habits, enter=True)
        # Phase "outer": the last round's all-reduce in flight, before the sync's wait.
        send = diloco._send
        diloco._send = lambda f, s: maybe_die(step, "outer") or send(f, s)
        saved_opt = [outer]
    elif algorithm == "desloc":          # Adam, each state averaged on its own period
        net = model
        sgd = opt = torch.optim.Adam(params, lr=DESLOC_LR)
        twice(lambda: mpidp.DESLOC(model, sgd, DESLOC_PERIODS[0],
                                   exp_avg_every=DESLOC_PERIODS[1],
                                   exp_avg_sq_every=DESLOC_PERIODS[2]), habits, enter=True)
        saved_opt = [sgd]
    elif algorithm == "sparseloco":
        net = model
        sparseloco = twice(lambda: mpidp.SparseLoCo(
            model, sgd, sync_every=PERIOD, top_k=EF_TOP_K, chunk_size=EF_CHUNK,
            sync_delay=int(os.environ.get("FT_SYNC_DELAY", "0"))), habits, enter=True)
    elif algorithm == "muloco":
        net = model
        muloco_outer = torch.optim.SGD(params, **MULOCO_OUTER)
        sparseloco = twice(lambda: mpidp.MuLoCo(
            model, sgd, muloco_outer, sync_every=PERIOD, chunk_size=EF_CHUNK,
            sync_delay=int(os.environ.get("FT_SYNC_DELAY", "0"))), habits, enter=True)
    elif algorithm == "demo":
        net = model
        sgd = opt = twice(lambda: mpidp.DeMo(params, lr=DEMO_LR, compression_decay=DEMO_DECAY,
                                             compression_topk=3, compression_chunk=EF_CHUNK),
                          habits)
        saved_opt = [sgd]
    elif algorithm == "decentralized":
        net = twice(lambda: mpidp.with_bagua(model, [sgd], mpidp.algorithms.DecentralizedAlgorithm(
            hierarchical=False, peer_selection_mode=os.environ.get("FT_PEERS", "all"))), habits)
    elif algorithm == "lowprecision":
        net = twice(lambda: mpidp.with_bagua(
            model, [sgd], mpidp.algorithms.LowPrecisionDecentralizedAlgorithm(hierarchical=False)),
            habits)
    elif algorithm == "daso":
        # One epoch of STEPS batches; FT_DASO_CYCLING=1: DASO's cycling phase
        # (global syncs in flight across batches), else its warm-up (a
        # blocking global average every batch). float32 on the wire.
        cycling = bool(os.environ.get("FT_DASO_CYCLING"))
        daso = mpidp.DASO(sgd, total_epochs=1, warmup_epochs=0 if cycling else 1,
                          cooldown_epochs=0, max_global_skips=4, downcast_type=torch.float32)
        net = mpidp.DataParallelMultiGPU(model, daso)
        daso.last_batch = STEPS - 1
        if habits:
            daso.add_scaler(scaler)     # DASO's AMP: it steps through the scaler
        opt = daso
        # Phase "outer": inside the step, the local step taken, before the
        # global sync's merge (in the warm-up, its send just posted).
        complete = daso._complete
        daso._complete = lambda group, btw: maybe_die(step, "outer") or complete(group, btw)
    elif algorithm == "qadam":
        sgd = opt = mpidp.algorithms.QAdamOptimizer(params, lr=QADAM_LR, warmup_steps=QADAM_WARMUP)
        saved_opt = [sgd]
        net = mpidp.with_bagua(model, [sgd], mpidp.algorithms.QAdamAlgorithm(sgd, hierarchical=False))
        # Phase "average": inside the step, the momenta computed and about to be averaged.
        handle = net._driver
        average = handle.average_momentum
        handle.average_momentum = lambda flat: maybe_die(step, "average") or average(flat)
    elif algorithm == "slowmo":
        def wrap_slowmo():
            base = mpidp.SlowMoBaseAlgorithm.SGP if os.environ.get("FT_SGP") else \
                mpidp.SlowMoBaseAlgorithm.LOCALSGD
            graph = None
            if os.environ.get("FT_SGP_GRAPH"):
                per_node, rank = int(os.environ["MPIDP_RANKS_PER_NODE"]), mpidp.rank()
                graph = mpidp.gossip.DynamicDirectedExponentialGraph(
                    rank // per_node, mpidp.size() // per_node, per_node, rank % per_node)
            return mpidp.SlowMoDistributedDataParallel(
                model, localsgd_frequency=PERIOD, slowmo_frequency=2 * PERIOD,
                slowmo_lr=SLOW_LR, slowmo_momentum=SLOW_MOMENTUM, slowmo_base_algorithm=base,
                graph=graph)
        net = twice(wrap_slowmo, habits)
    else:
        # One bucket per parameter, so that several are in flight when a rank dies in backward.
        def wrap():
            return mpidp.DataParallel(model, optimizer=opt if nonblocking else None,
                                      blocking_parameter_updates=not nonblocking,
                                      first_bucket_cap_mb=1e-4, bucket_cap_mb=1e-4,
                                      hierarchical=hierarchical)
        net = twice(wrap, habits)
    if algorithm in ("sparseloco", "muloco", "demo"):
        # Phase "outer": the payloads' allgather posted, before its wait.
        from mpidp._engines.ef_wire import Wire
        wait = Wire.wait
        Wire.wait = lambda wire, names: maybe_die(step, "outer") or wait(wire, names)
    if any(p == "shrink" for _, _, p in plan):
        from mpidp.fault_tolerance import survivors as _survivors
        shrink = _survivors.shrink
        _survivors.shrink = lambda comm: die_instead(step, "shrink") or shrink(comm)
    if any(p == "rebuild" for _, _, p in plan):
        # Phase "rebuild": inside recover(), after the survivors agreed and
        # shrank, as the algorithm broadcasts rank 0's state over them.
        from mpidp.algorithms import driver as _driver
        broadcast = _driver.broadcast_state
        _driver.broadcast_state = lambda *a, **k: maybe_die(step, "rebuild") or broadcast(*a, **k)
    first_layer = model[0].weight   # its gradient comes last in backward
    first_layer.register_hook(lambda g: maybe_die(step, "backward") or g)
    checkpoint_after = next((s for _, s, p in plan if p == "checkpoint"), -1)
    checkpoint_due = False
    recoveries = []
    committed = [None]   # DASO: parameters and momentum after each step this rank applied
    step = 0     # steps applied
    launched = MPI.COMM_WORLD.Get_size()
    if replacement:      # spawned by recover(replace=True): the others' state, a lost rank's data
        state = mpidp.fault_tolerance.share_state()
        sgd.load_state_dict(state["optimizer"])
        if first_sgd is not None:
            first_sgd.load_state_dict(state["first optimizer"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
        step, launched = state["step"], state["launched"]
        key = take_key(key, launched, mpidp.fault_tolerance.world_comm())
    while step < STEPS:
        try:
            if checkpoint_due:     # written after step `checkpoint_after`, retried after a failure
                maybe_die(checkpoint_after, "checkpoint")
                mpidp.fault_tolerance.save_checkpoint(
                    os.path.join(out_dir, "checkpoint.pt"),
                    {"model": model.state_dict(), "optimizer": opt.state_dict(), "steps": step})
                checkpoint_due = False
            x, y = batch(key, step)
            maybe_die(step, "forward")
            maybe_suspect(step)
            loss = torch.nn.functional.mse_loss(net(x), y)
            if habits and algorithm:   # one optimizer, unscaled and clipped
                scaler.scale(loss).backward()
                maybe_die(step, "step")
                scaler.unscale_(sgd if algorithm == "daso" else opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                if algorithm == "daso":
                    opt.step()       # DASO steps through its own scaler
                else:
                    scaler.step(opt)
                    scaler.update()
            elif habits:   # AMP's scaler, and the gradients unscaled and clipped before the step
                scaler.scale(loss).backward()
                maybe_die(step, "step")
                scaler.unscale_(opt)
                scaler.unscale_(first_sgd)
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                scaler.step(opt)
                scaler.step(first_sgd)
                scaler.update()
                first_sgd.zero_grad()
            else:
                loss.backward()
                maybe_die(step, "step")
                opt.step()
            maybe_die(step, "sync")
            if algorithm == "slowmo":
                net.perform_slowmo(sgd)
            # After the step, so a step a lost rank cut short leaves its
            # gradients behind: recover() must drop them.
            opt.zero_grad()
            step += 1
            # DASO only: reading non-blocking DataParallel's parameters here
            # would apply its step at once.
            if algorithm == "daso":
                committed.append(([p.detach().clone() for p in model.parameters()],
                                  momenta(saved_opt, model)))
            maybe_die(step - 1, "between")
            checkpoint_due = step - 1 == checkpoint_after
        except mpidp.RanksLost:
            if os.environ.get("FT_NO_RECOVER") == str(key):   # a survivor that never recovers
                time.sleep(600)
            die_instead(step, "agreement")
            m = mpidp.recover(replace=replace)
            if scaler is not None:
                mpidp.fault_tolerance.reset_grad_scaler(scaler)
            recoveries.append({"step": step, "rank": m.rank, "size": m.size, "lost": m.lost,
                               "times": mpidp.fault_tolerance.recovery_times(),
                               "joined": m.joined, "mpidp_size": mpidp.size(),
                               "mpidp_rank": mpidp.rank()})
            if algorithm == "daso":
                recoveries[-1].update(params=[p.detach().clone() for p in model.parameters()],
                                      momentum=momenta(saved_opt, model))
            # Go on from the last step every rank applied (non-blocking: the
            # step due when the rank died may be one the loop had passed).
            step = mpidp.fault_tolerance.steps_committed()
            recoveries[-1]["resumed_at"] = step
            del committed[step + 1:]
            if algorithm == "daso" and len(committed) == step:
                # That step stood, its global sync dropped: rank 0's state now.
                committed.append((recoveries[-1]["params"], recoveries[-1]["momentum"]))
            if m.joined:
                mpidp.fault_tolerance.share_state({
                    "optimizer": sgd.state_dict(), "step": step, "launched": launched,
                    "first optimizer": first_sgd and first_sgd.state_dict(),
                    "scaler": scaler and scaler.state_dict()})
                key = take_key(key, launched, m.comm)
    if nonblocking:
        net.synchronize()   # the last step's update
    if algorithm == "daso":
        daso.epoch_loss_logic(loss)
    dist_sum = None
    if os.environ.get("FT_DIST_INIT"):     # the default group, made again over the survivors
        total = torch.ones(1)
        dist.all_reduce(total)
        dist_sum = (total.item(), dist.get_world_size())
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "dist_sum": dist_sum,
                "momentum": momenta(saved_opt, model), "recoveries": recoveries,
                "committed": committed,
                "slowmo": net.slowmo_state_dict() if algorithm == "slowmo" else None,
                "sparseloco": (sparseloco.state_dict() if algorithm in ("sparseloco", "muloco")
                               else None)},
               os.path.join(out_dir, f"rank-{key}.pt"))


def twice(make, habits, enter=False):
    """make()'s wrapper, entered for the whole job if `enter` (DiLoCo,
    SparseLoCo). FT_HABITS: the second of two made, which takes the model
    over from the first (with a warning)."""
    wrapper = make()
    if enter:
        wrapper.__enter__()
    if habits:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapper = make()
            if enter:
                wrapper.__enter__()
    return wrapper


def momenta(optimizers, model):
    """SGD's momentum buffers (Adam's first moments) of the model's parameters."""
    state = {p: s for opt in optimizers for p, s in opt.state.items()}
    return [next(state[p][k] for k in ("momentum_buffer", "exp_avg", "delta") if k in state[p])
            .clone() if p in state else None for p in model.parameters()]


if __name__ == "__main__":
    main(sys.argv[1])
