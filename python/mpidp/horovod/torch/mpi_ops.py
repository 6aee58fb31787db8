"""Horovod's collectives on torch tensors (horovod.torch.mpi_ops): the same
names, arguments, defaults and return types, over mpidp's core.

Every op is queued and matched across ranks by name (mpidp.horovod._controller);
`*_async*` return an int handle for poll() / synchronize(); the plain forms
wait. Tensors may live on any device: MPI reads host copies, and results
come back to the tensor's device. The out-of-place allreduce, allgather,
broadcast, alltoall and reducescatter are differentiable, with Horovod's
gradients."""

from __future__ import annotations

import warnings
from typing import List

import torch

from ... import _C
from .. import _basics, _controller
from .._basics import global_process_set
from .._controller import Op
from .compression import Compression

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "allreduce_",
           "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
           "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async",
           "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
           "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
           "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
           "grouped_reducescatter_async", "poll", "synchronize", "join", "barrier"]

Average, Sum, Adasum, Min, Max, Product = range(6)
_OP_NAMES = ("Average", "Sum", "Adasum", "Min", "Max", "Product")
_CORE_OP = {Average: _C.OP_SUM, Sum: _C.OP_SUM, Min: _C.OP_MIN, Max: _C.OP_MAX,
            Product: _C.OP_PROD}
_CORE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8,
                torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
_HALF = (torch.float16, torch.bfloat16)
_WIRE = {torch.float16: _C.DTYPE_F16, torch.bfloat16: _C.DTYPE_BF16}


