"""Train a ResNet on ImageNet (or any ImageFolder data set) with mpidp's DASO.

    mpirun -np 8 python examples/imagenet_daso.py --data /scratch/imagenet
    srun --ntasks-per-node=4 --gpus-per-node=4 python examples/imagenet_daso.py --data DIR
    mpirun -np 2 python examples/imagenet_daso.py --synthetic --arch tiny --image-size 32

One process per GPU (or per CPU socket/core group without GPUs). Within a
node the ranks average gradients every batch with torch DistributedDataParallel
(NCCL on GPUs, gloo on CPUs); between nodes DASO averages the parameters over
MPI only every few batches, asynchronously and compressed (Heat's DASO: warm-up
epochs with a blocking average every batch, then cycling with growing/shrinking
skips driven by the training loss, then cool-down epochs blocking again).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from image_folder import EvalTransform, ImageFolder, SyntheticImages, TrainTransform  # noqa: E402
from resnet import ARCHS, build_model  # noqa: E402

import mpidp  # noqa: E402  (initialises MPI)
from mpidp import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.Get_rank(), COMM.Get_size()

# Exit codes (the same on every rank).
EXIT_OK, EXIT_USAGE, EXIT_UNSUPPORTED = 0, 2, 3

EPILOG = """\
learning rate:
  --lr is the rate for a global batch of 256 images; the rate used is
  lr * batch_size * world_size / 256 (Goyal et al., 2017). It rises linearly
  over --lr-warmup-epochs, then follows a cosine towards 0 at the last epoch;
  it is set at the start of every epoch. SGD with --momentum and
  --weight-decay (no decay on BatchNorm parameters and biases).

DASO phases (printed every epoch):
  warmup    --warmup-epochs epochs: parameters averaged over all nodes after
            every batch (blocking).
  cycling   a global average is sent every global_skip batches and merged
            batches_to_wait batches later, while the next batches train; the
            skips shrink when the loss stalls and reset when they reach 1.
  cooldown  the last --cooldown-epochs epochs: blocking averages again.
  The last batch of every epoch is always a blocking average, so all ranks
  hold the same parameters between epochs (where validation and checkpoints
  happen).

nodes:
  Ranks sharing a machine form a node (MPI_COMM_TYPE_SHARED); every node must
  run the same number of ranks. MPIDP_RANKS_PER_NODE=k instead groups k
  consecutive ranks into one "node" (to try DASO on a single machine).

per-epoch line (rank 0):
  epoch E/N: phase P global_skip G batches_to_wait B lr LR train_loss L
             val_top1 A% time Ts sent M MB (X img/s)
  E counts from 0. P, G and B are the DASO settings the epoch ran with;
  L is the mean training loss over all ranks; A the top-1 accuracy on the
  whole validation set (each rank scores its share); T the epoch's wall time
  with validation; M the global-sync traffic all ranks sent in the epoch; X
  training images per second over all ranks.

checkpoints (--checkpoint-dir, on a file system all ranks see):
  After every epoch E each rank writes epochEEEE-rankRRRRR.pt (its model,
  its DASO state incl. the local optimizer, RNG states), then rank 0 writes
  epochEEEE.done once all ranks have written theirs. Only the last two
  complete checkpoints are kept. --resume continues after the newest epoch
  with a .done marker written by a job of the same shape (world size, ranks
  per node, architecture); without any checkpoint it starts from scratch, so
  the same command line can be used for every job of a chain. A run without
  --resume refuses a directory that already holds checkpoints. The DASO
  schedule resumes as saved (mpidp restores its settings, total epochs
  included; a warning says when the command line asks for others).

exit codes:
  0 done; 2 bad arguments, data or checkpoints; 3 configuration mpidp does
  not support (yet); 1 anything else (the MPI job is aborted on an uncaught
  error so no rank is left waiting).
