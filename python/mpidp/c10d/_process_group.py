"""ProcessGroupMPIDP: torch.distributed's collectives on mpidp's C core.

A Python subclass of dist.ProcessGroup (torch's Python-backend route): the
DDP reducer, FSDP2, DTensor and the dist.* functions call its methods, each
of which posts one core operation on the group's MPI communicator and
returns an MPIDPWork. With MPIDP_C10D_IMPL=cpp a C++ c10d::Backend
(mpidp._c10d) stands in front of it, runs the common calls on host tensors
itself and hands it the rest (docs/torch-distributed.md)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .. import _C
from .._runtime import config
from .._runtime.argument_agreement import agree, crc_of
from ._device import DevicePath
from ._sparse import all_reduce_sparse
from ._tensors import check_dtype, exported, reduction, staged
from ._work import MPIDPWork, after_callbacks


def _root(opts) -> int:
    return int(opts.rootRank)


def _one(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"mpidp backend: {what} takes one tensor per process, got {len(tensors)}")
    return tensors[0]


def _unflatten_into(outputs, flat: torch.Tensor, counts) -> None:
    """Copies flat's consecutive pieces (counts[i] elements; a complex
    output's as its real view) into the tensors `outputs`."""
    with torch.no_grad():
        for o, piece in zip(outputs, torch.split(flat, list(counts))):
            o.copy_(torch.view_as_complex(piece.view(*o.shape, 2)) if o.is_complex()
                    else piece.view(o.shape))