def handle_average_backwards_compatibility(op, average) -> int:
    """Horovod's rule: `average` is deprecated, op=None means Average, and
    giving both is an error."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, bool) or op not in range(6):
        raise ValueError(f"op: expected one of hvd.Average, Sum, Adasum, Min, Max, Product, "
                         f"got {op!r}")
    if op == Adasum:
        raise NotImplementedError(
            "op: hvd.Adasum is not implemented by mpidp; use op=hvd.Average (the default; "
            "scale the learning rate by hvd.size() as Horovod's examples do without Adasum)")
    return op


def _check_tensor(tensor, argname: str = "tensor") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{argname}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{argname}: a sparse tensor; use sparse_allreduce_async or .to_dense()")
    if tensor.dtype not in _CORE_DTYPES:
        raise TypeError(f"{argname}: dtype {tensor.dtype} is not supported (float32, float64, "
                        "bfloat16, float16, int8, uint8, int16, int32, int64, bool)")


def _check_factor(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    return float(value)


def _host(tensor: torch.Tensor, dtype=None) -> torch.Tensor:
    """The tensor itself where MPI can read it in place, else a host copy."""
    t = tensor.detach()
    if t.device.type == "cpu" and t.is_contiguous() and (dtype is None or dtype == t.dtype):
        return t
    return t.to("cpu", dtype=dtype or t.dtype).contiguous()


def _scale_(t: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if t.dtype.is_floating_point:
        t.mul_(factor)
    else:   # Horovod scales integers through a double and truncates
        t.copy_(torch.trunc(t.double() * factor).to(t.dtype))


def _average_(t: torch.Tensor, size: int, postscale: float) -> None:
    """An Average's division by the set's size, then the postscale factor.
    Divided, not multiplied by 1/size: the quotient is then the correctly
    rounded one that a program computes itself (x * (1/3) is not x / 3 in
    float32, and truncates 6 to 1 for integers)."""
    if t.dtype.is_floating_point:
        t.div_(size)
    else:
        t.copy_(torch.div(t, size, rounding_mode="trunc"))
    _scale_(t, postscale)


def _match(**fields) -> dict:
    return {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in fields.items()}


# -- allreduce -----------------------------------------------------------------------

def _reduce_plan(t: torch.Tensor, op: int, compression):
    """(code, wire, dtype MPI reduces in) for allreducing `t` with `op`."""
    wire = _C.NO_WIRE
    wire_dtype = getattr(compression, "wire_dtype", None)
    if wire_dtype is not None and t.dtype == torch.float32 and op in (Average, Sum):
        wire = _WIRE[wire_dtype]
    if t.dtype == torch.bool and op in (Sum, Average):
        raise ValueError("op: Sum/Average of bool tensors is not defined; use hvd.Min (all) or "
                         "hvd.Max (any)")
    # The core reduces half precision with Sum only: Min/Max/Product in float32.
    via = torch.float32 if t.dtype in _HALF and op in (Min, Max, Product) else t.dtype
    return _CORE_OP[op], wire, via


def _allreduce_op(targets: List[torch.Tensor], op: int, prescale: float, postscale: float,
                  compression, kind: str) -> Op:
    """One op reducing every tensor of `targets` in place (grouped: one
    buffer per dtype); its result is `targets` (a list)."""
    plans = [_reduce_plan(t, op, compression) for t in targets]
    groups: dict = {}
    for i, (t, plan) in enumerate(zip(targets, plans)):
        groups.setdefault(plan, []).append(i)
    buffers = []
    for (code, wire, via), members in groups.items():
        if len(members) == 1:
            buf = _host(targets[members[0]], via)
        else:
            buf = torch.cat([_host(targets[i], via).reshape(-1) for i in members])
        buffers.append((buf, code, wire, members))
    active = [0]

    def start(o, infos, joined):
        # Horovod's Average divides by the set's size, joined ranks (whose
        # part is zeros) included.
        active[0] = len(infos)
        works = []
        for buf, code, wire, _ in buffers:
            _scale_(buf, prescale)
            works.append(o.set.c.allreduce(buf, code, wire, True))
        return works

    def finish(o):
        for buf, _, _, members in buffers:
            if op == Average:
                _average_(buf, active[0], postscale)
            else:
                _scale_(buf, postscale)
            at = 0
            for i in members:
                t = targets[i]
                part = buf if len(members) == 1 else buf[at:at + t.numel()]
                at += t.numel()
                if part.data_ptr() != t.data_ptr() or part.dtype != t.dtype:
                    t.detach().copy_(part.view(t.shape))
        return targets

    match = _match(kind="allreduce", op=_OP_NAMES[op], prescale=prescale, postscale=postscale,
                   wire=[w for _, _, w, _ in buffers],
                   tensors=[(str(t.dtype), tuple(t.shape)) for t in targets])
    return Op(None, kind, match, None, start, finish)


def zeros_allreduce(name: str, match: dict) -> Op:
    """A joined rank's part of the allreduce `match` describes: zeros."""
    targets = [torch.zeros(shape, dtype=getattr(torch, dtype.replace("torch.", "")))
               for dtype, shape in match["tensors"]]
    op = _OP_NAMES.index(match["op"])
    wire = match["wire"][0] if match["wire"] else _C.NO_WIRE
    compression = Compression.fp16 if wire == _C.DTYPE_F16 else \
        Compression.bf16 if wire == _C.DTYPE_BF16 else Compression.none
    o = _allreduce_op(targets, op, 1.0, 1.0, compression, "allreduce")
    o.name = name
    return o


def _submit(o: Op, name, process_set) -> int:
    return _controller.submit(process_set, o, name)


