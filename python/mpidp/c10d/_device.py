"""The "mpidp" backend's device path: all_reduce, broadcast,
all_gather_into_tensor and reduce_scatter_tensor of CUDA tensors run where
the tensors live, through the core's device communicator (mpidp/devcomm.h):
NCCL, bootstrapped over the group's MPI communicator (no TCP store), where
every rank has a GPU of its own; MPI on the device pointers where ranks
share a GPU and MPI is CUDA-aware; otherwise the host path (the Python
group's staging), with one warning naming why.

The communicator is chosen on a group's first such call on a device -- a
collective step, reached by every rank together since the ranks' check has
passed -- exactly as DataParallel chooses its own (MPIDP_C10D_DEVICE_COMM
picks by hand, as MPIDP_DP_DEVICE_COMM does there), and kept.

Order: NCCL runs the collective on the caller's current stream, so later
work on that stream sees the result without a host wait, as with torch's
NCCL groups; Work.wait() also waits on the host. MPI knows no streams:
the current stream is synchronised before the post. 'standin' runs every
step of this path on CPU tensors over MPI, for the tests: its result lands
only at the wait, as a device result is visible only to work ordered after
it.

Which calls take the path depends only on what the ranks' check compares
(call, device type, dtype, op), never on a rank's own strides: a strided
tensor goes through a contiguous copy on the device. So the ranks of a
group always take the same path."""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import _C
from .._engines.device_reduction import choose_device_comm
from .._runtime import config
from .._runtime import mpi as _mpi
from ._tensors import _STAGING_WARNED

RedOpType = dist.ReduceOp.RedOpType

# The dtypes NCCL reduces (and so the stand-in, to take the same calls).
_REDUCED = {torch.float32: _C.DTYPE_F32, torch.float64: _C.DTYPE_F64,
            torch.bfloat16: _C.DTYPE_BF16, torch.float16: _C.DTYPE_F16,
            torch.int8: _C.DTYPE_I8, torch.uint8: _C.DTYPE_U8, torch.int32: _C.DTYPE_I32,
            torch.int64: _C.DTYPE_I64}
_OPS = {RedOpType.SUM.value: _C.OP_SUM, RedOpType.AVG.value: _C.OP_SUM,
        RedOpType.MIN.value: _C.OP_MIN, RedOpType.MAX.value: _C.OP_MAX,
        RedOpType.PRODUCT.value: _C.OP_PROD}
_AVG = RedOpType.AVG.value


class _Ticket:
    """One device collective as MPIDPWork waits for it (a core Work's
    wait/is_completed), holding every tensor the device may still read or
    write until it is over."""

    def __init__(self, devcomm, ticket: int, keep):
        self._dc, self._ticket, self._keep = devcomm, ticket, keep

    def wait(self, deadline=None) -> None:
        self._dc.wait(self._ticket)
        self._keep = None

    def is_completed(self) -> bool:
        return self._dc.test(self._ticket)


