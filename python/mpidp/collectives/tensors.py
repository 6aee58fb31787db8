"""Collectives on tensors and Python numbers, over MPI communicators.

Every call is collective over `comm` (default MPI.COMM_WORLD; an mpi4py
communicator or Heat's wrapper), runs through mpidp's C core and waits with
the MPIDP_TIMEOUT deadline, so a missing rank ends in mpidp.CommTimeout
instead of a hang. Tensors live in host memory and are contiguous."""

from __future__ import annotations

import numbers
import zlib

import torch

from .. import _C
from .._runtime.argument_agreement import agree, crc_of, refuse, signature
from .._runtime.args import check_bool, check_choice, check_int
from .._runtime.dtypes import CODE_OF, wire_code
from .._runtime.mpi import resolve_comm
from .._runtime.topology import topology

__all__ = ["allreduce", "allreduce_scalar", "allgather", "broadcast", "barrier", "rank", "size",
           "local_rank", "Work"]

_OPS = {"sum": _C.OP_SUM, "avg": _C.OP_AVG, "min": _C.OP_MIN, "max": _C.OP_MAX,
        "prod": _C.OP_PROD}
# Names of the settings' codes, for the message of ranks that disagree.
_NAMES = {"op": {code: name for name, code in _OPS.items()},
          "wire": {_C.NO_WIRE: "none", _C.DTYPE_U8: "uint8",
                   **{code: str(d).replace("torch.", "") for d, code in CODE_OF.items()}}}