def _allreduce_async(targets, name, op, prescale, postscale, process_set, compression,
                     kind: str, single: bool) -> int:
    prescale = _check_factor("prescale_factor", prescale)
    postscale = _check_factor("postscale_factor", postscale)
    o = _allreduce_op(targets, op, prescale, postscale, compression, kind)
    if single:
        inner = o.finish
        o.finish = lambda op_: inner(op_)[0]
    return _submit(o, name, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing `tensor` in place; synchronize(handle) returns it."""
    _check_tensor(tensor)
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async([tensor], name, op, prescale_factor, postscale_factor, process_set,
                            Compression.none, "allreduce", single=True)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a copy of `tensor`; synchronize(handle) returns the copy."""
    _check_tensor(tensor)
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async([tensor.detach().clone()], name, op, prescale_factor,
                            postscale_factor, process_set, Compression.none, "allreduce",
                            single=True)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Reduce `tensor` in place over the process set; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set, compression):
        ctx.args = (op, prescale, postscale, process_set)
        out = tensor.detach().clone()
        if compression is Compression.none or getattr(compression, "wire_dtype", None) \
                is not None and tensor.dtype == torch.float32:
            return synchronize(_allreduce_async([out], name, op, prescale, postscale,
                                                process_set, compression, "allreduce", True))
        packed, cctx = compression.compress(out)
        summed = synchronize(_allreduce_async([packed.detach().clone()], name, op, prescale,
                                              postscale, process_set, Compression.none,
                                              "allreduce", True))
        return compression.decompress(summed, cctx)

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        return (allreduce(grad, op=op, prescale_factor=prescale, postscale_factor=postscale,
                          process_set=process_set), None, None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """The reduction of `tensor` over the process set, as a new tensor
    (differentiable; its gradient is the same reduction of the gradient).
    Average = (sum of tensor * prescale_factor) * postscale_factor / size."""
    _check_tensor(tensor)
    op = handle_average_backwards_compatibility(op, average)
    _check_factor("prescale_factor", prescale_factor)
    _check_factor("postscale_factor", postscale_factor)
    return _AllreduceFn.apply(tensor, name, op, prescale_factor, postscale_factor, process_set,
                              compression)


def _check_list(tensors, argname="tensors") -> list:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{argname}: expected a list of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        _check_tensor(t, f"{argname}[{i}]")
    return list(tensors)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """Reduce every tensor in place as one operation (one message per dtype)."""
    tensors = _check_list(tensors)
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async(tensors, name, op, prescale_factor, postscale_factor, process_set,
                            Compression.none, "grouped_allreduce", single=False)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    tensors = _check_list(tensors)
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op,
                                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, compression, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        outs = [t.detach().clone() for t in tensors]
        return tuple(synchronize(_allreduce_async(outs, name, op, prescale, postscale,
                                                  process_set, compression, "grouped_allreduce",
                                                  single=False)))

    @staticmethod
    def backward(ctx, *grads):
        # As one allreduce's: the same reduction of the gradients, grouped.
        op, prescale, postscale, process_set = ctx.args
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=op,
                                    prescale_factor=prescale, postscale_factor=postscale,
                                    process_set=process_set)
        return (None,) * 6 + tuple(reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """The reductions of `tensors` (a list), as new tensors, in one operation
    (differentiable: each gradient is the same reduction of its gradient)."""
    tensors = _check_list(tensors)
    op = handle_average_backwards_compatibility(op, average)
    _check_factor("prescale_factor", prescale_factor)
    _check_factor("postscale_factor", postscale_factor)
    return list(_GroupedAllreduceFn.apply(name, op, prescale_factor, postscale_factor,
                                          process_set, compression, *tensors))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set) -> int:
    """Reduce a sparse COO tensor (Sum or Average): every rank's indices and
    values are gathered and summed; synchronize(handle) returns the result."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError("tensor: expected a sparse COO tensor")
    op = handle_average_backwards_compatibility(op, None)
    if op not in (Average, Sum):
        raise ValueError("op: sparse allreduce supports hvd.Average and hvd.Sum")
    t = tensor.detach().coalesce()
    indices = _host(t.indices().t().contiguous())
    values = _host(t.values())
    shape, device = tuple(t.shape), tensor.device
    gathered = {}

    def start(o, infos, joined):
        works = []
        for key, part in (("i", indices), ("v", values)):
            rows = [info for info in infos]
            row = int(torch.Size(part.shape[1:]).numel())
            out = torch.empty((sum(rows),) + tuple(part.shape[1:]), dtype=part.dtype)
            gathered[key] = out
            works.append(o.set.c.allgatherv(part, out, tuple(n * row for n in rows), True))
        active = len(infos)
        gathered["n"] = active
        return works

    def finish(o):
        # Checked: the indices came from other ranks, and a bad one would corrupt memory.
        out = torch.sparse_coo_tensor(gathered["i"].t(), gathered["v"], shape,
                                      check_invariants=True).coalesce()
        if op == Average:
            out = out / gathered["n"]
        return out.to(device)

    o = Op(None, "sparse_allreduce", _match(kind="sparse_allreduce", dtype=t.dtype, shape=shape,
                                            op=_OP_NAMES[op]),
           int(indices.shape[0]), start, finish)
    return _SparseHandle(_submit(o, name, process_set))


class _SparseHandle(int):
    """sparse_allreduce_async's handle: Horovod's is a function that waits
    and returns the result (its DistributedOptimizer calls it); this one is
    also an ordinary handle for poll() and synchronize()."""

    def __call__(self):
        return synchronize(self)


# -- allgather ------------------------------------------------------------------------

def _allgather_op(tensors: List[torch.Tensor], kind: str, single: bool) -> Op:
    bufs = [_host(t.reshape(1) if t.dim() == 0 else t) for t in tensors]
    outs: list = []

    def start(o, infos, joined):
        works = []
        for k, buf in enumerate(bufs):
            rows = [info[k] for info in infos]
            row = int(torch.Size(buf.shape[1:]).numel())
            out = torch.empty((sum(rows),) + tuple(buf.shape[1:]), dtype=buf.dtype)
            outs.append(out)
            works.append(o.set.c.allgatherv(buf, out, tuple(n * row for n in rows), True))
        return works

    def finish(o):
        res = [out.to(t.device) for out, t in zip(outs, tensors)]
        return res[0] if single else res

    match = _match(kind=kind, tensors=[(str(b.dtype), tuple(b.shape[1:])) for b in bufs])
    return Op(None, kind, match, [int(b.shape[0]) for b in bufs], start, finish)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's `tensor` along dim 0 (dim 0 may differ)."""
    _check_tensor(tensor)
    return _submit(_allgather_op([tensor], "allgather", True), name, process_set)


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        return _allgather_grads([grad], [ctx.rows], ctx.process_set)[0], None, None


