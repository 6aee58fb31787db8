"""Non-blocking DataParallel's buckets where no device communicator serves
(ranks sharing a GPU, no NCCL, an MPI that takes no device pointers): the
device-mode reducer with the sums relayed through pinned host buffers. The
passes over a bucket run on the device, where the gradients are (why:
docs/design-notes.md, "DataParallel's device path"):
  hook (bucket full)   on the current stream: the scaled copy into the
                       bucket's device communication buffer, the bucket
                       zeroed, and an asynchronous copy of that buffer to its
                       pinned host twin, marked by an event;
  posting              in bucket order, each bucket whose copy has arrived:
                       MPI's sum of the host twin, then the core sums its
                       flags (staged); the end of backward waits for the
                       copies still under way;
  delivery             MPI's sum waited for, the host twin copied back to the
                       device buffer in stream order, and the recorded
                       deliveries (copy or add) made there.
On CPU tensors (MPIDP_DP_STAGING=1, the tests) the "device" is host memory
and the copies are plain ones: the same order runs.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .. import _C
from .device_reduction import Members, deliver
from .._runtime.state_broadcast import broadcast_tensors
class HostRelay:
    """The same calls as _device_reduction.DeviceReduction (stage_full,
    copy, new_pass, broadcast_), for non-blocking mode."""

    def __init__(self, c_comm: _C.Comm, dev: Tuple[torch.Tensor, ...], infos,
                 members: List[Members], name: str):
        self._comm = c_comm
        self._data = tuple(d[:n] for d, (n, _, _) in zip(dev, infos))
        self._buf = tuple(torch.empty_like(d) for d in self._data)   # the scaled copies
        on_gpu = bool(dev) and dev[0].is_cuda
        self._host = (tuple(torch.empty(d.shape, dtype=d.dtype, pin_memory=True) for d in self._data)
                      if on_gpu else self._buf)
        self._on_gpu = on_gpu
        self._members = members
        self._name = name
        n = len(dev)
        self._copied: List[Optional[torch.cuda.Event]] = [None] * n  # copy to the host issued
        self._issued = [False] * n
        self._work: List[Optional[_C.Work]] = [None] * n             # MPI's sum in flight
        self._next_post = 0                                          # buckets below are posted

    # -- the hook side -------------------------------------------------------------

    def stage_full(self, r, flush: bool) -> None:
        start = 0
        while (b := r.next_to_stage(start)) is not None:
            start = b + 1
            if not self._issued[b]:
                self._issue(b, r.divisor)
        # MPI's sums start in bucket order on every rank.
        while self._next_post < len(self._data) and self._issued[self._next_post]:
            b = self._next_post
            event = self._copied[b]
            if event is not None:
                if flush:
                    event.synchronize()
                elif not event.query():
                    return
                self._copied[b] = None
            self._work[b] = self._comm.allreduce(self._host[b], _C.OP_SUM, _C.NO_WIRE, True)
            self._next_post += 1
            r.staged(b)

    def _issue(self, b: int, divisor: int) -> None:
        data, buf = self._data[b], self._buf[b]
        if divisor != 1:
            torch.mul(data, 1.0 / divisor, out=buf)
        else:
            buf.copy_(data)
        data.zero_()   # the .grad views start from zero, as in the host path
        if self._on_gpu:
            self._host[b].copy_(buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copied[b] = event
        self._issued[b] = True

    # -- completion ----------------------------------------------------------------

    def copy(self, r, b: int, to_device: bool) -> None:
        if not to_device:
            return
        work = self._work[b]
        if work is not None:
            work.wait()
            self._work[b] = None
            if self._on_gpu:  # stream order puts the copy before every later read
                self._buf[b].copy_(self._host[b], non_blocking=True)
        deliver(r, b, self._data[b], self._buf[b], self._members[b])

    def new_pass(self) -> None:
        for b, work in enumerate(self._work):
            if work is not None:
                work.wait()
                self._work[b] = None
        self._issued = [False] * len(self._issued)
        self._next_post = 0

    def broadcast_(self, tensors) -> None:
        broadcast_tensors(list(tensors), self._comm)
