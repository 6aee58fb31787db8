"""Horovod's name matching over MPI: which submitted collective runs when.

Horovod's contract: an asynchronous op is matched across ranks by its name
(unnamed ops get "<op>.noname.<k>", k counting per process set, so they
match by order), may be submitted in any order, and starts once every rank
of its process set has submitted it. MPI matches collectives by order alone,
so the ops wait here, in a queue per process set, until a *round*:

- A round is one collective of the set's ranks (an allgather of the sizes,
  then of each rank's pickled queue: names, what must match, per-rank
  information such as allgather's rows or alltoall's splits). Every rank
  decides from the same gathered lists, so every rank starts the same ops
  in the same order, and MPI's order-matching is then safe.
- Rounds run where a rank waits: synchronize() (blocking), poll() (not
  blocking) and join(). An op that is on every rank's list starts; ops whose
  signatures differ fail on every rank with HorovodInternalError naming each
  rank's tensor, as Horovod's coordinator does.
- Where every rank of the set waits (none polls) and a round starts nothing,
  nothing can ever start: instead of Horovod's stall warnings, every rank
  raises at once, naming what each rank is waiting for.
- Ranks that called join() take part in rounds with empty lists; the others'
  allreduces run with zeros from them (an Average still divides by the
  set's size, as Horovod's); any other op while a rank has joined fails with an error on
  the ranks that called it, and the joined ranks go on waiting in join(),
  as Horovod's.

The data of started ops moves through mpidp's core (_C.Comm, non-blocking,
with MPIDP_TIMEOUT deadlines); what each kind of op posts and returns is
mpidp.horovod.torch.mpi_ops."""

from __future__ import annotations

import pickle
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from .. import _C
from .._runtime.mpi import resolve_comm
from . import _basics, _timeline
from ._basics import HorovodInternalError

# What an op needs from a round to start: the per-rank infos, in set-rank
# order, and the ranks that joined (zeros for their part).
StartFn = Callable[["Op", List[Any], List[int]], List[Any]]


class Op:
    """One submitted collective. `match`: what every rank must pass alike
    (kind, dtype, shape, op, ...); `info`: what may differ and every rank
    must know (rows, splits); `start(op, infos, joined)` posts the data and
    returns the core's Works; `finish(op)` returns the result once they
    have completed."""

    __slots__ = ("handle", "name", "kind", "match", "info", "start", "finish", "works", "result", "error", "set", "submitted", "started_at")

    def __init__(self, name, kind, match, info, start: StartFn, finish):
        self.name, self.kind, self.match, self.info = name, kind, match, info
        self.start, self.finish = start, finish
        self.works: Optional[list] = None      # None: not started
        self.result = None
        self.error: Optional[BaseException] = None
        self.handle = 0
        self.set: Optional["_SetQueue"] = None
        self.submitted = time.perf_counter()
        self.started_at = 0.0


class _SetQueue:
    """A process set's queue of ops not started yet, and its rounds."""

    def __init__(self, mpi_comm):
        self.mpi = mpi_comm
        self.c = resolve_comm(mpi_comm)
        self.queue: Dict[str, Op] = {}
        self.in_flight: Dict[str, Op] = {}
        self.unnamed = 0
        self.rounds = 0
        self.joined_at: Optional[int] = None    # the round this rank joined in
        self.last_joined = -1


_handles: Dict[int, Op] = {}
_next_handle = 1
_queues: Dict[int, _SetQueue] = {}


def _queue_of(process_set) -> _SetQueue:
    mpi = _basics.comm_of(process_set)
    if mpi is None:
        raise ValueError(f"process_set: this rank ({_basics.rank()}) is not in "
                         f"{process_set!r}")
    q = _queues.get(process_set.process_set_id)
    if q is None or q.mpi is not mpi:
        q = _queues[process_set.process_set_id] = _SetQueue(mpi)
    return q


def set_size(process_set) -> int:
    return _queue_of(process_set).c.size


def set_rank(process_set) -> int:
    return _queue_of(process_set).c.rank