def _allgather_grads(grads, rows: List[int], process_set) -> list:
    """Horovod's gradient of an allgather (its autograd function defines it):
    the rows this rank gave, of the gradients averaged over the set."""
    reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average,
                                process_set=process_set)
    everyone = synchronize(allgather_async(torch.tensor([rows]), None, process_set))
    offsets = everyone[:_controller.set_rank(process_set)].sum(0)
    return [r.narrow(0, int(o), n) for r, o, n in zip(reduced, offsets, rows)]


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's `tensor` concatenated along dim 0, in rank order
    (differentiable: the gradient is this rank's rows of the averaged
    gradient)."""
    _check_tensor(tensor)
    return _AllgatherFn.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    tensors = _check_list(tensors)
    return _submit(_allgather_op(tensors, "grouped_allgather", False), name, process_set)


class _GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.shapes = [t.shape for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        mine = _allgather_grads(grads, ctx.rows, ctx.process_set)
        return (None, None) + tuple(g.reshape(shape) for g, shape in zip(mine, ctx.shapes))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """allgather of each tensor of the list, as one operation (differentiable
    as allgather)."""
    tensors = _check_list(tensors)
    return list(_GroupedAllgatherFn.apply(name, process_set, *tensors))


# -- broadcast ------------------------------------------------------------------------

def _root_in_set(root_rank, process_set) -> int:
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"root_rank: expected an int, got {type(root_rank).__name__}")
    _basics.comm_of(process_set)
    ranks = (process_set or global_process_set).ranks
    if root_rank not in ranks:
        raise ValueError(f"root_rank: {root_rank} is not a rank of the process set {ranks}")
    return ranks.index(root_rank)


def _broadcast_op(target: torch.Tensor, root: int, root_rank: int) -> Op:
    buf = _host(target)

    def start(o, infos, joined):
        return [o.set.c.bcast(buf, root, True)]

    def finish(o):
        if buf.data_ptr() != target.data_ptr():
            target.detach().copy_(buf)
        return target

    match = _match(kind="broadcast", dtype=target.dtype, shape=tuple(target.shape),
                   root_rank=root_rank)
    return Op(None, "broadcast", match, None, start, finish)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start making `tensor` root_rank's (a world rank), in place."""
    _check_tensor(tensor)
    root = _root_in_set(root_rank, process_set)
    return _submit(_broadcast_op(tensor, root, root_rank), name, process_set)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    _check_tensor(tensor)
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if _basics.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """root_rank's `tensor` as a new tensor on every rank (differentiable)."""
    _check_tensor(tensor)
    _root_in_set(root_rank, process_set)
    return _BroadcastFn.apply(tensor, root_rank, name, process_set)


