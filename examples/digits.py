"""Train a small CNN on scikit-learn's bundled digits images with mpidp.

    mpirun -np 4 python examples/digits.py                   (or: srun -n 4 python ...)
    MPIDP_RANKS_PER_NODE=2 mpirun -np 4 python examples/digits.py   (2 emulated nodes x 2)

The 8x8 digit images ship with scikit-learn (no download). Each rank trains on
its own shard of the training set (torch's DistributedSampler). By default the
ranks train with DASO (--method daso): node-local DDP every batch, global
parameter averages between nodes that the schedule skips, delays and sends as
bf16. --method dp / dp-nonblocking use mpidp.DataParallel instead. Rank 0 shows
a progress bar and, per epoch, the DASO phase, global skips, batches to wait,
the training loss and the test accuracy.
"""

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import mpidp
from mpidp import MPI


class DigitsCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_data(seed: int):
    """Digits as (N, 1, 8, 8) float tensors scaled to [0, 1], split 80/20."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(np.arange(len(y)), test_size=0.2, random_state=seed,
                                           stratify=digits.target)
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


@torch.no_grad()
def accuracy(model, dataset) -> float:
    model.eval()
    x, y = dataset.tensors
    correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return 100.0 * correct / len(y)


def train_epoch(net, optimizer, loader, comm, bar=None) -> float:
    """One pass over `loader`, a step of `optimizer` per batch (advancing
    `bar`, if given); returns the epoch's mean training loss over every rank."""
    total = torch.zeros(2, dtype=torch.float64)  # (sum of the images' losses, images)
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        total += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
        if bar is not None:
            bar.update()
    mpidp.allreduce(total, comm=comm)
    return (total[0] / total[1]).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=("daso", "dp", "dp-nonblocking"), default="daso")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--downcast", choices=("bf16", "fp16", "fp32"), default="bf16",
                        help="DASO: dtype of the global syncs on the wire")
    parser.add_argument("--warmup-epochs", type=int, default=2, help="DASO")
    parser.add_argument("--cooldown-epochs", type=int, default=2, help="DASO")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if "OMP_NUM_THREADS" not in os.environ:
        # The node's cores shared among its ranks (torch would take them all
        # on each, and ranks that outnumber the cores would slow each other down).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // mpidp.topology().local_size))
    torch.manual_seed(args.seed)
    train_set, test_set = load_data(args.seed)
    sampler = DistributedSampler(train_set, num_replicas=size, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = DigitsCNN()
    daso = None
    if args.method == "daso":
        local = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        wire = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.downcast]
        daso = mpidp.DASO(local, total_epochs=args.epochs, comm=comm, warmup_epochs=args.warmup_epochs,
                          cooldown_epochs=args.cooldown_epochs, downcast_type=wire)
        net = mpidp.DataParallelMultiGPU(model, daso, comm=comm)
        daso.last_batch = len(loader) - 1
        optimizer = daso
    else:
        optimizer = mpidp.DataParallelOptimizer(
            torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
        net = mpidp.DataParallel(model, comm=comm, optimizer=optimizer,
                                 blocking_parameter_updates=args.method == "dp")

    topo = mpidp.topology(comm)
    if rank == 0:
        print(f"mpidp {mpidp.__version__}: {args.method} on {size} rank(s) ({topo.n_nodes} node(s) "
              f"x {topo.local_size}), {len(train_set)} training images, {len(loader)} batches of "
              f"{args.batch_size} per rank per epoch", flush=True)
    start = time.perf_counter()
    bar = tqdm(total=args.epochs * len(loader), disable=rank != 0 or args.quiet, unit="batch",
               leave=False)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        mean_loss = train_epoch(net, optimizer, loader, comm, bar)
        if daso is not None:
            phase = f"{daso.phase:<8} gs {daso.global_skip} btw {daso.batches_to_wait}"
            daso.epoch_loss_logic(mean_loss, loss_globally_averaged=True)
        else:
            phase = args.method
        acc = accuracy(net, test_set)
        if rank == 0:
            bar.write(f"epoch {epoch:3d}  {phase}  loss {mean_loss:.4f}  test accuracy {acc:6.2f}%")
    bar.close()
    elapsed = time.perf_counter() - start
    acc = accuracy(net, test_set)
    if rank == 0:
        print(f"test accuracy {acc:.2f}% after {args.epochs} epochs in {elapsed:.1f} s", flush=True)


if __name__ == "__main__":
    main()
