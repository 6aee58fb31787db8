"""Futures of the "mpidp" backend whose callbacks make collectives and wait
for them, as torch's DDP communication hooks do: `then` chains, waits on a
future or a Work inside a callback, callbacks nested two deep, several
chains in flight at once, and DDP trained with PowerSGD and the fp16/bf16
compression hooks and wrappers, in one bucket and in several.

The chains' values are computed here from every rank's data. The DDP runs
are compared with the same training on a gloo group, whose hook waits for
each bucket's future before returning: gloo completes futures on its own
threads, and with several buckets the callbacks of one bucket race the
next bucket's allreduce there (it hangs or mismatches), so waiting makes
its order the one every rank agrees on. On "mpidp" the hooks run as they
are. A callback's wait ends by the deadline like any other (the serial
tests at the end)."""

import datetime
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import mpidp
from c10d_world import mpidp_world  # noqa: F401  (the "mpidp" default group)
from dp_reference import RANK, SIZE
from mpi_jobs import run_mpi

pytestmark = pytest.mark.ranks3


def data(rank, n=6, scale=1.0):
    return (torch.arange(n, dtype=torch.float64) % 3 + 1 + rank).float() * scale


def total(n=6, scale=1.0):
    return torch.stack([data(r, n, scale) for r in range(SIZE)]).sum(0)


def all_reduce_future(t, group=None):
    return dist.all_reduce(t, async_op=True, group=group).get_future()


def test_a_callback_makes_a_collective_and_waits_for_its_future():
    """The chain that hung: the callback runs on the thread that completes
    futures, and waits for a future only another thread can complete."""
    b = data(RANK, scale=10)
    out = all_reduce_future(data(RANK)).then(
        lambda f: all_reduce_future(b).wait()[0] + f.value()[0]).wait()
    assert torch.equal(out, total() * 11)


def test_a_callback_waits_for_a_work_and_makes_a_blocking_call():
    b, c = data(RANK, scale=10), data(RANK, scale=100)

    def callback(f):
        dist.all_reduce(b, async_op=True).wait()
        dist.all_reduce(c)
        return f.value()[0] + b + c

    out = all_reduce_future(data(RANK)).then(callback).wait()
    assert torch.equal(out, total() * 111)


def test_callbacks_nested_two_deep_each_waiting_for_the_next():
    """A callback whose collective's future has a callback of its own that
    makes a third collective, each waited for inside the one before."""
    def inner(f):
        c = data(RANK, scale=100)
        return all_reduce_future(c).wait()[0] + f.value()[0]

    def outer(f):
        b = data(RANK, scale=10)
        return all_reduce_future(b).then(inner).wait() + f.value()[0]

    out = all_reduce_future(data(RANK)).then(outer).wait()
    assert torch.equal(out, total() * 111)


def test_several_chains_in_flight_end_in_any_order():
    """Three calls, each with a callback that makes a collective; waited for
    in reverse. Every rank makes the callbacks' calls in the same order (each
    call's callbacks come before the program's next call)."""
    chains = []
    for k in range(3):
        extra = data(RANK, scale=10 ** (k + 1))
        chains.append(all_reduce_future(data(RANK, scale=k + 1)).then(
            lambda f, extra=extra: all_reduce_future(extra).wait()[0] + f.value()[0]))
    for k, chain in reversed(list(enumerate(chains))):
        assert torch.equal(chain.wait(), total() * (k + 1 + 10 ** (k + 1)))


def test_a_callback_on_a_subgroup_beside_the_default_groups_calls():
    group = dist.new_group(list(range(SIZE)))
    b = data(RANK, scale=10)
    chain = all_reduce_future(data(RANK)).then(
        lambda f: all_reduce_future(b, group).wait()[0] + f.value()[0])
    c = data(RANK, scale=100)
    dist.all_reduce(c)
    assert torch.equal(chain.wait(), total() * 11)
    assert torch.equal(c, total() * 100)
    dist.destroy_process_group(group)


# -- DDP's communication hooks -------------------------------------------------

def _powersgd_state():
    return psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                              start_powerSGD_iter=2, random_seed=7)


HOOKS = {
    "powerSGD": (psgd.powerSGD_hook, _powersgd_state),
    "fp16": (default_hooks.fp16_compress_hook, lambda: None),
    "bf16": (default_hooks.bf16_compress_hook, lambda: None),
    "fp16_powerSGD": (default_hooks.fp16_compress_wrapper(psgd.powerSGD_hook), _powersgd_state),
    "bf16_powerSGD": (default_hooks.bf16_compress_wrapper(psgd.powerSGD_hook), _powersgd_state),
}
# torch 2.13's batched_powerSGD_hook fails on every backend before it
# communicates: it hands _orthogonalize, which now asserts a batch of
# matrices (3 dimensions), a single 2-dimensional Q.
# One bucket for the whole model, and a bucket per layer or so.
BUCKET_MB = {"one_bucket": 25.0, "buckets": 0.01}
STEPS = 5


