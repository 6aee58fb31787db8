"""The Work handles the "mpidp" backend returns, and the thread that
completes their futures.

DDP's reducer asks an allreduce's Work for its future and later blocks on
it in C++, where no Python code runs: something must complete it while the
backward goes on. A Work whose future is asked for is handed to one
progress thread per process, which waits for it in the C core (the GIL
released) and completes the future; its own wait() then waits on the
future, so that one Work never has two waiters. A Work nobody asks a
future of is waited for by whoever calls wait()."""

from __future__ import annotations

import datetime
import queue
import threading

import torch
import torch.distributed as dist
from torch.futures import Future

from .. import _C
from .._runtime.mpi import MPI


def seconds(timeout) -> float | None:
    """A wait's deadline in seconds: a timedelta, a number, or None (none given)."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return None if timeout <= 0 else float(timeout)


class MPIDPWork(dist.Work):
    """One operation of the backend: `c_works` are the core's handles (None
    or empty: done already), `finish` runs once after they complete (copies
    out of staging buffers, scaling), `outputs` are the future's value,
    `describe()` names the operation and group for messages, `deadline`
    (seconds) bounds each wait, and `failed(what)` is told of a failure that
    may leave the operation posted."""

    def __init__(self, c_works, outputs, finish, describe, deadline: float,
                 source: torch.Tensor | None = None, failed=None):
        super().__init__()
        self._failed = failed
        self._c_works = [w for w in (c_works or ()) if w is not None]
        self._outputs = outputs
        self._finish = finish
        self._describe = describe
        self._deadline = deadline
        self._source = source
        # Reentrant: get_future() completes the Work under it on the progress thread.
        self._lock = threading.RLock()
        self._done = False
        self._error: BaseException | None = None
        self._future: Future | None = None

    # -- completion ---------------------------------------------------------
    def _complete(self, timeout: float | None) -> None:
        """Waits for the operation (deadline: the smaller of `timeout` and
        the group's) and finishes it, once; a failure is kept and raised
        here and at every later call."""
        with self._lock:
            if not self._done:
                deadline = self._deadline if timeout is None else min(timeout, self._deadline)
                try:
                    while self._c_works:
                        self._c_works[0].wait(deadline)
                        self._c_works.pop(0)
                    if self._finish is not None:
                        self._finish()
                        self._finish = None
                except _C.CommError as exc:
                    # Its own type (a DistBackendError), naming the group too.
                    self._error = type(exc)(f"{self._describe()}: {exc}")
                    for name in ("rank", "operation"):
                        if hasattr(exc, name):
                            setattr(self._error, name, getattr(exc, name))
                    if self._failed is not None:
                        self._failed(self._describe())
                except Exception as exc:   # a staging copy's failure
                    self._error = exc
                self._done = True
        if self._error is not None:
            raise self._error

    def wait(self, timeout=None) -> bool:
        if self._future is not None:
            if on_progress_thread():
                # A future's callback waiting for a Work queued behind it:
                # only this thread could complete it, so it does so here.
                self._complete(seconds(timeout))
                _settle(self)
                return True
            self._future.wait()   # raises what the progress thread set
            return True
        self._complete(seconds(timeout))
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not self._lock.acquire(blocking=False):
            return False   # the progress thread is waiting for it
        try:
            done = all(w.is_completed() for w in self._c_works)
        finally:
            self._lock.release()
        if done and self._future is None:
            try:
                self._complete(None)
            except Exception:
                pass   # kept in self._error, raised by wait()
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def _source_rank(self) -> int:
        """The sender of a receive from any rank (torch's dist.recv(src=None))."""
        self.wait()
        if self._source is None:
            raise ValueError("source rank: this Work is not a receive from any rank")
        return int(self._source.item())

    def source_rank(self) -> int:
        return self._source_rank()

    def result(self):
        self.wait()
        return self._outputs

    def get_future(self) -> Future:
        with self._lock:
            if self._future is None:
                self._future = Future()
                if self._done or on_progress_thread():
                    # On the progress thread (a future's callback starting
                    # the next collective, as PowerSGD's do, and waiting for
                    # it) the Work is completed here: queued, it would wait
                    # behind the callback that waits for it.
                    _InlineProgress.submit(self)
                else:
                    _progress().submit(self)
        return self._future


def _settle(work: MPIDPWork) -> None:
    """Completes the Work's future with its outputs or its error (once)."""
    if work._future.done():
        return
    if work._error is not None:
        work._future.set_exception(work._error)
    else:
        work._future.set_result(work._outputs)


class _ProgressThread:
    """Completes the futures of Works handed to it, in the order given
    (the order their operations were posted), running their callbacks."""

    def __init__(self):
        self._queue: "queue.SimpleQueue[MPIDPWork]" = queue.SimpleQueue()
        self._unsettled = 0        # submitted, callbacks not yet run
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="mpidp-c10d-progress", daemon=True)
        self._thread.start()

    def submit(self, work: MPIDPWork) -> None:
        with self._idle:
            self._unsettled += 1
        self._queue.put(work)

    def wait_until_settled(self, timeout_s: float) -> bool:
        """Until every future handed over has been completed and its
        callbacks have run; False at the deadline."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unsettled == 0, timeout_s)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                work._complete(None)
            except BaseException:
                pass   # kept in work._error
            try:
                _settle(work)
            finally:
                with self._idle:
                    self._unsettled -= 1
                    self._idle.notify_all()


def after_callbacks(what: str, timeout_s: float) -> None:
    """Before a collective of the program's: the futures it asked for have
    been completed and their callbacks have run. A callback may make
    collectives (torch's PowerSGD hook does), and they must come before the
    program's next one on every rank -- whether the callback ran at once on
    the program's thread (its future was complete when `then` was called)
    or later on the progress thread -- or one rank's call would pair with
    another's callback's. A callback's own calls (on the progress thread)
    go at once."""
    if _thread is None or on_progress_thread():
        return
    if not _thread.wait_until_settled(timeout_s):
        _C.timed_out(what, "the callbacks of an earlier call's future (which may make calls "
                           "that must come first) were still running on the progress thread "
                           f"after the group's timeout of {timeout_s:g} s")


def on_progress_thread() -> bool:
    return _thread is not None and threading.current_thread() is _thread._thread


_thread: _ProgressThread | None = None
_thread_lock = threading.Lock()


class _InlineProgress:
    """Without MPI_THREAD_MULTIPLE no second thread may wait in MPI: the
    future is completed at once, by waiting here (no overlap)."""

    @staticmethod
    def submit(work: MPIDPWork) -> None:
        try:
            work._complete(None)
        except BaseException:
            pass
        _settle(work)


def _progress():
    global _thread
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return _InlineProgress
    with _thread_lock:
        if _thread is None:
            _thread = _ProgressThread()
        return _thread