"""


class RankZeroParser(argparse.ArgumentParser):
    """argparse whose usage errors and help are printed by rank 0 only."""

    def _print_message(self, message, file=None):
        if RANK == 0:
            super()._print_message(message, file)


def parse_args(argv=None) -> argparse.Namespace:
    p = RankZeroParser(description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--data", metavar="DIR",
                      help="data set root with DIR/train/<class>/<image> and "
                           "DIR/val/<class>/<image> "
                           "(ImageNet's layout; class folders are sorted by name)")
    data.add_argument("--synthetic", action="store_true",
                      help="train on random images made on the fly instead of --data (a smoke "
                           "test of the set-up, speed measurements)")
    data.add_argument("--num-classes", type=int, metavar="N", default=1000,
                      help="classes of the --synthetic data (with --data the class folders "
                           "decide) [%(default)s]")
    data.add_argument("--synthetic-train-size", type=int, default=12800, metavar="N",
                      help="images per epoch with --synthetic, over all ranks [%(default)s]")
    data.add_argument("--synthetic-val-size", type=int, default=1280, metavar="N",
                      help="validation images with --synthetic [%(default)s]")
    data.add_argument("--image-size", type=int, metavar="PX", default=224,
                      help="side of the square training/validation crops [%(default)s]")
    data.add_argument("--workers", type=int, metavar="N", default=4,
                      help="DataLoader worker processes per rank (0: load in the training "
                           "process) [%(default)s]")

    train = p.add_argument_group("training")
    train.add_argument("--arch", choices=sorted(ARCHS), default="resnet50",
                       help="network: resnet50, resnet18, or tiny (ResNet-50's structure with one "
                            "block per stage and 4 channels, for tests) [%(default)s]")
    train.add_argument("--width", type=int, metavar="C", default=None,
                       help="channels of the stem (64 for resnet50/18, 4 for tiny) "
                            "[architecture's]")
    train.add_argument("--epochs", type=int, metavar="N", default=90,
                       help="total epochs [%(default)s]")
    train.add_argument("--batch-size", type=int, metavar="N", default=64,
                       help="images per batch per rank [%(default)s]")
    train.add_argument("--lr", type=float, metavar="LR", default=0.1,
                       help="learning rate per 256 images (scaled by the global batch) "
                            "[%(default)s]")
    train.add_argument("--lr-warmup-epochs", type=int, metavar="N", default=5,
                       help="epochs of linear learning-rate warm-up [%(default)s]")
    train.add_argument("--momentum", type=float, metavar="M", default=0.9,
                       help="SGD momentum [%(default)s]")
    train.add_argument("--weight-decay", type=float, metavar="WD", default=1e-4,
                       help="SGD weight decay (not on BatchNorm and biases) [%(default)s]")
    train.add_argument("--amp", action="store_true",
                       help="mixed precision: float16 autocast + GradScaler on GPUs, bfloat16 "
                            "autocast on CPUs")
    train.add_argument("--seed", type=int, metavar="S", default=0, help="random seed [%(default)s]")

    daso = p.add_argument_group("DASO")
    daso.add_argument("--warmup-epochs", type=int, metavar="N", default=4,
                      help="epochs of blocking global averaging at the start [%(default)s]")
    daso.add_argument("--cooldown-epochs", type=int, metavar="N", default=4,
                      help="epochs of blocking global averaging at the end [%(default)s]")
    daso.add_argument("--downcast", choices=("bf16", "fp16", "fp32"), default="bf16",
                      help="dtype parameters are sent in between nodes [%(default)s]")
    daso.add_argument("--max-global-skips", type=int, metavar="N", default=8,
                      help="most batches between two global syncs [%(default)s]")
    daso.add_argument("--stability-level", type=float, metavar="F", default=0.05,
                      help="relative loss change below which the loss counts as stable "
                           "[%(default)s]")
    daso.add_argument("--verbose-daso", action="store_true", help="DASO's own debug messages")

    ckpt = p.add_argument_group("checkpoints and output")
    ckpt.add_argument("--checkpoint-dir", metavar="DIR",
                      help="write a checkpoint after every epoch into DIR (keeps the last 2)")
    ckpt.add_argument("--resume", action="store_true",
                      help="continue after the newest complete checkpoint in --checkpoint-dir "
                           "(start from scratch if there is none)")
    ckpt.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    def bad(message):
        p.error(message)  # prints on rank 0, exits 2 on every rank

    if args.synthetic == (args.data is not None):
        bad("give exactly one of --data DIR and --synthetic")
    for name in ("epochs", "batch_size", "image_size", "num_classes", "synthetic_train_size",
                 "synthetic_val_size", "max_global_skips"):
        if getattr(args, name) < 1:
            bad(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("workers", "lr_warmup_epochs", "warmup_epochs", "cooldown_epochs"):
        if getattr(args, name) < 0:
            bad(f"--{name.replace('_', '-')} must not be negative")
    if args.width is not None and args.width < 1:
        bad("--width must be at least 1")
    if args.lr <= 0:
        bad("--lr must be positive")
    if not 0 <= args.stability_level < 1:
        bad("--stability-level must be in [0, 1)")
    if args.resume and not args.checkpoint_dir:
        bad("--resume needs --checkpoint-dir")
    return args


def fail(message: str, code: int = EXIT_USAGE) -> None:
    """Stop with `code`. Call it on every rank (with the same condition)."""
    if RANK == 0:
        print(f"imagenet_daso.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def log(*args) -> None:
    if RANK == 0:
        print(*args, flush=True)


def on_rank0(fn):
    """Run fn() on rank 0, broadcast (result, error); raise SystemExit everywhere
    on error, so all ranks stop together."""
    result, error = None, None
    if RANK == 0:
        try:
            result = fn()
        except (OSError, ValueError) as exc:
            error = str(exc)
    result, error = COMM.bcast((result, error), root=0)
    if error is not None:
        fail(error)
    return result


# -- data ---------------------------------------------------------------------------------------

def make_datasets(args):
    if args.synthetic:
        train = SyntheticImages(args.synthetic_train_size, args.num_classes, args.image_size,
                                seed=args.seed)
        val = SyntheticImages(args.synthetic_val_size, args.num_classes, args.image_size,
                              seed=args.seed + 1)
        return train, val, args.num_classes

    def scan():
        # One rank lists the files and tells the others: a million stat() calls
        # from every rank at once would flood a parallel file system.
        for split in ("train", "val"):
            if not os.path.isdir(os.path.join(args.data, split)):
                raise ValueError(f"--data {args.data}: no '{split}' folder (expected "
                                 f"{args.data}/train/<class>/<image> and {args.data}/val/...)")
        train = ImageFolder(os.path.join(args.data, "train"))
        unknown = sorted(e.name for e in os.scandir(os.path.join(args.data, "val"))
                         if e.is_dir() and e.name not in train.class_to_idx)
        if unknown:
            raise ValueError(f"--data {args.data}: val has classes that train lacks: "
                             f"{', '.join(unknown[:5])}")
        val = ImageFolder(os.path.join(args.data, "val"), classes=train.classes)
        return train.classes, train.samples, val.samples

    classes, train_samples, val_samples = on_rank0(scan)
    train = ImageFolder.from_samples(os.path.join(args.data, "train"), classes, train_samples,
                                     TrainTransform(args.image_size))
    val = ImageFolder.from_samples(os.path.join(args.data, "val"), classes, val_samples,
                                   EvalTransform(args.image_size))
    return train, val, len(classes)


# -- checkpoints --------------------------------------------------------------------------------

CKPT_RE = re.compile(r"^epoch(\d{4,})-rank(\d{5,})\.pt$")
DONE_RE = re.compile(r"^epoch(\d{4,})\.done$")


def ckpt_path(directory: str, epoch: int, rank: int) -> str:
    return os.path.join(directory, f"epoch{epoch:04d}-rank{rank:05d}.pt")


def done_path(directory: str, epoch: int) -> str:
    return os.path.join(directory, f"epoch{epoch:04d}.done")


def atomic_write(path: str, write) -> None:
    """write(file) into a temporary name beside `path`, fsync, rename: a crash
    leaves either the old file or the complete new one, never half of one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def job_shape(args, topo, num_classes: int) -> dict:
    return {"world_size": WORLD, "n_nodes": topo.n_nodes, "local_size": topo.local_size,
            "arch": args.arch, "width": args.width, "num_classes": num_classes}


