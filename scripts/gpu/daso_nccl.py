"""DASO with its node-local group over NCCL, at 2 ranks (scripts/gpu_check.sh).

    mpirun -np 2 python scripts/gpu/daso_nccl.py

mpidp's own choice for several ranks on one GPU is gloo (NCCL refuses two
ranks of a communicator on one GPU); this asks for NCCL explicitly and says
what happened. Where NCCL accepts the group, DASO trains in its blocking
phase with fp32 on the wire, which is plain data-parallel SGD, and is compared
with one process training on all the data. Prints one JSON line on rank 0:
{"nccl": "ok" | "refused", "error": ..., "max_abs_diff": ..., "passed": bool}.
Exit status 0 when NCCL was refused (that is a finding, reported) or when the
comparison passed; 1 when NCCL ran and DASO's result was wrong.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mpidp
from mpidp import MPI

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def mlp(seed, device):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 3)).to(device)


def main() -> int:
    device = torch.device("cuda", mpidp.topology().local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    report = {"ranks": SIZE, "gpus": torch.cuda.device_count(), "nccl": "ok"}
    try:
        mpidp.init_process_group(COMM, backend="nccl")
        t = torch.full((4,), float(RANK + 1), device=device)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        assert torch.all(t == SIZE * (SIZE + 1) / 2).item(), t
    except Exception as exc:  # NCCL's refusal is the finding
        report.update(nccl="refused", error=f"{type(exc).__name__}: {exc}"[:600])
    refused = COMM.allreduce(report["nccl"] != "ok", op=MPI.LOR)
    if refused:
        report["nccl"] = "refused"
        report.setdefault("error", "refused on another rank")
        report["passed"] = True
        if RANK == 0:
            print(json.dumps(report))
        return 0

    g = torch.Generator().manual_seed(3)
    W = torch.randn(10, 3, generator=g)
    data = []
    for _ in range(6):
        X = torch.randn(8 * SIZE, 10, generator=g)
        data.append((X.to(device), (X @ W).argmax(1).to(device)))
    model = mlp(100 + RANK, device)   # rank 0's init is adopted
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    daso = mpidp.DASO(opt, total_epochs=2, warmup_epochs=2, cooldown_epochs=0,
                      downcast_type=torch.float32)
    net = mpidp.DataParallelMultiGPU(model, daso)
    reference = mlp(100, device)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    daso.last_batch = len(data) - 1
    n = 8
    for _ in range(2):
        for X, Y in data:
            daso.zero_grad()
            F.cross_entropy(net(X[RANK * n:(RANK + 1) * n]), Y[RANK * n:(RANK + 1) * n]).backward()
            daso.step()
            ref_opt.zero_grad()
            F.cross_entropy(reference(X), Y).backward()
            ref_opt.step()
        daso.epoch_loss_logic(0.0)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    report.update(backend=dist.get_backend(), max_abs_diff=diff, passed=diff < 1e-5)
    report["passed"] = bool(COMM.allreduce(int(report["passed"]), op=MPI.MIN))
    if RANK == 0:
        print(json.dumps(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
