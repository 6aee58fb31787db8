"""Horovod's elastic PyTorch example, as its users write it, with only the
import changed: launched by tests/fault_tolerance/ulfm/test_horovod_elastic.py through
scripts/mpirun_ft.sh. DistributedOptimizer, TorchState with a step counter,
commit() after every step; the ranks named in FT_KILL ("<ranks>:<step>:<phase>",
as train_ft.py) SIGKILL themselves. Every rank trains on its own data stream
(its rank in the launched job, train_ft.batch); each survivor saves its
parameters, momentum, the sizes it trained at and its resets to
<out>/rank-<launched rank>.pt."""

import os
import signal
import sys

import torch

import mpidp.horovod.torch as hvd
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_ft  # noqa: E402

LAUNCHED = MPI.COMM_WORLD.Get_rank()


def main(out_dir: str) -> None:
    plan = train_ft.kill_plan()
    hvd.init()
    model = train_ft.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    resets = []
    state = hvd.elastic.TorchState(model, optimizer, step=0, sizes=[])
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    def maybe_die(step, phase):
        if any(LAUNCHED in ranks and s == step and p == phase for ranks, s, p in plan):
            os.kill(os.getpid(), signal.SIGKILL)

    @hvd.elastic.run
    def train(state):
        while state.step < train_ft.STEPS:
            maybe_die(state.step, "forward")
            optimizer.zero_grad()
            x, y = train_ft.batch(LAUNCHED, state.step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            maybe_die(state.step, "step")   # after the forward, before backward's allreduces
            loss.backward()
            optimizer.step()
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            state.commit()

    train(state)
    torch.save({"params": [p.detach() for p in model.parameters()],
                "momentum": [optimizer.state[p]["momentum_buffer"] for p in model.parameters()],
                "sizes": state.sizes, "resets": resets},
               os.path.join(out_dir, f"rank-{LAUNCHED}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
