"""Non-blocking host calls of the C++ "mpidp" backend (async_op=True,
funcol, DDP's futures): a call returns once posted, before the other ranks
have made theirs; it ends at its wait, a test, the group's next call, or on
the progress thread once its future was asked for; and every way it can end
gives the values computed here from every rank's data. A rank that differs
from a call the others posted without waiting is named on every rank,
wherever the others find out."""

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from c10d_world import mpidp_world  # noqa: F401  (the "mpidp" default group)
from dp_reference import RANK, SIZE

pytestmark = pytest.mark.ranks3
_c10d = pytest.importorskip("mpidp._c10d", reason="mpidp was built without torch importable "
                                                  "(no C++ backend)")
# The tests' own messages, apart from every communicator mpidp uses.
WORDS = MPI.COMM_WORLD.Dup()


@pytest.fixture(autouse=True)
def cpp_backend():
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    if not isinstance(backend, _c10d.BackendMPIDP):
        pytest.skip("the default group is not the C++ backend (MPIDP_C10D_IMPL=python)")


def data(rank, n=6, scale=1.0):
    return (torch.arange(n, dtype=torch.float64) % 3 + 1 + rank).float() * scale


def everyone(n=6, scale=1.0):
    return torch.stack([data(r, n, scale) for r in range(SIZE)])


def told_by(source, deadline_s=30.0):
    """Whether `source` sent this rank a word on WORDS before the deadline."""
    word = np.zeros(1, dtype=np.int64)
    request = WORDS.Irecv(word, source=source, tag=1)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if request.Test():
            return True
        time.sleep(0.001)
    request.Cancel()
    request.Wait()
    return False


def post(call, scale=1.0, group=None):
    """One non-blocking call of `call`: its work, and a check of its values."""
    if call == "all_reduce":
        t = data(RANK, scale=scale)
        work = dist.all_reduce(t, async_op=True, group=group)
        return work, lambda: torch.equal(t, everyone(scale=scale).sum(0))
    if call == "all_gather_into_tensor":
        out = torch.empty(SIZE * 6)
        work = dist.all_gather_into_tensor(out, data(RANK, scale=scale), async_op=True,
                                           group=group)
        return work, lambda: torch.equal(out, everyone(scale=scale).flatten())
    out = torch.empty(2)
    work = dist.reduce_scatter_tensor(out, data(RANK, 2 * SIZE, scale), async_op=True,
                                      group=group)
    return work, lambda: torch.equal(
        out, everyone(2 * SIZE, scale).sum(0)[2 * RANK:2 * RANK + 2])


CALLS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]


@pytest.mark.skipif(SIZE < 2, reason="needs another rank to be late")
@pytest.mark.parametrize("call", CALLS)
def test_a_non_blocking_call_returns_before_the_other_ranks_make_theirs(call):
    """Rank 0's call returns, not completed, while the others wait for its
    word before they call: a call that blocked would never send it."""
    for step in range(3):           # the sequence the ranks' check predicts
        work, right = post(call, step + 1)
        work.wait()
        assert right()
    if RANK == 0:
        work, right = post(call)
        assert not work.is_completed()
        for r in range(1, SIZE):
            WORDS.Send(np.ones(1, dtype=np.int64), dest=r, tag=1)
    else:
        assert told_by(0), "rank 0's non-blocking call did not return"
        work, right = post(call)
    work.wait()
    assert right()


def test_calls_in_flight_together_each_end_with_their_values():
    """Three calls posted in a row (each ends the one before), then ended in
    reverse order through a wait, a future and tests; a strided output's
    values come back at the end."""
    for step in range(4):
        reduce_work, reduced = post("all_reduce", step + 1)
        strided = torch.zeros(SIZE * 6, 2)[:, 0]
        gather_work = dist.all_gather_into_tensor(strided, data(RANK, scale=step + 1),
                                                  async_op=True)
        scatter_work, scattered = post("reduce_scatter_tensor", step + 1)
        end = time.monotonic() + 60
        while not scatter_work.is_completed():
            assert time.monotonic() < end, "the call never completed"
        assert scattered()
        gather_work.get_future().wait()
        assert torch.equal(strided, everyone(scale=step + 1).flatten())
        reduce_work.wait()
        assert reduced()


