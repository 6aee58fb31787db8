"""A short training job for `make valgrind`: small enough to run under
valgrind memcheck in a few minutes, broad enough to run every path of the C
extension that training takes.

    python tests/valgrind/job.py [dp] [daso]     (default: both, in this order)

dp    mpidp.allreduce (fp32, float64, bf16 and fp16 wire, sum and avg, async
      Work waited, polled, dropped; an empty tensor; a view with an offset);
      DataParallel blocking with a bf16 wire, then non-blocking (Heat's
      default) with fp32, each for a few SGD steps.
daso  DASO with a bf16 wire through warm-up, cycling (global skips with a
      sync pending across batches) and cool-down, with a sending_chunk_size
      smaller than a parameter so the chunked allreduce runs, and a
      checkpoint round trip in the middle: state_dict(), a new model, DASO
      and DataParallelMultiGPU, load_state_dict(), then the remaining epochs.
      The node layout comes from MPIDP_RANKS_PER_NODE (1: every rank is a
      node; 2 at 4 ranks: 2 nodes x 2, with node-local DDP over gloo).

Each rank trains on different data; the job checks that the ranks end with
identical parameters, so a run that silently skipped the communication would
fail. Sizes are tiny on purpose: under valgrind everything runs ~50x slower.
"""

import copy
import os
import sys
import time
import warnings

T0 = time.monotonic()

import torch  # noqa: E402  (timed: most of a valgrind run is this import)
import torch.nn.functional as F

import mpidp  # noqa: E402
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def stub_dynamo():
    """torch.optim's first step() and __init__ import torch._dynamo (about 800
    modules, for its graph_break() and disable() decorators). Natively that
    takes seconds; under valgrind minutes, longer than the rest of the job.
    None of it touches mpidp, so with VG_STUB_DYNAMO=1 (run.sh sets it) a stub
    with the few no-ops eager mode needs stands in for it. A torch that needs
    more of torch._dynamo fails here loudly (AttributeError), not silently."""
    import types

    def disable(fn=None, recursive=True, **_):
        return fn if fn is not None else (lambda f: f)

    stub = types.ModuleType("torch._dynamo")
    stub.disable = disable
    stub.graph_break = lambda *args, **kwargs: None
    stub.is_compiling = lambda: False
    # torch.distributed.init_process_group (the node-local group of DASO at
    # nodes of 2) clears one of dynamo's caches.
    stub.trace_rules = types.SimpleNamespace(clear_lru_cache=lambda: None)
    # DistributedDataParallel asks which reducer dynamo wants: the default.
    stub.utils = types.SimpleNamespace(get_optimize_ddp_mode=lambda: "ddp_optimizer")
    sys.modules["torch._dynamo"] = stub
    torch._dynamo = stub


if os.environ.get("VG_STUB_DYNAMO") == "1":
    stub_dynamo()


def log(msg):
    if RANK == 0:
        print(f"[valgrind job] {time.monotonic() - T0:7.1f} s  {msg}", flush=True)


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 24),
                               torch.nn.ReLU(), torch.nn.Linear(24, 3))


