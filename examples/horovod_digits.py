"""Horovod's PyTorch MNIST example, on scikit-learn's bundled digits (no
download), with only the import changed:

    import mpidp.horovod.torch as hvd          # was: import horovod.torch as hvd

    mpirun -np 4 python examples/horovod_digits.py [--batches-per-allreduce 2] [--fp16-allreduce]

Everything else is Horovod's recipe: hvd.init(), one thread per rank, a
DistributedSampler over hvd.size() ranks, the learning rate scaled by
hvd.size() x batches per allreduce, the broadcasts of the parameters and of
the optimizer state from rank 0, DistributedOptimizer (compression, op,
backward_passes_per_step, gradient_predivide_factor), and metrics averaged
with hvd.allreduce(name=...). --save writes rank 0's final state_dict.
"""

import argparse

import torch
import torch.nn.functional as F
import torch.utils.data.distributed

import mpidp.horovod.torch as hvd
from digits import DigitsCNN, load_data

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--batches-per-allreduce", type=int, default=1)
parser.add_argument("--save", default=None, help="rank 0 saves the final state_dict here")


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset, test_dataset = load_data(args.seed)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=1000, sampler=test_sampler)

    model = DigitsCNN()
    lr_scaler = args.batches_per_allreduce * hvd.size() if not args.use_adasum else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler,
                                momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
        backward_passes_per_step=args.batches_per_allreduce)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            # Split the batch into batches_per_allreduce micro-batches.
            for i in range(0, len(data), args.batch_size // args.batches_per_allreduce):
                chunk = slice(i, i + args.batch_size // args.batches_per_allreduce)
                output = model(data[chunk])
                loss = F.cross_entropy(output, target[chunk])
                loss.div_(args.batches_per_allreduce)
                loss.backward()
            optimizer.step()
        model.eval()
        test_loss, test_accuracy = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.cross_entropy(output, target, reduction="sum").item()
                test_accuracy += (output.argmax(1) == target).float().sum().item()
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {100 * test_accuracy:.1f}%",
                  flush=True)
    if args.save and hvd.rank() == 0:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
