"""Train the digits CNN with DiLoCo (or Streaming DiLoCo), with checkpoints.

    srun -n 4 python examples/diloco_digits.py --checkpoint-dir ckpt
    srun -n 4 python examples/diloco_digits.py --checkpoint-dir ckpt --resume --epochs 20
    mpirun -np 4 python examples/diloco_digits.py --fragments 2 --delay 2 --wire bf16

Each rank trains its own replica on its own shard with AdamW (the inner
optimizer); every --sync-every steps the replicas' average distance from the
shared parameters steps them with Nesterov SGD (lr 0.7, momentum 0.9: the
outer optimizer). --fragments 2 syncs the convolutions and the classifier in
turn, --delay k sends each k steps before its turn. After every epoch each
rank writes epoch<E>-rank<R>.pt (model, inner optimizer, DiLoCo state) and
rank 0 marks the epoch complete (epoch<E>.done) once every rank has written;
--resume continues after the last complete epoch, exactly where an
uninterrupted run would be. The test accuracy printed is rank 0's replica's.
"""

import argparse
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpidp  # noqa: E402
from digits import DigitsCNN, accuracy, load_data, train_epoch  # noqa: E402
from mpidp import MPI  # noqa: E402

WIRE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def checkpoint_path(directory: str, epoch: int, rank: int) -> str:
    return os.path.join(directory, f"epoch{epoch:04d}-rank{rank:05d}.pt")


def last_complete_epoch(directory: str) -> int:
    """The newest epoch every rank wrote (its .done marker exists), or -1."""
    if not os.path.isdir(directory):
        return -1
    done = [int(n[5:9]) for n in os.listdir(directory) if n.startswith("epoch") and n.endswith(".done")]
    return max(done, default=-1)


def save(directory, epoch, rank, size, comm, state) -> None:
    os.makedirs(directory, exist_ok=True)
    torch.save(state, checkpoint_path(directory, epoch, rank))
    comm.Barrier()  # every rank's file is written before the epoch counts as complete
    if rank == 0:
        with open(os.path.join(directory, f"epoch{epoch:04d}.done"), "w") as f:
            json.dump({"epoch": epoch, "world_size": size}, f)
        for old in range(epoch - 1):  # keep the last two epochs
            for name in (f"epoch{old:04d}.done", *(os.path.basename(checkpoint_path(directory, old, r))
                                                   for r in range(size))):
                if os.path.exists(os.path.join(directory, name)):
                    os.remove(os.path.join(directory, name))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--inner-lr", type=float, default=2e-3)
    parser.add_argument("--sync-every", type=int, default=20, help="inner steps between syncs")
    parser.add_argument("--fragments", type=int, choices=(1, 2), default=1)
    parser.add_argument("--delay", type=int, default=0, help="fragment_sync_delay")
    parser.add_argument("--alpha", type=float, default=0.0, help="fragment_update_alpha")
    parser.add_argument("--wire", choices=tuple(WIRE), default="fp32")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--resume", action="store_true", help="continue after the last complete epoch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(args.seed)
    train_set, test_set = load_data(args.seed)
    sampler = DistributedSampler(train_set, num_replicas=size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = DigitsCNN()
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    fragments = None if args.fragments == 1 else [
        torch.nn.ModuleList([model.conv1, model.conv2]), torch.nn.ModuleList([model.fc1, model.fc2])]
    diloco = mpidp.DiLoCo(model, inner, outer, args.sync_every, comm, model_fragments=fragments,
                          fragment_sync_delay=args.delay, fragment_update_alpha=args.alpha,
                          wire_dtype=WIRE[args.wire])

    first = 0
    if args.resume:
        epoch = last_complete_epoch(args.checkpoint_dir)
        if epoch >= 0:
            state = torch.load(checkpoint_path(args.checkpoint_dir, epoch, rank), weights_only=True)
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["inner"])
            diloco.load_state_dict(state["diloco"])
            first = epoch + 1
            if rank == 0:
                print(f"resumed from {args.checkpoint_dir} epoch {epoch}: continuing at epoch {first}",
                      flush=True)
    if rank == 0:
        print(f"mpidp {mpidp.__version__}: DiLoCo on {size} rank(s), sync every {args.sync_every} "
              f"steps, {args.fragments} fragment(s), delay {args.delay}, wire {args.wire}, "
              f"{len(loader)} batches per rank per epoch", flush=True)
    with diloco:
        for epoch in range(first, args.epochs):
            start = time.perf_counter()
            sampler.set_epoch(epoch)
            # digits.py's plain loop on the inner optimizer: DiLoCo syncs from
            # its step hook, so the loop needs no change.
            train_loss = train_epoch(model, inner, loader, comm)
            acc = accuracy(model, test_set)
            if rank == 0:
                print(f"epoch {epoch}/{args.epochs}: train_loss {train_loss:.4f} "
                      f"test_acc {acc:.2f}% steps {diloco.step} time "
                      f"{time.perf_counter() - start:.1f}s", flush=True)
            if args.checkpoint_dir:
                save(args.checkpoint_dir, epoch, rank, size, comm,
                     {"epoch": epoch, "model": model.state_dict(), "inner": inner.state_dict(),
                      "diloco": diloco.state_dict()})
    if rank == 0:
        print(f"done: {args.epochs} epochs", flush=True)


if __name__ == "__main__":
    main()