def batches(n, per_rank=4, seed=5):
    """Every rank's own slice of n global batches."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(8, 3, generator=g)
    out = []
    for _ in range(n):
        X = torch.randn(per_rank * SIZE, 8, generator=g)
        Y = (X @ W).argmax(1)
        out.append((X[RANK * per_rank:(RANK + 1) * per_rank], Y[RANK * per_rank:(RANK + 1) * per_rank]))
    return out


def assert_same_on_all_ranks(model, what):
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    first = COMM.bcast(flat if RANK == 0 else None, root=0)
    if not torch.equal(flat, first):
        raise AssertionError(f"{what}: rank {RANK} differs from rank 0 by "
                             f"{(flat - first).abs().max().item()}")


def check(cond, what):
    if not cond:
        raise AssertionError(f"rank {RANK}: {what}")


# --- DataParallel and allreduce ------------------------------------------------


def job_allreduce():
    total = SIZE * (SIZE + 1) / 2
    for dtype in (torch.float32, torch.float64):
        t = torch.full((1000,), float(RANK + 1), dtype=dtype)
        mpidp.allreduce(t)
        check(torch.all(t == total), f"sum {dtype}")
    for wire in (torch.bfloat16, torch.float16):
        t = torch.full((3001,), float(RANK + 1))
        mpidp.allreduce(t, op="avg", wire_dtype=wire)
        check(torch.allclose(t, torch.full_like(t, total / SIZE), rtol=1e-2), f"avg wire {wire}")
    # Async: waited, polled to completion, dropped unwaited.
    t = torch.full((1 << 15,), float(RANK + 1))
    work = mpidp.allreduce(t, async_op=True, wire_dtype=torch.bfloat16)
    work.wait()
    check(work.is_completed() and torch.all(t == total), "async wait")
    t = torch.full((5000,), float(RANK + 1))
    work = mpidp.allreduce(t, async_op=True)
    deadline = time.monotonic() + 600
    while not work.is_completed() and time.monotonic() < deadline:
        pass
    work.wait()
    check(torch.all(t == total), "async poll")
    t = torch.full((4096,), float(RANK + 1), dtype=torch.float64)
    mpidp.allreduce(t, async_op=True)           # dropped: completes on its own
    check(torch.all(t == total), "dropped work")
    base = torch.zeros(16)
    base[3:11] = float(RANK + 1)
    mpidp.allreduce(base[3:11])                 # a view with a byte offset
    check(torch.all(base[3:11] == total) and torch.all(base[:3] == 0), "view")
    mpidp.allreduce(torch.zeros(0))             # empty
    log("allreduce ok")


def job_data_parallel(blocking, wire):
    model = mlp(100 + RANK)                     # ranks start different: rank 0's wins
    opt = mpidp.DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    # Small caps, so there are several buckets (and a first small one).
    net = mpidp.DataParallel(model, optimizer=opt, blocking_parameter_updates=blocking,
                             wire_dtype=wire, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005)
    check(net.bucket_count > 1, "several buckets")
    check(net.blocking_parameter_updates == blocking, "no fallback to blocking")
    for X, Y in batches(4, seed=11):
        opt.zero_grad()
        F.cross_entropy(net(X), Y).backward()
        opt.step()
    net.eval()                                  # non-blocking: applies the last update
    assert_same_on_all_ranks(model, f"DataParallel blocking={blocking}")
    net.remove_hooks()
    log(f"DataParallel blocking={blocking} wire={wire} ok")


def job_dp():
    job_allreduce()
    job_data_parallel(blocking=True, wire=torch.bfloat16)
    job_data_parallel(blocking=False, wire=None)


# --- DASO -------------------------------------------------------------------------


EPOCHS = 5          # warm-up 1, cycling 3, cool-down 1
BATCHES = 6         # last_batch 5: in cycling (gs 4, btw 1) sends on 0, 4, 5


def make_daso():
    model = mlp(200 + RANK)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    daso = mpidp.DASO(opt, total_epochs=EPOCHS, warmup_epochs=1, cooldown_epochs=1,
                      max_global_skips=4, downcast_type=torch.bfloat16,
                      sending_chunk_size=100)   # < 24*24: several chunks per send
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # "one rank per node" at nodes of 1
        net = mpidp.DataParallelMultiGPU(model, daso)
    daso.last_batch = BATCHES - 1
    return model, daso, net


def train_epochs(model, daso, net, data, epochs, phases):
    for _ in range(epochs):
        total = 0.0
        for X, Y in data:
            daso.zero_grad()
            loss = F.cross_entropy(net(X), Y)
            loss.backward()
            daso.step()
            total += loss.item()
        daso.epoch_loss_logic(total / len(data))
        phases.append(daso.phase)
        assert_same_on_all_ranks(model, f"DASO after epoch {daso.epoch}")


def job_daso():
    data = batches(BATCHES, seed=21)
    phases = []
    model, daso, net = make_daso()
    check(daso.phase == "warmup", "starts in warm-up")
    train_epochs(model, daso, net, data, 2, phases)
    check(daso.phase == "cycling" and daso.global_skip > 1, f"cycling, gs {daso.global_skip}")

    saved_model = copy.deepcopy(model.state_dict())
    saved_daso = copy.deepcopy(daso.state_dict())
    del model, daso, net
    model, daso, net = make_daso()              # a new job from the checkpoint
    model.load_state_dict(saved_model)
    daso.load_state_dict(saved_daso)
    check(daso.epoch == 2 and daso.phase == "cycling", "restored at epoch 2, cycling")
    train_epochs(model, daso, net, data, EPOCHS - 2, phases)
    check(phases[0] == "cycling" and phases[-1] == "cooldown", f"phases {phases}")
    if daso.n_nodes > 1:
        check(daso.bytes_sent > 0, "global syncs sent bytes")
    log(f"DASO ok: {daso.n_nodes} nodes x {daso.loc_size}, phases after each epoch {phases}")


def main(argv):
    parts = argv or ["dp", "daso"]
    log(f"imported torch {torch.__version__} and mpidp; {SIZE} ranks")
    for part in parts:
        {"dp": job_dp, "daso": job_daso}[part]()
    COMM.Barrier()
    log("done")


if __name__ == "__main__":
    main(sys.argv[1:])