class DevicePath:
    """The device path of one ProcessGroupMPIDP."""

    def __init__(self, group):
        self._group = group
        self._setting = config.get("MPIDP_C10D_DEVICE_COMM")
        self._comms: dict = {}     # device -> DevComm, or None for the host path

    def takes(self, t: torch.Tensor) -> bool:
        """Whether t's device may be served here (cuda; cpu under 'standin')."""
        if self._setting == "staging":
            return False
        wanted = "cpu" if self._setting == "standin" else "cuda"
        return t.device.type == wanted and self._comms.get(t.device, True) is not None

    # -- the calls (each returns the group's Work, or None: the host path) ----
    def allreduce(self, t: torch.Tensor, reduce_op):
        chosen = self._reduction_comm(t, "all_reduce", reduce_op)
        if chosen is None:
            return None
        dc, op, scale = chosen
        c = _contiguous(t, _work_dtype(dc, t.dtype, op))
        post = self._post(dc, "allreduce", c, c, t.numel(), _REDUCED[c.dtype], op, 0,
                          "all_reduce")
        return self._work(post, [t], _landing(c, t, scale), "all_reduce")

    def broadcast(self, t: torch.Tensor, root: int):
        dc = self._comm(t, "broadcast", root=root)
        if dc is None:
            return None
        c = _contiguous(t)
        data = _bytes(c)
        post = self._post(dc, "bcast", data, data, data.numel(), _C.DTYPE_U8, 0, root,
                          "broadcast")
        return self._work(post, [t], _landing(c, t, None), "broadcast")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor):
        dc = self._comm(input, "all_gather_into_tensor")
        if dc is None:
            return None
        cin, cout = _contiguous(input), _contiguous(output)
        send, recv = _bytes(cin), _bytes(cout)
        post = self._post(dc, "allgather", send, recv, send.numel(), _C.DTYPE_U8, 0, 0,
                          "all_gather_into_tensor", keep=[cin])
        return self._work(post, [output], _landing(cout, output, None), "all_gather_into_tensor")

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, reduce_op):
        chosen = self._reduction_comm(input, "reduce_scatter_tensor", reduce_op)
        if chosen is None:
            return None
        dc, op, scale = chosen
        work = _work_dtype(dc, input.dtype, op)
        cin, cout = _contiguous(input, work), _contiguous(output, work)
        post = self._post(dc, "reduce_scatter", cin, cout, output.numel(), _REDUCED[work],
                          op, 0, "reduce_scatter_tensor", keep=[cin])
        return self._work(post, [output], _landing(cout, output, scale), "reduce_scatter_tensor")

    # -- helpers ---------------------------------------------------------------
    def _reduction_comm(self, t: torch.Tensor, call: str, reduce_op):
        """(the communicator, the core's op, the divisor of an average or
        None) for a reduction of t the device path takes; None otherwise."""
        op, average = _reduction(reduce_op, t.dtype)
        if op is None:
            return None
        dc = self._comm(t, call, op=op)
        if dc is None:
            return None
        return dc, op, (self._group.size() if average else None)

    def _comm(self, t: torch.Tensor, call: str, **settings):
        """The ranks' check of the call (named for the device path, so that
        a rank that stages it differs), then the device's communicator,
        chosen on the first call (collective) and kept."""
        self._group._agree(f"{call} on the device", t, **settings)
        if t.device not in self._comms:
            dc, why = choose_device_comm(self._group.mpi_comm, self._group.core_comm, t.device,
                                         by_arguments=_mpi.fault_tolerant,
                                         setting="MPIDP_C10D_DEVICE_COMM")
            self._comms[t.device] = dc
            if dc is None:
                _STAGING_WARNED.add(t.device.type)    # this warning says it, and why
                warnings.warn(f"mpidp backend: {t.device.type} tensors of this group go through "
                              f"host memory for each collective: {why}", RuntimeWarning,
                              stacklevel=4)
        return self._comms[t.device]

    def _post(self, dc, kind: str, send: torch.Tensor, recv: torch.Tensor, count: int,
              dtype: int, op: int, root: int, what: str, keep=()) -> _Ticket:
        stream = 0
        if send.is_cuda:
            current = torch.cuda.current_stream(send.device)
            if dc.kind == "nccl":
                stream = current.cuda_stream
            else:
                current.synchronize()    # MPI reads the buffer outside any stream
        ticket = dc.collective_(kind, send.data_ptr(), recv.data_ptr(), count, dtype, op, root,
                                stream, f"mpidp backend: {what} on the device")
        return _Ticket(dc, ticket, [send, recv, *keep])

    def _work(self, ticket: _Ticket, outputs, finish, what: str):
        return self._group._work([ticket], outputs, finish, what)


def _reduction(reduce_op, dtype: torch.dtype):
    """(the core's op for torch's reduce_op on dtype, whether it is an
    average: a sum divided afterwards), or (None, False) where the device
    path does not take it (the host path then reduces it, or refuses it
    naming op and dtype)."""
    kind = reduce_op.op if isinstance(reduce_op, dist.ReduceOp) else reduce_op
    op = _OPS.get(kind.value)
    average = kind.value == _AVG
    if dtype not in _REDUCED or op is None or (average and not dtype.is_floating_point):
        return None, False
    return op, average


def _work_dtype(dc, dtype: torch.dtype, op: int) -> torch.dtype:
    """The dtype a reduction runs in: its own, but float32 for a 16-bit
    min, max or product over MPI (NCCL has them; MPI has no such op)."""
    if dc.kind != "nccl" and op != _C.OP_SUM and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def _contiguous(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """t itself, or a contiguous copy (in `dtype`, if given), made on t's
    device and stream."""
    t = t.detach()
    if t.is_contiguous() and (dtype is None or dtype == t.dtype):
        return t
    return t.to(dtype or t.dtype, memory_format=torch.contiguous_format, copy=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as bytes (broadcasts and gathers move
    bytes, whatever the dtype: bool and complex included)."""
    return t.reshape(-1).view(torch.uint8)


def _landing(c: torch.Tensor, t: torch.Tensor, scale: Optional[int]) -> Optional[Callable]:
    """What runs once the collective is over: an average's division, and the
    copy back from a contiguous copy into t (both on the current stream)."""
    copy = c.data_ptr() != t.data_ptr()     # a contiguous copy (_contiguous)
    if scale is None and not copy:
        return None

    def land():
        with torch.no_grad():
            if scale is not None:
                c.div_(scale)
            if copy:
                t.copy_(c)
    return land