# -- alltoall -------------------------------------------------------------------------

def _splits_of(tensor: torch.Tensor, splits, n: int) -> List[int]:
    rows = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if rows % n:
            raise ValueError(f"splits: None splits dim 0 evenly, but {rows} rows cannot be "
                             f"split among {n} ranks; pass splits")
        return [rows // n] * n
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dim() != 1:
            # ValueError, as Horovod raises for splits of another dtype.
            raise ValueError(f"splits: expected a 1-D integer tensor, got a {splits.dim()}-D "
                             f"{splits.dtype} tensor")
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"splits: expected {n} ints >= 0 (one per rank) summing to {rows}, "
                         f"got {splits}")
    return splits


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start sending rows splits[r] of `tensor` to rank r (default: equal
    parts); synchronize returns (received tensor, received splits)."""
    _check_tensor(tensor)
    n = _controller.set_size(process_set)
    mine = _splits_of(tensor, splits, n)
    buf = _host(tensor.reshape(1) if tensor.dim() == 0 else tensor)
    row = int(torch.Size(buf.shape[1:]).numel())
    got: dict = {}

    def start(o, infos, joined):
        me = o.set.c.rank
        recv = [info[me] for info in infos]
        out = torch.empty((sum(recv),) + tuple(buf.shape[1:]), dtype=buf.dtype)
        got["out"], got["splits"] = out, recv
        return [o.set.c.alltoallv(buf, out, tuple(s * row for s in mine),
                                  tuple(s * row for s in recv), True)]

    def finish(o):
        return got["out"].to(tensor.device), torch.tensor(got["splits"], dtype=torch.int32)

    match = _match(kind="alltoall", dtype=buf.dtype, shape=tuple(buf.shape[1:]))
    o = Op(None, "alltoall", match, mine, start, finish)
    return _submit(o, name, process_set)


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _grad_splits):
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, None,
                                             ctx.process_set))
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows splits[r] of `tensor` go to rank r; returns what this rank
    received, concatenated in rank order, and -- where splits were given --
    the received splits too (differentiable)."""
    _check_tensor(tensor)
    out, received = _AlltoallFn.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


# -- reducescatter --------------------------------------------------------------------

