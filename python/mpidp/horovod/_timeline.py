"""Horovod's timeline: a Chrome trace (chrome://tracing, Perfetto) of the
collectives, written by rank 0 as Horovod's is.

Each operation name is a row ("process" in the trace's terms); an op shows
its wait for the other ranks (NEGOTIATE_<OP>, from submission to start) and
its transfer (<OP>, from start to completion seen). DistributedOptimizer's
gradient buckets show as one ALLREDUCE_GRADIENTS span per backward pass.
mark_cycles adds an instant event at each negotiation round. The file is
valid JSON whenever it is closed: stop_timeline() or shutdown() ends it."""

from __future__ import annotations

import json
import os
import time
from typing import Optional


class _Timeline:
    def __init__(self, path: str, mark_cycles: bool):
        self.file = open(path, "w")
        self.file.write("[\n")
        self.first = True
        self.mark_cycles = mark_cycles
        self.rows: dict = {}
        self.t0 = time.perf_counter()

    def _us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 3)

    def _row(self, name: str) -> int:
        pid = self.rows.get(name)
        if pid is None:
            pid = self.rows[name] = len(self.rows) + 1
            self._write({"name": "process_name", "ph": "M", "pid": pid,
                         "args": {"name": name}})
            self._write({"name": "process_sort_index", "ph": "M", "pid": pid,
                         "args": {"sort_index": pid}})
        return pid

    def _write(self, event: dict) -> None:
        self.file.write(("" if self.first else ",\n") + json.dumps(event))
        self.first = False

    def span(self, name: str, phase: str, start: float, end: float, args=None) -> None:
        pid = self._row(name)
        self._write({"name": phase, "ph": "X", "pid": pid, "tid": 0, "ts": self._us(start),
                     "dur": self._us(end) - self._us(start), "args": args or {}})

    def instant(self, what: str) -> None:
        self._write({"name": what, "ph": "i", "s": "g", "pid": 0, "tid": 0,
                     "ts": self._us(time.perf_counter())})

    def close(self) -> None:
        self.file.write("\n]\n")
        self.file.close()


_active: Optional[_Timeline] = None


def start(file_path: str, mark_cycles: bool = False) -> None:
    """start_timeline(): from now on rank 0 records (a running timeline is
    ended first)."""
    global _active
    from ._basics import rank
    if not isinstance(file_path, str) or not file_path:
        raise TypeError(f"file_path: expected a non-empty str, got {file_path!r}")
    stop()
    if rank() == 0:
        _active = _Timeline(file_path, bool(mark_cycles))


def stop() -> None:
    global _active
    if _active is not None:
        _active.close()
        _active = None


def op_done(op) -> None:
    if _active is None or not op.started_at:
        return
    kind = op.kind.upper()
    _active.span(op.name, f"NEGOTIATE_{kind}", op.submitted, op.started_at)
    _active.span(op.name, kind, op.started_at, time.perf_counter(),
                 {"error": str(op.error)} if op.error is not None else None)


def span(name: str, phase: str, start: float, end: float) -> None:
    if _active is not None:
        _active.span(name, phase, start, end)


def cycle() -> None:
    if _active is not None and _active.mark_cycles:
        _active.instant("CYCLE_START")


def _at_shutdown() -> None:
    stop()


def _at_init() -> None:
    """hvd.init() with HOROVOD_TIMELINE set to a path starts the timeline;
    HOROVOD_TIMELINE=DYNAMIC (Horovod's word) starts nothing: the program
    calls hvd.start_timeline(path) when it wants one."""
    timeline = os.environ.get("HOROVOD_TIMELINE")
    if timeline and timeline != "DYNAMIC":
        start(timeline, os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES") == "1")


from . import _basics  # noqa: E402  (after the functions it registers)
_basics._world.on_shutdown.append(_at_shutdown)
_basics._world.on_init.append(_at_init)