def _train(hook_name: str, bucket_mb: float, wait_in_hook: bool) -> list:
    """The parameters after STEPS steps of DDP with the hook, each rank on
    its own batches, on the default group."""
    hook, state = HOOKS[hook_name]

    # Under another name: DDP refuses the bf16 hooks by name without NCCL.
    def run(state, bucket):
        future = hook(state, bucket)
        if wait_in_hook:
            future.wait()
        return future
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    ddp.register_comm_hook(state(), run)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + RANK)
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def on_gloo():
    """Every hook's training on a gloo default group (the hook waiting for
    each bucket), then the "mpidp" default group again."""
    dist.destroy_process_group()
    mpidp.init_process_group(backend="gloo")
    try:
        results = {(h, b): _train(h, mb, wait_in_hook=True)
                   for h in HOOKS for b, mb in BUCKET_MB.items()}
    finally:
        # Every rank done with gloo before any closes its connections: a
        # gloo thread reading from a closed peer aborts the process.
        dist.barrier()
        dist.destroy_process_group()
        dist.init_process_group("mpidp")
    return results


@pytest.mark.parametrize("buckets", list(BUCKET_MB))
@pytest.mark.parametrize("hook_name", list(HOOKS))
def test_ddp_hook_trains_as_on_gloo(on_gloo, hook_name, buckets):
    assert dist.get_backend() == "mpidp"
    got = _train(hook_name, BUCKET_MB[buckets], wait_in_hook=False)
    # gloo and MPI add more than two ranks' values in different orders, and
    # PowerSGD's orthogonalisation carries the last bits on.
    for mine, gloo in zip(got, on_gloo[(hook_name, buckets)]):
        torch.testing.assert_close(mine, gloo, rtol=1e-3, atol=1e-4)


# -- deadlines -------------------------------------------------------------------

_NEVER_JOINED = """
    import datetime, sys, time, torch, torch.distributed as dist, mpidp
    dist.init_process_group("mpidp")
    rank = dist.get_rank()
    lonely = dist.new_group([0, 1])
    a, b = torch.ones(4), torch.ones(4)
    chain = dist.all_reduce(a, async_op=True).get_future().then(
        lambda f: dist.all_reduce(b, group=lonely, async_op=True).get_future().wait()
        if rank == 0 else None)                  # rank 1 never makes the second call
    try:
        chain.wait()
        outcome = "returned"
    except Exception as e:
        outcome = f"raised: {type(e).__name__} {e}"
    with open(f"{sys.argv[1]}/rank{rank}", "w") as f:
        f.write(outcome)
    time.sleep(120 if rank else 0)
"""

_SLOW_CALLBACK = """
    import sys, time, torch, torch.distributed as dist, mpidp
    dist.init_process_group("mpidp")
    a, b = torch.ones(4), torch.ones(4)
    chain = dist.all_reduce(a, async_op=True).get_future().then(lambda f: time.sleep(60))
    time.sleep(0.5)                              # the callback runs, on another thread
    try:
        dist.all_reduce(b)                       # comes after the callback's calls
        outcome = "returned"
    except Exception as e:
        outcome = f"raised: {type(e).__name__} {e}"
    with open(f"{sys.argv[1]}/rank{dist.get_rank()}", "w") as f:
        f.write(outcome)
    # Rank 1 stays: its exit after a timeout aborts the job, which could
    # kill rank 0 before it wrote (the ranks time out apart on a loaded node).
    time.sleep(30 if dist.get_rank() else 0)
"""


@pytest.mark.serial
@pytest.mark.parametrize("on_timeout", ["abort", "raise"])
@pytest.mark.parametrize("program", ["never_joined", "slow_callback"])
def test_a_wait_on_or_for_a_callback_ends_at_the_deadline(tmp_path, program, on_timeout):
    """A callback waiting for a collective no other rank makes, and a call
    waiting for a callback that does not return: both end at the group's
    deadline (MPIDP_TIMEOUT), aborting the job or raising CommTimeout."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(
        {"never_joined": _NEVER_JOINED, "slow_callback": _SLOW_CALLBACK}[program]))
    # Each rank writes its outcome to a file of its own: the two ranks'
    # printed lines can interleave mid-line in mpirun's forwarded output.
    rc, out, seconds = run_mpi(2, [str(script), str(tmp_path)], timeout=150,
                               MPIDP_TIMEOUT="3", MPIDP_ON_TIMEOUT=on_timeout)
    rank0 = tmp_path / "rank0"
    outcome = rank0.read_text() if rank0.exists() else None
    assert outcome != "returned", out
    assert seconds < 60, f"the job took {seconds:.0f} s to end:\n{out}"
    assert rc != 0, out
    if on_timeout == "raise":    # torch wraps a callback's exception in a RuntimeError
        assert outcome is not None and outcome.startswith("raised:"), out
        assert "CommTimeout" in outcome, f"{outcome}\n{out}"
    else:
        assert "aborting the job" in out, out
    said = f"{outcome}\n{out}"
    assert "timed out" in said, said
    if program == "slow_callback":
        assert "the callbacks of an earlier call's future" in said, said