def markers(directory: str) -> dict[int, dict]:
    """{epoch: marker contents} of the complete checkpoints in `directory`."""
    found = {}
    if not os.path.isdir(directory):
        return found
    for name in os.listdir(directory):
        m = DONE_RE.match(name)
        if m:
            try:
                with open(os.path.join(directory, name)) as f:
                    found[int(m.group(1))] = json.load(f)
            except (OSError, ValueError):
                continue  # unreadable: not a usable checkpoint
    return found


def find_resume_epoch(args, shape: dict) -> int | None:
    """The newest epoch to resume from, or None to start afresh (rank 0)."""
    done = markers(args.checkpoint_dir)
    if not args.resume:
        if done:
            raise ValueError(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints "
                             f"(epochs {sorted(done)}): add --resume to continue them, or use "
                             "another directory")
        return None
    fits = [e for e, m in done.items() if all(m.get(k) == v for k, v in shape.items())]
    if not fits:
        if done:
            newest = done[max(done)]
            raise ValueError(
                f"--resume: the checkpoints in {args.checkpoint_dir} were written by another job "
                f"shape ({', '.join(f'{k}={newest.get(k)}' for k in shape)}); this job has "
                f"{', '.join(f'{k}={v}' for k, v in shape.items())}")
        return None
    epoch = max(fits)
    missing = [r for r in range(WORLD)
               if not os.path.isfile(ckpt_path(args.checkpoint_dir, epoch, r))]
    if missing:
        raise ValueError(f"--resume: epoch {epoch} is marked complete but the files of ranks "
                         f"{missing[:8]} are missing from {args.checkpoint_dir}")
    return epoch


