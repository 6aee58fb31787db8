"""Bagua's AsyncModelAverageAlgorithm in fault-tolerant mode (launched by
tests/fault_tolerance/ulfm/test_fault_tolerance.py through scripts/mpirun_ft.sh): each rank
starts from weights of its own (own_weights, once with_bagua's set-up gave
every rank rank 0's) and steps with
a learning rate of 0, so the weights move only by the background thread's
averaging: a round applied by every rank leaves them all at the mean of
theirs. The rank FT_VICTIM ends itself with SIGKILL before step FT_AT; the
survivors catch RanksLost (at their next step once their threads saw the
loss), recover() and go on, the thread starting again over them
(FT_REPLACE=1: recover(replace=True), and a replacement, starting from
rank 0's weights, trains in the victim's place). At the end the threads
stop together and every survivor (and replacement) saves its weights, its
initial ones, the thread's rounds and its recoveries to
FT_OUT/rank-<launched rank (a replacement: the victim's)>.pt."""

import os
import signal
import sys
import time

import torch
from mpi4py import MPI

import mpidp

STEPS = 40
LAUNCHED_RANK = MPI.COMM_WORLD.Get_rank()


def own_weights(model, launched_rank: int):
    """Rank `launched_rank`'s weights to start from, one tensor per parameter."""
    g = torch.Generator().manual_seed(100 + launched_rank)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def main(out_dir: str) -> None:
    victim, at = int(os.environ["FT_VICTIM"]), int(os.environ["FT_AT"])
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    algorithm = mpidp.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1)
    net = mpidp.with_bagua(model, [opt], algorithm)   # every rank takes rank 0's weights
    replace = bool(os.environ.get("FT_REPLACE"))
    recoveries, step, key = [], 0, LAUNCHED_RANK
    if mpidp.fault_tolerance.is_replacement():
        initial = [p.detach().clone() for p in model.parameters()]    # rank 0's, as it joined
        step, key = mpidp.fault_tolerance.share_state()["step"], victim
    else:
        algorithm.abort(net)     # the threads stop while each rank takes weights of its own
        initial = own_weights(model, LAUNCHED_RANK)
        with torch.no_grad():
            for p, mine in zip(model.parameters(), initial):
                p.copy_(mine)
        algorithm.resume(net)
    g = torch.Generator().manual_seed(key)
    while step < STEPS:
        try:
            if key == victim and step == at and not mpidp.fault_tolerance.is_replacement():
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            time.sleep(0.005)     # rounds run between the steps
        except mpidp.RanksLost:
            m = mpidp.recover(replace=replace)
            recoveries.append({"step": step, "rank": m.rank, "size": m.size, "lost": m.lost,
                               "joined": m.joined})
            step = mpidp.fault_tolerance.steps_committed()
            if m.joined:
                mpidp.fault_tolerance.share_state({"step": step})
    algorithm.abort(net)         # every rank's thread stops at the same round
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "initial": initial,
                "rounds": net.bagua_driver.rounds, "recoveries": recoveries, "steps": step},
               os.path.join(out_dir, f"rank-{key}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
