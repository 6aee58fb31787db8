"""A training script written the way Heat's DataParallel and DASO examples are,
with only `import heat as ht` changed to `import mpidp as ht` (tests/algorithms/daso/test_heat_compat.py
runs it under mpirun).

    python heat_style_train.py dp|daso [--node-local-group]

--node-local-group: the script initialises torch.distributed over its node
itself, as Heat's DASO checklist asks (MASTER_ADDR/MASTER_PORT from the
environment); without it, DataParallelMultiGPU creates the groups."""

import os
import sys
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import mpidp as ht  # was: import heat as ht


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 64)
        self.fc2 = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def data(n, seed):
    """Labels from one fixed linear map, inputs drawn with `seed`."""
    w = torch.randn(20, 4, generator=torch.Generator().manual_seed(123))
    x = torch.randn(n, 20, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ w).argmax(1))


def main(method, node_local_group, epochs=6):
    rank, size = ht.MPI_WORLD.rank, ht.MPI_WORLD.size
    torch.manual_seed(rank)  # Heat's wrappers make rank 0's values everyone's
    model = Net()
    if method == "dp":
        optimizer = ht.optim.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                   blocking=False)
        net = ht.nn.DataParallel(model, comm=ht.MPI_WORLD, optimizer=optimizer,
                                 blocking_parameter_updates=False)
        stepper = optimizer
    else:
        if node_local_group:
            per_node = int(os.environ["RANKS_PER_NODE"])
            os.environ["MASTER_PORT"] = str(int(os.environ["BASE_PORT"]) + rank // per_node)
            dist.init_process_group("gloo", rank=rank % per_node, world_size=per_node)
        local = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        daso = ht.optim.DASO(local_optimizer=local, total_epochs=epochs, warmup_epochs=1,
                             cooldown_epochs=1, max_global_skips=4, stability_level=0.05)
        net = ht.nn.DataParallelMultiGPU(model, daso, comm=ht.MPI_WORLD)
        stepper = daso
    train = data(2048, seed=0)
    sampler = DistributedSampler(train, num_replicas=size, rank=rank, shuffle=True, seed=1)
    loader = DataLoader(train, batch_size=32, sampler=sampler)
    if method == "daso":
        daso.last_batch = len(loader) - 1
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        net.train()
        total = 0.0
        for x, y in loader:
            stepper.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            stepper.step()
            total += loss.item()
        if method == "daso":
            daso.epoch_loss_logic(total / len(loader))
    net.eval()
    test = data(512, seed=1)
    with torch.no_grad():
        accuracy = (net(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    digest = zlib.crc32(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"rank {rank}: accuracy {accuracy:.3f} digest {digest}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], "--node-local-group" in sys.argv)