def test_a_future_nobody_waits_on_the_work_for_completes():
    """DDP's way: the future, chained, is all that is waited for (the
    progress thread ends the call)."""
    t = data(RANK)
    doubled = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert torch.equal(doubled.wait(), everyone().sum(0) * 2)
    assert torch.equal(t, everyone().sum(0))


def test_a_dropped_work_ends_at_the_groups_next_call():
    for step in range(3):
        t = data(RANK, scale=step + 1)
        dist.all_reduce(t, async_op=True)          # its work is dropped
        u = data(RANK, n=4)
        dist.all_reduce(u)
        assert torch.equal(t, everyone(scale=step + 1).sum(0))
        assert torch.equal(u, everyone(4).sum(0))


def test_destroying_a_group_ends_its_call_in_flight():
    group = dist.new_group(list(range(SIZE)))
    t = data(RANK)
    dist.all_reduce(t, group=group, async_op=True)
    dist.destroy_process_group(group)
    assert torch.equal(t, everyone().sum(0))


ODD = SIZE - 1


@pytest.mark.skipif(SIZE < 2, reason="one rank cannot disagree")
@pytest.mark.parametrize("found_at", ["wait", "future"])
def test_a_rank_that_differs_from_a_call_in_flight_is_named_on_every_rank(found_at):
    """The others posted the predicted call without waiting; the odd rank's
    call differs. Each finds out at that call -- its wait, or its future (on
    the progress thread) --, with its tensor as it was, and the group goes
    on in step."""
    group = dist.new_group(list(range(SIZE)))
    for _ in range(3):
        work, right = post("all_reduce", group=group)
        work.wait()
        assert right()
    mine = data(RANK)
    with pytest.raises(ValueError) as raised:
        if RANK == ODD:
            dist.all_reduce(data(RANK, n=7), async_op=True, group=group)
        else:
            work = dist.all_reduce(mine, async_op=True, group=group)
            if found_at == "wait":
                work.wait()
            else:
                work.get_future().wait()
    message = str(raised.value)
    assert "the ranks' calls differ" in message and "out of step" not in message
    assert (f"global rank(s) {list(range(SIZE - 1))} (group rank(s) {list(range(SIZE - 1))}): "
            "all_reduce of float32 [6] on cpu, op sum") in message
    assert f"rank(s) [{ODD}] (group rank(s) [{ODD}]): all_reduce of float32 [7] on cpu, op sum" \
        in message
    assert torch.equal(mine, data(RANK))       # put back: the call raised
    for step in range(2):          # the group goes on
        work, right = post("all_reduce", step + 1, group=group)
        work.wait()
        assert right()
    dist.destroy_process_group(group)