class ProcessGroupMPIDP(dist.ProcessGroup):
    """The group over mpi4py communicator `mpi_comm` (its ranks in its
    order), with torch's per-group `timeout`."""

    def __init__(self, mpi_comm, timeout: datetime.timedelta | None, global_ranks):
        _run_collectives_eagerly_under_compile()
        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size())
        self._mpi_comm = mpi_comm
        self._comm = _C.Comm(mpi_comm)
        self._global_ranks = list(global_ranks) if global_ranks else list(range(self._comm.size))
        # A group other than the default one names global ranks in its messages.
        self._named_ranks = list(global_ranks) if global_ranks else None
        self._unusable: str | None = None     # why every later call raises, once it does
        self._timeout_s = float(config.get("MPIDP_TIMEOUT"))
        if timeout is not None and timeout.total_seconds() > 0:
            self._timeout_s = min(self._timeout_s, timeout.total_seconds())
        self._check = bool(config.get("MPIDP_C10D_CHECK"))
        self._device = DevicePath(self)
        self._name = ""
        self._desc = ""

    # -- identity (DeviceMesh, FSDP2 and DTensor look groups up by name) -----
    def getBackendName(self) -> str:
        return "mpidp"

    def name(self) -> str:
        return "mpidp"

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def group_desc(self) -> str:
        return self._desc

    @property
    def _device_types(self):
        """The devices the group serves (torch reads it, e.g. async_save
        checks for the CPU; a Python group registers no backends of its own)."""
        return [torch.device("cpu"), torch.device("cuda")]

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = min(float(config.get("MPIDP_TIMEOUT")), timeout.total_seconds())

    @property
    def core_comm(self) -> "_C.Comm":
        """The core's duplicate of the group's communicator."""
        return self._comm

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def checks(self) -> bool:
        """Whether calls check that every rank passed the same (MPIDP_C10D_CHECK)."""
        return self._check

    @property
    def global_ranks(self) -> list:
        """The group's ranks in the default group (the job's, for messages)."""
        return list(self._global_ranks)

    @property
    def mpi_comm(self):
        """The mpi4py communicator this group was made from."""
        return self._mpi_comm

    # -- helpers ------------------------------------------------------------
    def _describe(self, what: str):
        return lambda: (f"mpidp backend: {what} on group {self._name or '?'} (ranks "
                        f"{self._global_ranks} of the default group; this is group rank "
                        f"{self._comm.rank})")

    def _work(self, c_works, outputs, finish, what: str, source=None) -> MPIDPWork:
        return MPIDPWork(c_works, outputs, finish, self._describe(what), self._timeout_s, source,
                         failed=self._left_posted)

    def _left_posted(self, what: str) -> None:
        """A call that failed may still be posted in MPI (a deadline, a rank
        that ended): a later call would pair with it on the ranks that make
        one, so every later call on the group raises instead."""
        if self._unusable is None:
            self._unusable = (f"an earlier call ({what}) failed (timed out, or a rank it needs "
                              "ended) and may still be posted in MPI, so a later call would "
                              "pair with it on the ranks that make one; make a new group "
                              "(dist.new_group, or shrink_group in fault-tolerant mode)")

    def _enter(self, call: str) -> None:
        """Before a call: the group is usable, and the callbacks of the
        futures asked for before have run (_work.after_callbacks)."""
        if self._unusable is not None:
            raise RuntimeError(f"mpidp backend: {call} on a group that can no longer be used: "
                               f"{self._unusable}")
        after_callbacks(f"mpidp backend: {call}", self._timeout_s)

    def _agree(self, call: str, tensor: torch.Tensor, rows_free: bool = False, **settings):
        """Every rank passed the same shape, dtype and settings (one small
        allreduce, skipped with MPIDP_C10D_CHECK=0), after _enter."""
        self._enter(call)
        if self._check and self._comm.size > 1:
            try:
                agree(self._comm, call, tensor, rows_free=rows_free,
                      global_ranks=self._named_ranks, timeout_s=self._timeout_s, **settings)
            except _C.CommError:
                self._left_posted(self._describe(call)())
                raise

    @staticmethod
    def _then(*fns):
        fns = [f for f in fns if f is not None]
        if not fns:
            return None

        def run():
            for f in fns:
                f()
        return run

    # -- reductions ---------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        t = _one(tensors, "all_reduce")
        if t.layout == torch.sparse_coo:
            return all_reduce_sparse(self, t, opts.reduceOp)
        if self._device.takes(t):
            w = self._device.allreduce(t, opts.reduceOp)
            if w is not None:
                return w
        op, work, prepare, finish = reduction(t, opts.reduceOp, self._comm.size, "all_reduce")
        self._agree("all_reduce", work, op=op)
        if prepare is not None:
            prepare(work)
        c = self._comm.allreduce(exported(work), op, _C.NO_WIRE, True)
        return self._work([c], tensors, finish, "all_reduce")

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        works = [self.allreduce([t], opts) for t in tensors]
        return self._work([], tensors, self._then(*[w.wait for w in works]), "all_reduce_coalesced")

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        t = _one(tensors, "reduce")
        root = _root(opts)
        op, work, prepare, finish = reduction(t, opts.reduceOp, self._comm.size, "reduce")
        self._agree("reduce", work, op=op, root=root)
        if prepare is not None:
            if self._comm.rank != root and work.data_ptr() == t.data_ptr():
                work = work.clone()   # a non-root's input is only read
            prepare(work)
        c = self._comm.reduce(work, op, root, True)
        return self._work([c], tensors, finish if self._comm.rank == root else None, "reduce")

    def reduce_scatter(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        out = _one(outputs, "reduce_scatter")
        blocks = _one(inputs, "reduce_scatter")
        if len(blocks) != self._comm.size:
            raise ValueError(f"mpidp backend: reduce_scatter needs {self._comm.size} input "
                             f"tensors (one per rank), got {len(blocks)}")
        for b in blocks:
            check_dtype(b, "reduce_scatter")
        send = torch.cat([b.detach().reshape(-1).to("cpu") for b in blocks])
        counts = tuple(b.numel() for b in blocks)
        return self._reduce_scatter(out, send, counts, opts.reduceOp, "reduce_scatter")

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        size = self._comm.size
        if input.numel() != output.numel() * size:
            raise ValueError(f"mpidp backend: reduce_scatter_tensor: the input must hold "
                             f"{size} x the output's {output.numel()} elements, got "
                             f"{input.numel()}")
        if self._device.takes(input) and output.device == input.device and \
                output.dtype == input.dtype:
            w = self._device.reduce_scatter(output, input, opts.reduceOp)
            if w is not None:
                return w
        send, _ = staged(input, False, "reduce_scatter_tensor")
        counts = (output.numel(),) * size
        return self._reduce_scatter(output, send.reshape(-1), counts, opts.reduceOp,
                                    "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter(self, out, send, counts, reduce_op, what):
        op, work, prepare, finish = reduction(out, reduce_op, self._comm.size, what)
        if send.is_complex():
            send = torch.view_as_real(send)
        if send.dtype != work.dtype:       # a 16-bit min/max/product travels in float32
            send = send.to(work.dtype)
        self._agree(what, send, op=op, layout=crc_of(counts))
        if prepare is not None:
            send = send.clone()   # the caller's input is only read
            prepare(send)
        c = self._comm.reduce_scatter(exported(send.reshape(-1)), exported(work.reshape(-1)),
                                      tuple(n * (2 if out.is_complex() else 1) for n in counts),
                                      op, True)
        return self._work([c], [out], finish, what)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._work([], outputs, self._then(*[w.wait for w in works]),
                          "reduce_scatter_tensor_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- broadcast, gathers, scatters ----------------------------------------
    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        t = _one(tensors, "broadcast")
        root = _root(opts)
        if self._device.takes(t):
            check_dtype(t, "broadcast")
            w = self._device.broadcast(t, root)
            if w is not None:
                return w
        work, finish = staged(t, self._comm.rank != root, "broadcast")
        self._agree("broadcast", work, root=root)
        c = self._comm.bcast(exported(work.reshape(-1)), root, True)
        return self._work([c], tensors, finish, "broadcast")

    def allgather(self, outputs, inputs, opts=None):
        out_list = _one(outputs, "all_gather")
        t = _one(inputs, "all_gather")
        size = self._comm.size
        if len(out_list) != size:
            raise ValueError(f"mpidp backend: all_gather needs {size} output tensors, got "
                             f"{len(out_list)}")
        send, _ = staged(t, False, "all_gather")
        for o in out_list:
            if o.dtype != t.dtype:
                raise TypeError(f"mpidp backend: all_gather: outputs of {o.dtype} for an input "
                                f"of {t.dtype}")
        counts = tuple(o.numel() * (2 if o.is_complex() else 1) for o in out_list)
        if send.numel() != counts[self._comm.rank]:
            raise ValueError(f"mpidp backend: all_gather: this rank's output tensor holds "
                             f"{out_list[self._comm.rank].numel()} elements, its input "
                             f"{t.numel()}")
        self._agree("all_gather", send, rows_free=True, layout=crc_of(counts))
        recv = torch.empty(sum(counts), dtype=send.dtype)
        c = self._comm.allgatherv(send.reshape(-1), recv, counts, True)

        return self._work([c], outputs, lambda: _unflatten_into(out_list, recv, counts),
                          "all_gather")

    def all_gather_single(self, output, input, opts=None):
        size = self._comm.size
        if output.numel() != input.numel() * size:
            raise ValueError(f"mpidp backend: all_gather_into_tensor: the output must hold "
                             f"{size} x the input's {input.numel()} elements, got "
                             f"{output.numel()}")
        if output.dtype != input.dtype:
            raise TypeError(f"mpidp backend: all_gather_into_tensor: an output of "
                            f"{output.dtype} for an input of {input.dtype}")
        if self._device.takes(input) and output.device == input.device:
            check_dtype(input, "all_gather_into_tensor")
            w = self._device.all_gather(output, input)
            if w is not None:
                return w
        send, _ = staged(input, False, "all_gather_into_tensor")
        recv, finish = staged(output, True, "all_gather_into_tensor")
        self._agree("all_gather_into_tensor", send)
        c = self._comm.allgather(exported(send.reshape(-1)), exported(recv.reshape(-1)), True)
        return self._work([c], [output], finish, "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._work([], outputs, self._then(*[w.wait for w in works]),
                          "all_gather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # output_lists[r][k]: input k of rank r (torch's layout: one list per rank).
        size = self._comm.size
        if len(output_lists) != size or any(len(o) != len(inputs) for o in output_lists):
            raise ValueError(f"mpidp backend: all_gather_coalesced needs {size} output lists "
                             f"(one per rank) of {len(inputs)} tensors (one per input), got "
                             f"{[len(o) for o in output_lists]}")
        works = [self.allgather([[output_lists[r][k] for r in range(size)]], [t], opts)
                 for k, t in enumerate(inputs)]
        return self._work([], output_lists, self._then(*[w.wait for w in works]),
                          "all_gather_coalesced")

    def gather(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        t = _one(inputs, "gather")
        root, rank, size = _root(opts), self._comm.rank, self._comm.size
        send, _ = staged(t, False, "gather")
        count = send.numel()
        recv = finish = None
        if rank == root:
            out_list = _one(outputs, "gather")
            if len(out_list) != size:
                raise ValueError(f"mpidp backend: gather needs {size} output tensors at the "
                                 f"root, got {len(out_list)}")
            recv = torch.empty(count * size, dtype=send.dtype)

            def finish():
                _unflatten_into(out_list, recv, (count,) * size)
        elif outputs and any(len(o) for o in outputs):
            raise ValueError(f"mpidp backend: gather: only the root (rank {root}) passes "
                             "output tensors")
        self._agree("gather", send, root=root)
        c = self._comm.gatherv(send.reshape(-1), recv, (count,) * size, root, True)
        return self._work([c], outputs, finish, "gather")

    def scatter(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        t = _one(outputs, "scatter")
        root, rank, size = _root(opts), self._comm.rank, self._comm.size
        recv, finish = staged(t, True, "scatter")
        count = recv.numel()
        send = None
        if rank == root:
            in_list = _one(inputs, "scatter")
            if len(in_list) != size:
                raise ValueError(f"mpidp backend: scatter needs {size} input tensors at the "
                                 f"root, got {len(in_list)}")
            parts = [staged(i, False, "scatter")[0].reshape(-1) for i in in_list]
            if any(p.numel() != count or p.dtype != recv.dtype for p in parts):
                raise ValueError("mpidp backend: scatter: every input tensor must match the "
                                 "output tensor's size and dtype")
            send = torch.cat(parts)
        elif inputs and any(len(i) for i in inputs):
            raise ValueError(f"mpidp backend: scatter: only the root (rank {root}) passes "
                             "input tensors")
        self._agree("scatter", recv, root=root)
        c = self._comm.scatterv(send, recv.reshape(-1), (count,) * size, root, True)
        return self._work([c], outputs, finish, "scatter")

    # -- all-to-all -------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        send, _ = staged(input, False, "all_to_all_single")
        recv, finish = staged(output, True, "all_to_all_single")
        if output.dtype != input.dtype:
            raise TypeError(f"mpidp backend: all_to_all_single: an output of {output.dtype} for "
                            f"an input of {input.dtype}")
        send_counts = self._splits(input, send, input_split_sizes, "input")
        recv_counts = self._splits(output, recv, output_split_sizes, "output")
        self._agree("all_to_all_single", send, rows_free=True)
        c = self._comm.alltoallv(send.reshape(-1), recv.reshape(-1), send_counts, recv_counts,
                                 True)
        return self._work([c], [output], finish, "all_to_all_single")

    alltoall_base = all_to_all_single

    def _splits(self, t, flat, split_sizes, which):
        """Elements per rank of an all_to_all_single side: rows (dim 0) per
        rank, or equal shares when no split sizes are given."""
        size = self._comm.size
        rows = t.shape[0] if t.dim() else 1
        per_row = flat.numel() // rows if rows else 0
        if not split_sizes:
            if rows % size:
                raise ValueError(f"mpidp backend: all_to_all_single: the {which}'s first "
                                 f"dimension ({rows}) does not divide by the group's size "
                                 f"({size}); give {which}_split_sizes")
            return (rows // size * per_row,) * size
        if len(split_sizes) != size or sum(split_sizes) != rows or min(split_sizes) < 0:
            raise ValueError(f"mpidp backend: all_to_all_single: {which}_split_sizes must be "
                             f"{size} counts >= 0 summing to the {which}'s first dimension "
                             f"({rows}), got {list(split_sizes)}")
        return tuple(int(s) * per_row for s in split_sizes)

    def alltoall(self, outputs, inputs, opts=None):
        size = self._comm.size
        if len(outputs) != size or len(inputs) != size:
            raise ValueError(f"mpidp backend: all_to_all needs {size} input and {size} output "
                             f"tensors, got {len(inputs)} and {len(outputs)}")
        for t in list(outputs) + list(inputs):
            check_dtype(t, "all_to_all")
        parts = [staged(i, False, "all_to_all")[0].reshape(-1) for i in inputs]
        send = torch.cat(parts)
        send_counts = tuple(p.numel() for p in parts)
        outs = [staged(o, True, "all_to_all")[0] for o in outputs]
        recv_counts = tuple(o.numel() for o in outs)
        recv = torch.empty(sum(recv_counts), dtype=send.dtype)
        self._agree("all_to_all", send[:0])
        c = self._comm.alltoallv(send, recv, send_counts, recv_counts, True)
        return self._work([c], outputs, lambda: _unflatten_into(outputs, recv, recv_counts),
                          "all_to_all")

    # -- synchronisation and point to point -------------------------------------
    def barrier(self, opts=None):
        self._enter("barrier")
        c = self._comm.barrier(True)
        return self._work([c], [], None, "barrier")

    def send(self, tensors, dst: int, tag: int = 0):
        t = _one(tensors, "send")
        if self._unusable is not None:
            self._enter("send")
        work, _ = staged(t, False, "send")
        c = self._comm.send(work.reshape(-1), int(dst), int(tag))
        return self._work([c], tensors, None, f"send to group rank {dst}")

    def recv(self, tensors, src: int, tag: int = 0):
        return self._recv(tensors, int(src), int(tag), f"recv from group rank {src}")

    def recv_anysource(self, tensors, tag: int = 0):
        return self._recv(tensors, -1, int(tag), "recv from any rank")

    def _recv(self, tensors, src, tag, what):
        t = _one(tensors, "recv")
        if self._unusable is not None:
            self._enter("recv")
        work, finish = staged(t, True, "recv")
        source = torch.full((1,), -1, dtype=torch.int32)
        c = self._comm.recv(work.reshape(-1), src, tag, source)
        return self._work([c], tensors, finish, what, source=source)

    def abort(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


# torch.compile traces a module's forward into a graph; a group's methods
# (DDP's buffer broadcast at every forward, a collective in the model) are
# MPI calls on the C core, which no graph can hold. Dynamo treats a Python
# ProcessGroup as an opaque object and would otherwise trace into these
# methods and fail on their attributes: each runs eagerly instead, between
# the graphs it splits (gloo's calls do the same through C++). The methods
# are wrapped when the first group is made, not at import: torch._dynamo
# takes a second to import, which every rank of every job would pay.
_COLLECTIVES = ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter",
                "reduce_scatter_single", "reduce_scatter_single_coalesced", "broadcast",
                "allgather", "all_gather_single", "all_gather_single_coalesced",
                "allgather_coalesced", "gather", "scatter", "all_to_all_single", "alltoall",
                "barrier", "send", "recv", "recv_anysource")
_collectives_run_eagerly = False


def _run_collectives_eagerly_under_compile() -> None:
    global _collectives_run_eagerly
    if _collectives_run_eagerly:
        return
    import torch._dynamo
    for name in _COLLECTIVES:
        setattr(ProcessGroupMPIDP, name,
                torch._dynamo.disable(getattr(ProcessGroupMPIDP, name), recursive=True))
    _collectives_run_eagerly = True