_INTEGERS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class Work:
    """Handle of an asynchronous collective (async_op=True): wait(),
    is_completed(), and result(), which waits and returns the tensor written.

    The tensor passed in is MPI's until the Work completes. One changed in
    place before then (a gradient clipped or unscaled before wait()) holds
    undefined values -- what was sent mixes old and new, and MPI overwrites
    the change -- so the call that sees the Work complete, and every later
    one, raise RuntimeError instead. Reading it in flight, and writing to it
    once the Work has completed, are fine.

    The collectives make it: `work` is the extension's handle of the
    operation (mpidp._C.Work), `watched` the tensor passed in (None: none)."""

    __slots__ = ("_work", "_watched", "_version", "_changed")

    def __init__(self, work: _C.Work, watched: torch.Tensor | None):
        self._work = work
        self._watched = watched
        self._version = None if watched is None else watched._version
        self._changed = False

    def _settle(self, done: bool) -> None:
        # Compared when the completion is first seen: after it the tensor is the user's again.
        if done and self._watched is not None:
            self._changed = self._watched._version != self._version
            self._watched = None
        if self._changed:
            raise RuntimeError("Work: the tensor was changed in place while the operation was in "
                               "flight (its version counter moved), so its values are undefined; "
                               "wait() for the Work before writing to the tensor")

    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation has completed (deadline: `timeout`
        seconds, None: MPIDP_TIMEOUT); a failure raises here and at every
        later call."""
        self._work.wait(timeout)
        self._settle(True)

    def is_completed(self) -> bool:
        """Whether the operation has completed, without blocking (progresses MPI)."""
        done = self._work.is_completed()
        self._settle(done)
        return done

    def result(self):
        """Waits, then the tensor the operation wrote (the reduced or broadcast
        tensor, the gathered or scattered output); None for a barrier."""
        self.wait()
        return self._work.result()


def _check_tensor(tensor, argname: str = "tensor", writable: bool = True) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{argname}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _INTEGERS + _FLOATS + (torch.bool,):
        raise TypeError(f"{argname}: dtype {tensor.dtype} is not supported (float32, float64, "
                        "bfloat16, float16, int8, uint8, int16, int32, int64, bool)")
    if tensor.device.type != "cpu":
        raise ValueError(f"{argname}: expected a CPU tensor, got one on {tensor.device} "
                         "(copy it to the host first)")
    if not tensor.is_contiguous():
        raise ValueError(f"{argname}: expected a contiguous tensor (call .contiguous() and use that)")
    if writable and tensor.requires_grad and tensor.is_leaf:
        raise ValueError(f"{argname}: a leaf tensor that requires grad cannot be changed in place; "
                         "pass tensor.detach() or tensor.data")


def _check_op(op: str, dtype: torch.dtype, wire_dtype=None) -> int:
    check_choice("op", op, _OPS)
    if op == "avg" and dtype not in _FLOATS:
        raise ValueError(f"op: 'avg' needs a floating-point tensor, got {dtype} (use 'sum' and "
                         "divide, or convert to float)")
    if dtype == torch.bool and op not in ("min", "max", "prod"):
        raise ValueError(f"op: {op!r} is not defined for bool tensors; 'min' is all, 'max' is any")
    if dtype in (torch.bfloat16, torch.float16) and op in ("min", "max", "prod"):
        raise ValueError(f"op: {op!r} of {dtype} tensors is not supported; use float32")
    if wire_dtype is not None and op not in ("sum", "avg"):
        raise ValueError(f"wire_dtype: only 'sum' and 'avg' can be compressed, got op={op!r}")
    return _OPS[op]


def allreduce(tensor: torch.Tensor, op: str = "sum", comm=None, wire_dtype=None,
              async_op: bool = False):
    """Reduce `tensor` in place over every rank of `comm`.

    op: "sum", "avg" (floating-point tensors), "min", "max" or "prod" (not
    for bfloat16/float16); bool tensors take "min" (all), "max" (any) and
    "prod". Integer results wrap around as in C on overflow. wire_dtype: None
    (send the tensor's own dtype) or torch.bfloat16 / torch.float16 to send a
    float32 tensor compressed ("sum" and "avg"), or torch.uint8 to send it
    quantized to 8 bits per element in blocks of 256 (about a quarter of the
    float32 bytes; error at most half a quantization step of each block, twice;
    a block holding a NaN or an infinity on any rank becomes NaN on every
    rank). With async_op=True a `Work` is
    returned: `wait()` completes it, `is_completed()` polls it, `result()`
    waits and returns the tensor; the tensor must not be used until then.

    Before anything is sent the ranks check that they passed the same shape,
    dtype, op and wire_dtype (one small blocking allreduce; a mismatch raises
    ValueError on every rank, naming each rank's)."""
    return allreduce_agreed(tensor, op, comm, wire_dtype, async_op, check=True)


def allreduce_agreed(tensor: torch.Tensor, op: str = "sum", comm=None, wire_dtype=None,
                     async_op: bool = False, check: bool = False):
    """allreduce() for callers whose ranks agreed on the tensor's shape when
    they were set up (the algorithms' per-step traffic): no check unless
    `check`."""
    _check_tensor(tensor)
    code = _check_op(op, tensor.dtype, wire_dtype)
    wire = wire_code(wire_dtype, quantized=True)
    if wire == _C.DTYPE_U8 and tensor.dtype != torch.float32:
        raise TypeError(f"wire_dtype: torch.uint8 quantizes float32 tensors, got {tensor.dtype}")
    check_bool("async_op", async_op)
    c = resolve_comm(comm)
    if check:
        agree(c, "allreduce", tensor, names=_NAMES, op=code, wire=wire)
    work = c.allreduce(tensor.detach(), code, wire, async_op)
    return Work(work, tensor) if async_op else None


def allreduce_scalar(value, op: str = "avg", comm=None):
    """The reduction of a Python number (or 1-element tensor) over the ranks:
    metric averaging such as `allreduce_scalar(loss.item())`. Returns a float
    for floats and for "avg", an int for integers, a bool for bools.

    value: a Python number or a 1-element tensor; op: "sum", "avg", "min",
    "max" or "prod"; comm: the ranks taking part (an mpi4py communicator or
    MPICommunication; None: every rank)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"value: expected a number or a one-element tensor, got shape "
                             f"{tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool):
        t = torch.tensor([value], dtype=torch.bool)
    elif isinstance(value, numbers.Integral) and op != "avg":
        t = torch.tensor([int(value)], dtype=torch.int64)
    elif isinstance(value, numbers.Real):
        t = torch.tensor([float(value)], dtype=torch.float64)
    else:
        raise TypeError(f"value: expected a number, got {type(value).__name__}")
    allreduce(t, op, comm)
    return t.item()


def broadcast(tensor: torch.Tensor, root: int = 0, comm=None, async_op: bool = False):
    """Make `tensor` rank `root`'s on every rank (in place; returned too).

    comm: the ranks taking part (an mpi4py communicator or MPICommunication;
    None: every rank). With async_op=True a `Work` is returned instead (see
    allreduce); its result() is the tensor."""
    c = resolve_comm(comm)
    _check_tensor(tensor, writable=c.rank != root)
    check_bool("async_op", async_op)
    agree(c, "broadcast", tensor, root=check_root(root, c))
    work = c.bcast(tensor.detach(), root, async_op)
    return Work(work, tensor) if async_op else tensor


def allgather(tensor: torch.Tensor, comm=None, async_op: bool = False):
    """Every rank's `tensor` concatenated along dimension 0, in rank order
    (Horovod's allgather). The first dimension may differ between ranks; the
    others, and the dtype, must not.

    comm: the ranks taking part (an mpi4py communicator or MPICommunication;
    None: every rank). With async_op=True a `Work` is returned whose result()
    is the concatenation (the ranks' shapes are exchanged first, blocking)."""
    _check_tensor(tensor, writable=False)
    check_bool("async_op", async_op)
    c = resolve_comm(comm)
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    rows = _rows_of_every_rank(c, t)
    row = t[0].numel() if t.shape[0] else int(torch.Size(t.shape[1:]).numel())
    out = torch.empty((sum(rows),) + tuple(t.shape[1:]), dtype=t.dtype)
    work = c.allgatherv(t.contiguous(), out, tuple(n * row for n in rows), async_op)
    return Work(work, tensor) if async_op else out


def _rows_of_every_rank(c, t: torch.Tensor) -> list:
    """Each rank's first dimension, after checking that the dtype and the
    other dimensions agree (one small allgather)."""
    shape = torch.zeros(3, dtype=torch.int64)
    shape[0] = t.shape[0]
    shape[1] = zlib.crc32(repr((tuple(t.shape[1:]), str(t.dtype))).encode())
    shapes = torch.empty(c.size * 3, dtype=torch.int64)
    c.allgather(shape, shapes)
    shapes = shapes.view(c.size, 3)
    if not bool((shapes[:, 1] == shape[1]).all()):
        refuse(c, "allgather", signature("allgather", t, rows_free=True), {})
    return shapes[:, 0].tolist()


def reduce_scatter(tensor: torch.Tensor, op: str = "sum", comm=None, counts=None,
                   async_op: bool = False):
    """This rank's block of the sum ("sum") or mean ("avg") of every rank's
    `tensor` (float32 or float64, the same shape everywhere), split along
    dimension 0: rank r gets rows counts[r] (default: as even as possible,
    the first len % size ranks one row more, as Horovod's reducescatter).
    counts, when given, is one int >= 0 per rank summing to len(tensor), the
    same on every rank. The mean is the sum times 1/size.

    comm: the ranks taking part (an mpi4py communicator or MPICommunication;
    None: every rank). With async_op=True a `Work` is returned whose result()
    is this rank's block.

    op: "sum" or "avg". The ranks first check that they passed the same
    shape, dtype, op and counts (see allreduce)."""
    return reduce_scatter_agreed(tensor, op, comm, counts, async_op, check=True)


def reduce_scatter_agreed(tensor: torch.Tensor, op: str = "sum", comm=None, counts=None,
                          async_op: bool = False, check: bool = False):
    """reduce_scatter() without the check, as allreduce_agreed()."""
    _check_tensor(tensor, writable=False)
    check_choice("op", op, ("sum", "avg"))
    check_bool("async_op", async_op)
    if tensor.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"tensor: expected float32 or float64, got {tensor.dtype}")
    c = resolve_comm(comm)
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    n = t.shape[0]
    if counts is None:
        counts = [n // c.size + (1 if r < n % c.size else 0) for r in range(c.size)]
    else:
        counts = [check_int(f"counts[{i}]", k, 0) for i, k in enumerate(counts)]
        if len(counts) != c.size or sum(counts) != n:
            raise ValueError(f"counts: expected {c.size} ints >= 0 (one per rank) summing to "
                             f"{n}, got {counts!r}")
    code = _OPS["avg" if op == "avg" else "sum"]
    if check:
        agree(c, "reduce_scatter", t, names=_NAMES, op=code, layout=crc_of(counts))
    row = int(torch.Size(t.shape[1:]).numel())
    out = torch.empty((counts[c.rank],) + tuple(t.shape[1:]), dtype=t.dtype)
    work = c.reduce_scatter(t.contiguous(), out, tuple(k * row for k in counts),
                            code, async_op)
    return Work(work, tensor) if async_op else out


def barrier(comm=None, async_op: bool = False):
    """Wait until every rank of `comm` has called barrier(); with
    async_op=True return a `Work` that completes then, without waiting."""
    check_bool("async_op", async_op)
    work = resolve_comm(comm).barrier(async_op)
    return Work(work, None) if async_op else None


def rank(comm=None) -> int:
    """This process's rank in `comm` (default MPI.COMM_WORLD)."""
    return resolve_comm(comm).rank


def size(comm=None) -> int:
    """The number of ranks in `comm` (default MPI.COMM_WORLD)."""
    return resolve_comm(comm).size


def local_rank() -> int:
    """This rank's index on its node (mpidp.topology().local_rank)."""
    return topology().local_rank


def check_root(root, c) -> int:
    """`root` as a rank of `c` (a _C.Comm), or a clear error."""
    if isinstance(root, bool) or not isinstance(root, int):
        raise TypeError(f"root: expected an int, got {type(root).__name__}")
    if not 0 <= root < c.size:
        raise ValueError(f"root: expected a rank in 0 .. {c.size - 1}, got {root}")
    return root