def submit(process_set, op: Op, name: Optional[str]) -> int:
    """Queue `op`; returns its handle."""
    global _next_handle
    q = _queue_of(process_set)
    if name is None:
        name = f"{op.kind}.noname.{q.unnamed}"
        q.unnamed += 1
    elif not isinstance(name, str):
        raise TypeError(f"name: expected a str or None, got {type(name).__name__}")
    if name in q.queue or _still_in_flight(q, name):
        raise ValueError(f"name: an operation named {name!r} is still in flight; give each "
                         "pending operation its own name (synchronize the first one before "
                         "reusing the name)")
    op.name, op.set = name, q
    op.handle = _next_handle
    _next_handle += 1
    q.queue[name] = op
    _handles[op.handle] = op
    return op.handle


def _still_in_flight(q: "_SetQueue", name: str) -> bool:
    """Whether the started op named `name` has yet to complete. As in
    Horovod, a name is free again once its op completed, synchronized or
    not (a handle nobody waits for must not hold its name forever)."""
    op = q.in_flight.get(name)
    if op is None:
        return False
    try:
        done = all(w.is_completed() for w in op.works)
    except _C.CommError as e:
        _fail(op, e)          # synchronize() reports it
        done = True
    if done:
        del q.in_flight[name]
    return not done


def _op_of(handle) -> Op:
    op = _handles.get(handle) if isinstance(handle, int) else None
    if op is None:
        raise ValueError(f"handle: {handle!r} is not the handle of a pending operation (each "
                         "handle can be synchronized once)")
    return op


def poll(handle) -> bool:
    """Whether the op is done; takes part in one round if it has not started."""
    op = _op_of(handle)
    if op.works is None and op.error is None:
        _round(op.set, blocking=False)
    if op.error is not None:
        return True
    if op.works is None:
        return False
    try:
        return all(w.is_completed() for w in op.works)
    except _C.CommError as e:
        _fail(op, e)
        return True


def synchronize(handle):
    """Wait for the op (taking part in rounds until it starts), then its result."""
    op = _op_of(handle)
    try:
        while op.works is None and op.error is None:
            _round(op.set, blocking=True)
        if op.error is None:
            try:
                for w in op.works:
                    w.wait()
                op.result = op.finish(op)
            except _C.CommError as e:
                _fail(op, e)
            except Exception as e:   # the result could not be written back (a device copy)
                op.error = e
    finally:
        if op.error is not None or op.works is not None:
            _handles.pop(op.handle, None)
            # Only this op's entries: its name may name a newer op by now.
            for table in (op.set.in_flight, op.set.queue):
                if table.get(op.name) is op:
                    del table[op.name]
    _timeline.op_done(op)
    if op.error is not None:
        if isinstance(op.error, HorovodInternalError):
            raise op.error
        raise HorovodInternalError(str(op.error)) from op.error
    return op.result


def _skip_automatic_name(q: "_SetQueue", name: str) -> None:
    """An op that ran or failed beside joined ranks took an automatic name
    ("<kind>.noname.<k>") that the joined ranks never counted: they count
    it now, so that every rank names its next unnamed op alike."""
    _, sep, number = name.rpartition(".noname.")
    if sep and number.isdigit():
        q.unnamed = max(q.unnamed, int(number) + 1)


def _fail(op: Op, error: BaseException) -> None:
    wrapped = HorovodInternalError(f"{op.kind} {op.name!r}: {error}")
    wrapped.__cause__ = error
    op.error = wrapped


def join(process_set) -> int:
    """Horovod's join(): this rank has no more data. Rounds go on (its part
    of the others' allreduces is zeros) until every rank joined; returns the
    set rank that joined last."""
    q = _queue_of(process_set)
    q.joined_at = q.rounds
    try:
        while q.joined_at is not None:
            _round(q, blocking=True)
    finally:
        q.joined_at = None
    return q.last_joined


def _gather(q: _SetQueue, payload: bytes) -> List[bytes]:
    c = q.c
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = torch.empty(c.size, dtype=torch.int64)
    c.allgather(size, sizes)
    counts = sizes.tolist()
    out = torch.empty(sum(counts), dtype=torch.uint8)
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
        torch.empty(0, dtype=torch.uint8)
    c.allgatherv(mine, out, tuple(counts))
    raw = out.numpy().tobytes()
    blobs, at = [], 0
    for n in counts:
        blobs.append(raw[at:at + n])
        at += n
    return blobs


