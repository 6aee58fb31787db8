"""A fault-tolerant program on torch.distributed's own data parallelism over
the "mpidp" backend (launched by tests/fault_tolerance/ulfm/test_fault_tolerance.py through
scripts/mpirun_ft.sh), the recipes of docs/fault-tolerance.md: the model
and data of train_ft.py (every rank its own stream), SGD with momentum.

FT_TORCH=ddp: DistributedDataParallel; after a loss, recover() and DDP
built again over the survivors' default group. FT_TORCH=hsdp: FSDP2's
fully_shard over a 2-D mesh, replicate x shard, groups of SHARD ranks;
after a loss the replica groups that lost no rank go on
(mpidp.fault_tolerance.keep_whole_groups), the model sharded again over
their mesh with each rank's local shards and momentum carried across; the
survivors of a broken group leave (FT_REPLACE=1: recover(replace=True),
and the group is made whole again, a replacement in the lost rank's
place taking its shards from the other group). Either way every step ends with the
ranks' agreement (step_boundary) before the optimizer steps, so a step in
which a rank died is applied by none.

FT_KILL as train_ft.py's, phases forward, backward (DDP only: inside
backward, buckets in flight) and step (backward done, before the
agreement). FT_HABITS=1: AMP's GradScaler, the gradients unscaled and
clipped to train_ft.CLIP before the agreement. Each rank saves FT_OUT/rank-<launched rank>.pt: its full
parameters and momentum, its recoveries, and whether it left."""

import os
import signal
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import mpidp
from train_ft import CLIP, batch, kill_plan, make_model

STEPS = int(os.environ.get("FT_STEPS", "8"))
SHARD = 2        # ranks per replica group (HSDP)
LAUNCHED_RANK = MPI.COMM_WORLD.Get_rank()


def build_hsdp(n_groups):
    model = make_model()
    mesh = init_device_mesh("cpu", (n_groups, SHARD), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def take_local_shards(old_model, old_opt, new_model, new_opt) -> None:
    """The recipe's re-shard: each rank keeps its place in its group, so its
    local shards of the parameters and momentum carry across as they are."""
    with torch.no_grad():
        for old, new in zip(old_model.parameters(), new_model.parameters()):
            new.to_local().copy_(old.to_local())
            buf = old_opt.state.get(old, {}).get("momentum_buffer")
            if buf is not None:
                mine = torch.zeros_like(new)
                mine.to_local().copy_(buf.to_local())
                new_opt.state[new]["momentum_buffer"] = mine


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def main(out_dir: str) -> None:
    kills = {(r, s, p) for ranks, s, p in kill_plan() for r in ranks}

    def maybe_die(step: int, phase: str) -> None:
        if (LAUNCHED_RANK, step, phase) in kills:
            os.kill(os.getpid(), signal.SIGKILL)

    hsdp = os.environ["FT_TORCH"] == "hsdp"
    replace = bool(os.environ.get("FT_REPLACE"))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if os.environ.get("FT_HABITS") else None
    dist.init_process_group("mpidp")
    key, step = LAUNCHED_RANK, 0        # this rank's data stream, the step
    if hsdp and mpidp.fault_tolerance.is_replacement():
        # Spawned by recover(replace=True): the survivors' step, a lost
        # rank's place in its group (and its data), that place's shards.
        step = mpidp.fault_tolerance.share_state()["step"]
        layout = mpidp.fault_tolerance.keep_whole_groups(None, SHARD)
        key = layout.Get_rank()
        model, opt = build_hsdp(layout.Get_size() // SHARD)
        mpidp.fault_tolerance.give_replacements_shards(model, opt, layout, SHARD)
        net = model
    elif hsdp:
        model, opt = build_hsdp(dist.get_world_size() // SHARD)
        net = model
    else:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        net = DistributedDataParallel(model, bucket_cap_mb=1e-4)
        model[0].weight.register_hook(lambda g: maybe_die(step, "backward") or g)
    comm = None          # where the steps are agreed: the job, then the whole groups
    recoveries, left = [], False
    while step < STEPS:
        try:
            x, y = batch(key, step)
            maybe_die(step, "forward")
            loss = torch.nn.functional.mse_loss(net(x), y)
            if scaler is None:
                loss.backward()
                maybe_die(step, "step")
                mpidp.fault_tolerance.step_boundary(comm)
                opt.step()
            else:        # AMP's scaler, the gradients unscaled and clipped before the step
                scaler.scale(loss).backward()
                maybe_die(step, "step")
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                mpidp.fault_tolerance.step_boundary(comm)
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            step += 1
        except mpidp.RanksLost:
            m = mpidp.recover(comm=comm, replace=replace)
            if scaler is not None:
                mpidp.fault_tolerance.reset_grad_scaler(scaler)
            recoveries.append({"step": step, "rank": m.rank, "size": m.size, "lost": m.lost,
                               "joined": m.joined})
            if hsdp:
                if m.joined:     # the replacements take the step first, as their script does
                    mpidp.fault_tolerance.share_state(
                        {"step": mpidp.fault_tolerance.steps_committed()})
                layout = mpidp.fault_tolerance.keep_whole_groups(m, SHARD)
                if layout is None:
                    left = True
                    break
                new_model, new_opt = build_hsdp(layout.Get_size() // SHARD)
                take_local_shards(model, opt, new_model, new_opt)
                if m.joined:     # the groups whole again: steps agreed over the job
                    mpidp.fault_tolerance.give_replacements_shards(new_model, new_opt, layout,
                                                                   SHARD)
                comm = None if m.joined else layout
                model = net = new_model
                opt = new_opt
            else:
                opt.zero_grad()          # the cut-short backward's gradients
                net = DistributedDataParallel(model, bucket_cap_mb=1e-4)   # rank 0's parameters
            step = mpidp.fault_tolerance.steps_committed()
    saved = {"recoveries": recoveries, "left": left, "params": None, "momentum": None}
    if not left:
        saved["params"] = [full(p) for p in model.parameters()]
        saved["momentum"] = [full(opt.state[p]["momentum_buffer"]) for p in model.parameters()]
    torch.save(saved, os.path.join(out_dir, f"rank-{key}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