def save_checkpoint(args, epoch: int, model, daso, shape: dict) -> None:
    """Every rank writes its own file, then rank 0 marks the epoch complete and
    removes all but the last two complete checkpoints."""
    state = {
        "epoch": epoch,
        "model": model.state_dict(),
        "daso": daso.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "shape": shape,
        "args": {k: v for k, v in vars(args).items()},
    }
    atomic_write(ckpt_path(args.checkpoint_dir, epoch, RANK), lambda f: torch.save(state, f))
    COMM.Barrier()  # every rank's file is in place

    def mark_and_prune():
        marker = dict(shape, epoch=epoch, time=time.strftime("%Y-%m-%d %H:%M:%S"))
        atomic_write(done_path(args.checkpoint_dir, epoch),
                     lambda f: f.write(json.dumps(marker, indent=1).encode() + b"\n"))
        complete = sorted(e for e in markers(args.checkpoint_dir) if e < epoch)
        keep = {epoch} | set(complete[-1:])
        names = os.listdir(args.checkpoint_dir)
        # Markers first: a crash in between leaves files without a marker
        # (ignored), never a marker without its files.
        for name in names:
            m = DONE_RE.match(name)
            if m and int(m.group(1)) < epoch and int(m.group(1)) not in keep:
                os.remove(os.path.join(args.checkpoint_dir, name))
        for name in names:
            m = CKPT_RE.match(name)
            if m and int(m.group(1)) < epoch and int(m.group(1)) not in keep:
                os.remove(os.path.join(args.checkpoint_dir, name))

    on_rank0(mark_and_prune)


def load_checkpoint(args, epoch: int, model, daso, device) -> None:
    # Our own files, plain tensors and containers only: the safe loader suffices.
    state = torch.load(ckpt_path(args.checkpoint_dir, epoch, RANK), map_location="cpu",
                       weights_only=True)
    if state["epoch"] != epoch:
        raise RuntimeError(f"checkpoint of rank {RANK}: holds epoch {state['epoch']}, not {epoch}")
    # load_state_dict copies into the existing tensors, which DASO and DDP hold.
    model.load_state_dict(state["model"])
    saved = {k[4:]: v for k, v in state["daso"]["schedule"].items() if k.startswith("cfg.")}
    asked = {"total_epochs": args.epochs, "warmup_epochs": args.warmup_epochs,
             "cooldown_epochs": args.cooldown_epochs, "max_global_skips": args.max_global_skips}
    changed = [f"{k} {saved[k]} (now {v})" for k, v in asked.items()
               if k in saved and saved[k] != v]
    if changed:
        # DASO.load_state_dict restores the whole schedule, its settings included.
        log(f"warning: the DASO schedule continues with the checkpoint's settings: "
            f"{', '.join(changed)}")
    daso.load_state_dict(state["daso"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["rng_cuda"], device)


# -- training -----------------------------------------------------------------------------------

def lr_at(args, epoch: int, peak: float) -> float:
    warm = min(args.lr_warmup_epochs, args.epochs - 1)
    if epoch < warm:
        return peak * (epoch + 1) / (warm + 1)
    span = max(1, args.epochs - warm)
    return peak * 0.5 * (1.0 + math.cos(math.pi * (epoch - warm) / span))


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim > 1 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def autocast(args, device):
    if not args.amp:
        return contextlib.nullcontext()
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.float16)
    return torch.autocast("cpu", dtype=torch.bfloat16)


