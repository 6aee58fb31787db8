"""DASO's global sync for parameters in device memory: the core's ParamSync
(mpidp/paramsync.h) with its two passes over the parameters -- packing each
one's difference from the shared reference, and merging the sum back -- run
where the parameters live, by the same kernels (mpidp.kernels: the CUDA ones
give the CPU ones' bits), so only the packed bytes cross to the host (half
of float32's with a bf16/fp16 wire) and the host does no pass of its own.
The sum of the packed bytes is the core's chunked allreduce, as ParamSync's.

Used where DASO's parameters are on a GPU; MPIDP_DASO_DEVICE_SYNC=1 puts CPU
parameters through it too (tests: it must give the host engine's results).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import _C
from ..primitives import kernels

_WIRE_DTYPES = {_C.DTYPE_F32: torch.float32, _C.DTYPE_BF16: torch.bfloat16,
                _C.DTYPE_F16: torch.float16}


class DeviceParamSync:
    """ParamSync's interface (send, test, wait, pending, merge_average,
    set_reference, restore, wire_bytes) over `params` in place, on their
    device."""

    def __init__(self, comm: _C.Comm, params: Sequence[torch.Tensor], wire: int,
                 chunk_elems: int, *, what: str):
        if not params:
            raise ValueError(f"{what}: no parameters")
        if any(p.dtype != torch.float32 for p in params):
            raise TypeError(f"{what}: the global sync averages float32 parameters")
        device = params[0].device
        self._comm = comm
        self._what = what
        self._params = tuple(p.detach() for p in params)
        self._flat_params = [p.reshape(-1) for p in self._params]
        sizes = [p.numel() for p in self._params]
        total = sum(sizes)
        self._wire_code = wire
        wire_dtype = _WIRE_DTYPES[wire]
        self._ref = torch.empty(total, dtype=torch.float32, device=device)
        self._wire = torch.empty(total, dtype=wire_dtype, device=device)
        # What MPI reads and writes: the packed bytes in host memory.
        self._host = (torch.empty(total, dtype=wire_dtype, pin_memory=True)
                      if device.type == "cuda" else self._wire)
        self._refs = list(self._ref.split(sizes))
        self._wires = list(self._wire.split(sizes))
        del chunk_elems  # the collective chunks the sum itself (no effect on its result)
        self._work: Optional[_C.Work] = None
        self._received = False
        self.set_reference()

    @property
    def pending(self) -> bool:
        """A sync is in flight (sent, its sum not yet seen complete)."""
        return self._work is not None and not self._received

    @property
    def wire_bytes(self) -> int:
        return self._wire.numel() * self._wire.element_size()

    @property
    def numel(self) -> int:
        return self._wire.numel()

    def set_reference(self) -> None:
        """ref = the parameters now (every rank must hold the same values)."""
        self._check_idle("set_reference")
        torch._foreach_copy_(self._refs, self._flat_params)

    def restore(self) -> None:
        """p = ref."""
        self._check_idle("restore")
        torch._foreach_copy_(self._flat_params, self._refs)

    def send(self, zero: bool = False) -> None:
        """Packs p - ref (zeros: `zero`) where the parameters live, moves the
        packed bytes to the host and starts their sum."""
        self._check_idle("send")
        if zero:
            self._wire.zero_()
        elif self._wire_code == _C.DTYPE_F32:
            for w, p, r in zip(self._wires, self._flat_params, self._refs):
                torch.sub(p, r, out=w)
        else:
            for w, p, r in zip(self._wires, self._flat_params, self._refs):
                kernels.pack(w, p, r, 1.0)
        if self._host is not self._wire:
            self._host.copy_(self._wire)  # waits for the packing: MPI reads the bytes next
        self._work = self._comm.allreduce(self._host, _C.OP_SUM, -1, True)
        self._received = False

    def test(self) -> bool:
        """Progresses the sum in flight; True once it has completed."""
        if self._work is None:
            return True
        if not self._received and self._work.is_completed():
            self._received = True
        return self._received

    def wait(self) -> None:
        if self._work is not None and not self._received:
            self._work.wait()
            self._received = True

    def merge_average(self, n_senders: int, batches_waited: int) -> None:
        """Completes the sync, then p = a*p + b*sum + c*ref with Heat's
        staleness weights, where the parameters live."""
        a, b, c = _C.paramsync_merge_weights(n_senders, batches_waited)
        if self._work is None:
            raise RuntimeError(f"{self._what}: merge without a sync sent")
        self.wait()
        self._work = None
        if self._host is not self._wire:
            self._wire.copy_(self._host)
        for p, w, r in zip(self._flat_params, self._wires, self._refs):
            kernels.unpack(p, w, r, a, b, c)

    def _check_idle(self, what: str) -> None:
        if self.pending:
            raise RuntimeError(f"{self._what}: {what} while a sync is in flight")