@pytest.mark.skipif(SIZE < 2, reason="one rank cannot disagree")
@pytest.mark.parametrize("n", [6, 5000])
def test_ranks_that_learn_of_a_difference_a_call_late_put_the_group_out_of_step(n):
    """The others post 50 predicted calls, the last without waiting, and
    learn that the odd rank's call differed only when their next call ends
    it: they raise there and do not make it, while the odd rank raised at
    once and would make its own next call -- from then on each rank's call
    k would pair with another's k+1 and return wrong sums. Every rank
    instead refuses every later call on the group; a new group works."""
    group = dist.new_group(list(range(SIZE)))
    for _ in range(50):
        dist.all_reduce(data(RANK, n), async_op=True, group=group)
    mine = data(RANK, n)
    raised = []
    if RANK == ODD:
        # Once the others posted theirs, so that they learn of it late.
        assert all(told_by(r) for r in range(SIZE - 1))
        with pytest.raises(ValueError, match="the ranks' calls differ"):
            dist.all_reduce(data(RANK, n + 1), async_op=True, group=group)
    else:
        dist.all_reduce(mine, async_op=True, group=group)       # posted; nobody waits
        WORDS.Send(np.ones(1, dtype=np.int64), dest=ODD, tag=1)
    for step in range(3):
        t = data(RANK, n, scale=step + 2)
        try:
            dist.all_reduce(t, group=group)
            raised.append(("returned", t))
        except (ValueError, RuntimeError) as e:
            raised.append((type(e).__name__, str(e)))
            assert torch.equal(t, data(RANK, n, scale=step + 2))
    kinds = [kind for kind, _ in raised]
    assert kinds == (["RuntimeError"] * 3 if RANK == ODD else ["ValueError"] + ["RuntimeError"] * 2)
    if RANK != ODD:
        assert "the ranks' calls differ" in raised[0][1]
        assert f"[{ODD}]): all_reduce of float32 [{n + 1}]" in raised[0][1]
    for _, message in raised:
        assert f"{list(range(SIZE - 1))} (group rank(s) {list(range(SIZE - 1))}) had posted " \
               "the call without waiting" in message
    assert all("went out of step" in m for k, m in raised if k == "RuntimeError")
    if RANK != ODD:
        if n * 4 <= 16 << 10:
            assert torch.equal(mine, data(RANK, n))        # put back
        else:
            assert "holds its result over the ranks that made it" in raised[0][1]
    dist.destroy_process_group(group)
    group = dist.new_group(list(range(SIZE)))
    t = data(RANK, n)
    dist.all_reduce(t, group=group)
    assert torch.equal(t, everyone(n).sum(0))
    dist.destroy_process_group(group)


@pytest.mark.skipif(SIZE < 2, reason="needs another rank to hold the call open")
def test_a_second_thread_calling_while_one_call_runs_is_refused():
    """On rank 0 two threads call all_reduce on the default group at once,
    while the other ranks hold back: the thread that comes second raises
    (a group's calls are one at a time), the first completes once the
    others make their one call."""
    import threading
    t = data(RANK)
    if RANK == 0:
        outcomes = []

        def call():
            mine = data(RANK)
            try:
                dist.all_reduce(mine)
                outcomes.append(("done", mine))
            except RuntimeError as e:
                outcomes.append(("refused", str(e)))

        threads = [threading.Thread(target=call) for _ in range(2)]
        for th in threads:
            th.start()
        end = time.monotonic() + 30
        while not any(kind == "refused" for kind, _ in list(outcomes)):
            assert time.monotonic() < end, "neither thread was refused"
            time.sleep(0.001)
        for r in range(1, SIZE):
            WORDS.Send(np.ones(1, dtype=np.int64), dest=r, tag=1)
        for th in threads:
            th.join(60)
        kinds = sorted(kind for kind, _ in outcomes)
        assert kinds == ["done", "refused"], outcomes
        refused = next(v for k, v in outcomes if k == "refused")
        assert "another thread's call on it was running" in refused
        assert torch.equal(next(v for k, v in outcomes if k == "done"), everyone().sum(0))
    else:
        assert told_by(0), "rank 0's second thread was not refused"
        dist.all_reduce(t)
        assert torch.equal(t, everyone().sum(0))


def test_ranks_that_differ_in_async_op_agree_on_the_values():
    """async_op is a rank's own choice, not part of the call: ranks that
    wait at once and ranks that wait later meet in the same collective."""
    for step in range(3):
        t = data(RANK, scale=step + 1)
        out = torch.empty(SIZE * 6)
        if RANK % 2 == 0:
            works = [dist.all_reduce(t, async_op=True),
                     dist.all_gather_into_tensor(out, data(RANK), async_op=True)]
            for w in reversed(works):
                w.wait()
        else:
            dist.all_reduce(t)
            dist.all_gather_into_tensor(out, data(RANK))
        assert torch.equal(t, everyone(scale=step + 1).sum(0))
        assert torch.equal(out, everyone().flatten())