@torch.no_grad()
def average_bn_stats(model) -> None:
    """BatchNorm running statistics are buffers, which DASO does not sync
    between nodes: average them over all ranks before evaluating."""
    bufs = [b for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            for b in (m.running_mean, m.running_var)]
    if not bufs:
        return
    flat = torch.cat([b.detach().reshape(-1).to("cpu", torch.float64) for b in bufs])
    mpidp.allreduce(flat, op="avg")  # one message for all of them
    offset = 0
    for b in bufs:
        b.copy_(flat[offset:offset + b.numel()].view_as(b))
        offset += b.numel()


@torch.no_grad()
def evaluate(args, model, loader, device) -> float:
    """Top-1 accuracy (%) over the whole validation set: each rank scores its
    shard with the unwrapped model (no DDP collectives, so shards may differ in
    size), then the counts are summed over all ranks."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(args, device):
            pred = model(x).argmax(1)
        counts[0] += (pred == y).sum().item()
        counts[1] += y.numel()
    model.train()
    mpidp.allreduce(counts)
    return 100.0 * counts[0].item() / max(1.0, counts[1].item())


def main(argv=None) -> int:
    args = parse_args(argv)
    topo = mpidp.topology()
    if torch.cuda.is_available():
        device = torch.device("cuda", topo.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            # The node's cores shared among its ranks (torch would take them all on each).
            cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                     else os.cpu_count() or 1)
            torch.set_num_threads(max(1, cores // topo.local_size))

    train_set, val_set, num_classes = make_datasets(args)
    sampler = DistributedSampler(train_set, num_replicas=WORLD, rank=RANK, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader_kw = dict(num_workers=args.workers, pin_memory=device.type == "cuda",
                     persistent_workers=args.workers > 0)
    # drop_last on both: every rank runs the same number of full batches, as DASO needs.
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              drop_last=True, **loader_kw)
    val_loader = DataLoader(Subset(val_set, range(RANK, len(val_set), WORLD)),
                            batch_size=args.batch_size, shuffle=False, **loader_kw)
    if len(train_loader) == 0:
        fail(f"{len(train_set)} training images make no full batch of {args.batch_size} per rank "
             f"on {WORLD} ranks (lower --batch-size)")

    # Which checkpoint to continue from is settled before anything is built,
    # so a wrong --checkpoint-dir stops the job at once.
    shape = job_shape(args, topo, num_classes)
    resume_from = None
    if args.checkpoint_dir:
        on_rank0(lambda: os.makedirs(args.checkpoint_dir, exist_ok=True))
        resume_from = on_rank0(lambda: find_resume_epoch(args, shape))

    torch.manual_seed(args.seed)  # the same initial model everywhere (rank 0's is broadcast anyway)
    model = build_model(args.arch, num_classes, args.width).to(device)
    peak_lr = args.lr * args.batch_size * WORLD / 256.0
    optimizer = torch.optim.SGD(param_groups(model, args.weight_decay), lr=peak_lr,
                                momentum=args.momentum)
    downcast = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.downcast]
    daso = mpidp.DASO(optimizer, total_epochs=args.epochs, comm=COMM,
                      warmup_epochs=args.warmup_epochs, cooldown_epochs=args.cooldown_epochs,
                      stability_level=args.stability_level, max_global_skips=args.max_global_skips,
                      downcast_type=downcast, verbose=args.verbose_daso)
    try:
        net = mpidp.DataParallelMultiGPU(model, daso, comm=COMM)
    except NotImplementedError as exc:  # same device type on every rank, so all stop here
        fail(f"this mpidp cannot run DASO on {device.type} parameters yet ({exc}); run on CPUs "
             "(CUDA_VISIBLE_DEVICES=) or update mpidp", EXIT_UNSUPPORTED)
    scaler = None
    if args.amp and device.type == "cuda":
        scaler = torch.amp.GradScaler("cuda")
        daso.add_scaler(scaler)

    # Each rank its own augmentation stream; a resumed run restores its saved one.
    torch.manual_seed(args.seed * 100_003 + RANK + 1)
    start_epoch = 0
    if resume_from is not None:
        load_checkpoint(args, resume_from, model, daso, device)
        start_epoch = resume_from + 1
        log(f"resumed from {args.checkpoint_dir} after epoch {resume_from} (DASO: phase "
            f"{daso.phase}, global_skip {daso.global_skip}, batches_to_wait "
            f"{daso.batches_to_wait}); continuing at epoch {start_epoch}")
    elif args.resume:
        log(f"no checkpoint in {args.checkpoint_dir} to resume from: starting at epoch 0")
    # After loading: DASO.load_state_dict restores the saved job's last_batch,
    # and this job's batch size may differ.
    daso.last_batch = len(train_loader) - 1

    n_params = sum(p.numel() for p in model.parameters())
    log(f"mpidp {mpidp.__version__} DASO: {WORLD} rank(s) = {topo.n_nodes} node(s) x "
        f"{topo.local_size}, device {device.type}, {args.arch} ({n_params / 1e6:.2f} M params), "
        f"{len(train_set)} train / {len(val_set)} val images, {num_classes} classes, "
        f"{len(train_loader)} batches of {args.batch_size} per rank per epoch, "
        f"peak lr {peak_lr:.4g}"
        f"{', AMP' if args.amp else ''}, downcast {args.downcast}")
    if start_epoch >= args.epochs:
        log(f"nothing to do: {start_epoch} of --epochs {args.epochs} epochs are done")
        return EXIT_OK

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        lr = lr_at(args, epoch, peak_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        phase, gskip, btw = daso.phase, daso.global_skip, daso.batches_to_wait
        sent_before = daso.bytes_sent
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        seen = 0
        start = time.perf_counter()
        net.train()
        # On a terminal the bar redraws and vanishes at the epoch's end; into a
        # log file (srun, nohup) it is written at most once a minute and ends
        # with a newline, so the per-epoch lines stay lines of their own.
        tty = sys.stderr.isatty()
        bar = tqdm(total=len(train_loader), desc=f"epoch {epoch}", unit="batch", leave=not tty,
                   dynamic_ncols=tty, ncols=None if tty else 100, mininterval=0.5 if tty else 60,
                   disable=RANK != 0 or args.no_progress)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            daso.zero_grad()
            with autocast(args, device):
                loss = F.cross_entropy(net(x), y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            daso.step()
            loss_sum += loss.detach().to(torch.float64) * y.numel()
            seen += y.numel()
            bar.update()
            if i % 20 == 0 and not bar.disable:
                bar.set_postfix(loss=f"{loss.item():.3f}", phase=daso.phase, gs=daso.global_skip,
                                refresh=False)
        bar.close()
        train_time = time.perf_counter() - start

        totals = torch.tensor([loss_sum.item(), float(seen), float(daso.bytes_sent - sent_before)],
                              dtype=torch.float64)
        mpidp.allreduce(totals)
        train_loss = totals[0].item() / totals[1].item()
        daso.epoch_loss_logic(train_loss, loss_globally_averaged=True)
        average_bn_stats(model)
        acc = evaluate(args, model, val_loader, device)
        elapsed = time.perf_counter() - start
        log(f"epoch {epoch}/{args.epochs}: phase {phase} global_skip {gskip} batches_to_wait {btw} "
            f"lr {lr:.4g} train_loss {train_loss:.4f} val_top1 {acc:.2f}% time {elapsed:.1f}s "
            f"sent {totals[2].item() / 1e6:.3f} MB ({totals[1].item() / train_time:.1f} img/s)")
        if args.checkpoint_dir:
            save_checkpoint(args, epoch, model, daso, shape)
            log(f"checkpoint: {args.checkpoint_dir}/epoch{epoch:04d}-rank*.pt")
    log(f"done: {args.epochs} epochs")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