def _round(q: _SetQueue, blocking: bool) -> None:
    """One round over the set (see the module's docstring)."""
    mine = [(op.name, op.kind, op.match, op.info) for op in q.queue.values()]
    payload = pickle.dumps((blocking, q.joined_at, mine), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        lists = [pickle.loads(b) for b in _gather(q, payload)]
    except _C.CommError as e:
        raise HorovodInternalError(f"the ranks could not agree on which operations to run: {e}") \
            from e
    q.rounds += 1
    _timeline.cycle()
    joined = [r for r, (_, j, _) in enumerate(lists) if j is not None]
    active = [r for r in range(len(lists)) if r not in joined]
    if not active:
        # Every rank joined: the last to join is the one of the latest round.
        latest = max(lists[r][1] for r in joined)
        q.last_joined = max(r for r in joined if lists[r][1] == latest)
        q.joined_at = None
        return
    tables = [{name: (kind, match, info) for name, kind, match, info in ops}
              for _, _, ops in lists]
    first = active[0]
    ready = [name for name, *_ in lists[first][2]
             if all(name in tables[r] for r in active)]
    started = 0
    for name in ready:
        kinds = [tables[r][name][:2] if name in tables[r] else None for r in range(len(lists))]
        reference = kinds[first]
        differing = [r for r in active if kinds[r] != reference]
        op = q.queue.pop(name, None)
        started += 1
        if joined:
            _skip_automatic_name(q, name)
        if differing or (joined and reference[0] != "allreduce"):
            message = (_mismatch(name, kinds, active) if differing else
                       f"{reference[0]} {name!r} while rank(s) {joined} had called join(): only "
                       "allreduce can run with joined ranks (they contribute zeros)")
            if op is not None:   # a joined rank, which lacks it, goes on joining (Horovod's)
                op.error = HorovodInternalError(message)
            continue
        infos = [tables[r][name][2] if name in tables[r] else None for r in range(len(lists))]
        if op is None:
            op = _zeros_for(name, reference)
            op.set = q
        op.started_at = time.perf_counter()
        op.works = op.start(op, infos, joined)
        if op.handle:
            q.in_flight[name] = op
        else:   # a joined rank's zeros: every rank started it, so it completes
            for w in op.works:
                w.wait()
    if started:
        return
    if all(lists[r][0] for r in range(len(lists))):
        # Everyone waits and nothing can start: a deadlock Horovod would only warn about.
        waiting = "; ".join(f"rank {r}: " + (", ".join(repr(n) for n, *_ in ops) or "nothing")
                            + (" (joined)" if lists[r][1] is not None else "")
                            for r, (_, _, ops) in enumerate(lists))
        error = HorovodInternalError(
            "the ranks wait for operations that not every rank has submitted, so none can start "
            f"(operations pending per rank: {waiting}); every rank must submit the same "
            "operations, with the same names")
        for op in list(q.queue.values()):
            op.error = error
        q.queue.clear()
        q.joined_at = None
        raise error


def _mismatch(name: str, kinds: list, active: List[int]) -> str:
    groups: Dict[str, List[int]] = {}
    for r in active:
        kind, match = kinds[r]
        groups.setdefault(f"{kind} of {_describe_match(match)}", []).append(r)
    parts = "; ".join(f"rank(s) {ranks}: {what}" for what, ranks in groups.items())
    return (f"Mismatched arguments for the operation named {name!r}: the ranks passed "
            f"different tensors or settings ({parts}); every rank must pass the same")


def _describe_match(match) -> str:
    if isinstance(match, dict):
        return ", ".join(f"{k}={v}" for k, v in match.items())
    return repr(match)


# Set by horovod.torch.mpi_ops, which builds allreduces (imports run one way):
# (name, the signature's match) -> a joined rank's Op of zeros.
zeros_allreduce = None
# Set by the modules that cannot run beside a joined rank (horovod.torch's
# DistributedOptimizer): each raises when join() must be refused.
join_refusals: list = []


def _zeros_for(name: str, reference) -> Op:
    """A joined rank's part of an allreduce: zeros of the signature's shape."""
    return zeros_allreduce(name, reference[1])


def reset() -> None:
    """hvd.shutdown(): pending operations fail."""
    error = HorovodInternalError("Horovod was shut down while the operation was pending")
    for op in _handles.values():
        if op.result is None and op.error is None:
            op.error = error
    _queues.clear()


_basics._world.on_shutdown.append(reset)