def _reducescatter_op(tensors, op, prescale, postscale, kind, single) -> Op:
    if op not in (Average, Sum):
        raise ValueError(f"op: reducescatter supports hvd.Average and hvd.Sum, got "
                         f"{_OP_NAMES[op]}")
    for i, t in enumerate(tensors):
        if t.dim() == 0:   # no dimension to scatter (Horovod refuses it too)
            raise ValueError(f"tensor{'' if single else f's[{i}]'}: {kind} scatters dimension 0, "
                             "and a 0-d tensor has none")
    # The core scatters float32/float64 sums; other dtypes reduce in full and keep their rows.
    bufs = [_host(t) for t in tensors]
    outs: list = []
    active = [0]

    def start(o, infos, joined):
        c, works = o.set.c, []
        active[0] = c.size
        for buf in bufs:
            _scale_(buf, prescale)
            n = buf.shape[0]
            counts = [n // c.size + (1 if r < n % c.size else 0) for r in range(c.size)]
            row = int(torch.Size(buf.shape[1:]).numel())
            first = sum(counts[:c.rank])
            if buf.dtype in (torch.float32, torch.float64):
                out = torch.empty((counts[c.rank],) + tuple(buf.shape[1:]), dtype=buf.dtype)
                outs.append((out, None))
                works.append(c.reduce_scatter(buf, out, tuple(k * row for k in counts),
                                              _C.OP_SUM, True))
            else:
                outs.append((buf, (first, counts[c.rank])))
                works.append(c.allreduce(buf, _C.OP_SUM, _C.NO_WIRE, True))
        return works

    def finish(o):
        res = []
        for (out, rows), t in zip(outs, tensors):
            if rows is not None:
                out = out.narrow(0, rows[0], rows[1]).clone()
            if op == Average:
                _average_(out, active[0], postscale)
            else:
                _scale_(out, postscale)
            res.append(out.to(t.device))
        return res[0] if single else res

    match = _match(kind=kind, op=_OP_NAMES[op], prescale=prescale, postscale=postscale,
                   tensors=[(str(b.dtype), tuple(b.shape)) for b in bufs])
    return Op(None, kind, match, None, start, finish)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start the reduction whose rows are split over the ranks: ranks
    0 .. (rows mod size)-1 get one row more."""
    _check_tensor(tensor)
    op = handle_average_backwards_compatibility(op, None)
    o = _reducescatter_op([tensor.detach().clone()], op,
                          _check_factor("prescale_factor", prescale_factor),
                          _check_factor("postscale_factor", postscale_factor),
                          "reducescatter", True)
    return _submit(o, name, process_set)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.args = (op, process_set, prescale * postscale)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale,
                                               postscale))

    @staticmethod
    def backward(ctx, grad):
        op, process_set, scale = ctx.args
        full = synchronize(allgather_async(grad.contiguous(), None, process_set))
        return full * _reducescatter_grad_scale(op, process_set, scale), None, None, None, None, None


def _reducescatter_grad_scale(op: int, process_set, scale: float) -> float:
    """Horovod's gradient of a reducescatter (its autograd function defines
    it): every rank's output gradient gathered, times the set's size for a
    Sum and as it is for an Average, times the forward's scale factors."""
    return scale * _controller.set_size(process_set) if op == Sum else scale


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's rows of the reduction (Average or Sum) of every rank's
    `tensor` (differentiable)."""
    _check_tensor(tensor)
    op = handle_average_backwards_compatibility(op, None)
    packed, cctx = compression.compress(tensor)
    out = _ReducescatterFn.apply(packed, name, op, process_set, prescale_factor,
                                 postscale_factor)
    return compression.decompress(out, cctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    tensors = _check_list(tensors)
    op = handle_average_backwards_compatibility(op, None)
    o = _reducescatter_op([t.detach().clone() for t in tensors], op,
                          _check_factor("prescale_factor", prescale_factor),
                          _check_factor("postscale_factor", postscale_factor),
                          "grouped_reducescatter", False)
    return _submit(o, name, process_set)


class _GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, *tensors):
        ctx.args = (op, process_set, prescale * postscale)
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op,
                                                             process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, scale = ctx.args
        fulls = synchronize(grouped_allgather_async([g.contiguous() for g in grads], None,
                                                    process_set))
        factor = _reducescatter_grad_scale(op, process_set, scale)
        return (None,) * 5 + tuple(f * factor for f in fulls)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """reducescatter of each tensor of the list, as one operation
    (differentiable as reducescatter)."""
    tensors = _check_list(tensors)
    op = handle_average_backwards_compatibility(op, None)
    packed = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatterFn.apply(name, op, process_set, prescale_factor,
                                         postscale_factor, *[p for p, _ in packed])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed)]


# -- waiting ----------------------------------------------------------------------------

def poll(handle) -> bool:
    """Whether the operation of `handle` has completed (does not block)."""
    return _controller.poll(handle)


def synchronize(handle):
    """Wait for the operation of `handle`; returns its output (the tensor,
    a list for grouped ops, (tensor, splits) for alltoall_async)."""
    return _controller.synchronize(handle)


def join(device=-1) -> int:
    """This rank has no more batches: until every rank has joined, its part
    of the others' allreduces is zeros (an Average still divides by the
    whole size, as Horovod's). Returns the rank that joined last."""
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"device: expected an int, got {type(device).__name__}")
    for refuse in _controller.join_refusals:
        refuse()
    return _controller.join(global_process_set)


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of the process set has called barrier()."""
    def start(o, infos, joined):
        return [o.set.c.barrier(True)]

    o = Op(None, "barrier", _match(kind="barrier"), None, start, lambda o: None)
    synchronize(_submit(o, None, process_set))


_controller.zeros_allreduce = zeros_allreduce   # a joined rank's part of an allreduce
