"""Horovod's DistributedOptimizer on mpidp's gradient reducer.

The returned optimizer is an instance of a subclass of the wrapped one's
class (isinstance(opt, torch.optim.SGD) holds, LR schedulers work on it)
sharing its param_groups and state. Gradients are reduced by the same
reducer as mpidp.DataParallel: buckets posted from C++ hooks while backward
runs, waited for at its end (blocking mode), so `.grad` holds the mean once
backward() returns and clipping or reading it is safe -- synchronize() is
there for Horovod's scripts.

Horovod's semantics kept:
- backward_passes_per_step = k: the first k-1 backward passes accumulate
  locally (the reducer is paused, as DataParallel.no_sync), the k-th
  reduces the sum (not divided by k). A step after fewer passes reduces
  what was accumulated; more passes than k before a step raise Horovod's
  AssertionError.
- synchronize(): reduces what no backward reduced (a step after fewer than
  k passes, gradients set by hand), then gives every trainable parameter
  of the optimizer without a gradient a zero one (the mean of the ranks'
  zeros), as Horovod sends missing gradients as zeros.
- step() synchronizes unless inside skip_synchronize(); zero_grad() between
  a reducing backward and step()/synchronize() raises AssertionError.
- op=Average or Sum; gradient_predivide_factor f: the gradients are
  divided by the process set's size before the sum, so f only changes
  where rounding happens in Horovod and is checked, not applied.
- compression=Compression.fp16 / .bf16: float32 gradients travel packed to
  16 bits and are summed in float32 (Horovod sums in float16).
- groups / num_groups: Horovod's grouping of allreduces; mpidp's buckets
  (25 MiB, 1 MiB first) group them instead, so they are checked only."""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
import weakref
import zlib
from typing import Optional

import torch

from ... import _C
from ..._runtime.model_consistency import check_same_structure
from ..._runtime.mpi import resolve_comm
from ..._runtime.hook_handles import remove_handles
from ..._engines.reducer import GradientReducer, build_reducer
from .. import _basics, _controller, _timeline
from .._basics import global_process_set
from .compression import Compression, NoneCompressor
from .mpi_ops import (Adasum, Average, Sum, handle_average_backwards_compatibility,
                      sparse_allreduce_async, synchronize as _synchronize)

__all__ = ["DistributedOptimizer"]

_MB = 1 << 20
_WIRE = {torch.float16: _C.DTYPE_F16, torch.bfloat16: _C.DTYPE_BF16}
_WIRE_DTYPE = {code: dtype for dtype, code in _WIRE.items()}
_live: "weakref.WeakSet" = weakref.WeakSet()   # rebuilt over a new world (elastic)


class _OptimizerReducer(GradientReducer):
    """The reducer with Horovod's pass accounting (its `owner`: the
    optimizer's _Sync, held weakly)."""

    owner = None

    def begin_backward(self, first: int) -> None:
        sync = self.owner() if self.owner is not None else None
        if sync is not None:
            sync.reducing_backward()
        super().begin_backward(first)

    def _finalize_backward(self) -> None:
        super()._finalize_backward()
        sync = self.owner() if self.owner is not None else None
        if sync is not None and sync.opened:
            _timeline.span("DistributedOptimizer", "ALLREDUCE_GRADIENTS", sync.opened,
                           time.perf_counter())


class _Sync:
    """The optimizer's link to the reducer: its passes and Horovod's flags."""

    def __init__(self, params, names, k: int, op: int, wire: int, process_set,
                 sparse_as_dense: bool = False):
        self.params, self.names, self.k, self.op, self.wire = params, names, k, op, wire
        self.process_set = process_set
        self.sparse_as_dense = sparse_as_dense
        # Sparse gradients (an Embedding(sparse=True)) as they arrived since the
        # last synchronize(): the reducer sums their dense form; these give the
        # result its sparse form back (see _sparse_results).
        self.sparse: dict = {}
        self.reducer: Optional[_OptimizerReducer] = None
        self.handles: list = []
        self.reduced = False        # a backward reduced since the last synchronize()
        self.passes = 0             # backward passes since the last synchronize()
        self.pass_open = False
        self.opened = 0.0
        self.should_synchronize = True
        self.synchronized = False

    def attach(self) -> None:
        """Build the reducer over the process set's communicator (again after
        an elastic reset: the pass a lost rank cut short is forgotten)."""
        self.detach()
        self.reduced, self.passes, self.pass_open, self.synchronized = False, 0, False, False
        mpi = _basics.comm_of(self.process_set)
        if mpi is None or mpi.Get_size() == 1 or not self.params:
            return     # not a member (local steps, as Horovod), or nothing to reduce
        # A communicator of its own: the buckets' allreduces can never be
        # matched with the named collectives' traffic.
        mpi = mpi.Dup()
        c = resolve_comm(mpi)
        holder = torch.nn.Module()
        for i, p in enumerate(self.params):
            holder.register_parameter(f"p{i}", p)
        check_same_structure(c, mpi, holder, "DistributedOptimizer",
                             settings={"backward_passes_per_step": self.k, "op": self.op,
                                       "compression": self.wire,
                                       "names (CRC-32)": zlib.crc32("\n".join(self.names).encode())})
        r = build_reducer(list(zip(self.names, self.params)), c, mpi, blocking=True,
                          wire=self.wire, wire_dtype=_WIRE_DTYPE.get(self.wire),
                          caps=(1 * _MB, 25 * _MB),
                          argname="named_parameters", name="DistributedOptimizer",
                          cls=_OptimizerReducer)
        r.owner = weakref.ref(self)
        r.set_divisor(c.size if self.op == Average else 1)
        r.paused = self.k > 1
        self.reducer = r
        self.handles += r.install_hooks(self.params)
        ref = weakref.ref(self)
        self.handles += [p.register_hook(lambda g, p=p, ref=ref: _note_sparse(ref, p, g))
                         for p in self.params]
        mpi.Free()     # the reducer runs on mpidp's own duplicate of it (c)
        if self.k > 1:
            # Horovod counts the backward passes per parameter; the paused
            # reducer runs no Python, so a light hook counts them.
            ref = weakref.ref(self)
            self.handles += [p.register_post_accumulate_grad_hook(
                lambda _p, ref=ref: _count(ref)) for p in self.params]

    def detach(self) -> None:
        remove_handles(self.handles)     # in place: the optimizer's finalizer holds the list
        self.reducer = None

    def reducing_backward(self) -> None:
        if self.reduced:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to "
                "step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self.reduced = True
        self.opened = time.perf_counter()

    def end_of_pass(self) -> None:
        self.pass_open = False
        self.passes += 1
        if self.passes == self.k - 1 and self.reducer is not None:
            self.reducer.paused = False    # the next backward reduces the sum

    def synchronize(self) -> None:
        r = self.reducer
        if r is not None:
            if not self.reduced:
                # Nothing reduced since the last step: what the .grad hold
                # (fewer than k passes, or gradients set by hand) is reduced now.
                r.paused = False
                r._finalize_backward()
            elif r.n_ready and not r.finalized:
                raise RuntimeError("DistributedOptimizer: the last backward pass did not finish "
                                   "(it raised); its gradients cannot be reduced")
            r.paused = self.k > 1
        self._sparse_results()
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        self.reduced = False
        self.passes = 0
        self.synchronized = True


    def _sparse_results(self) -> None:
        """Sparse gradients stay sparse, as Horovod's: sparse_as_dense=False
        reduces every rank's indices and values (their union, Average
        dividing by the size), sparse_as_dense=True takes the reducer's dense
        mean back to the sparse layout. In parameter order on every rank."""
        local, self.sparse = self.sparse, {}
        for name, p in zip(self.names, self.params):
            grad = local.get(p)
            if grad is None:
                continue
            with torch.no_grad():
                if self.sparse_as_dense:
                    p.grad = p.grad.to_sparse(grad.sparse_dim())
                else:
                    p.grad = _synchronize(sparse_allreduce_async(
                        grad, f"DistributedOptimizer.sparse.{name}", self.op, self.process_set))


def _note_sparse(ref, p, grad) -> None:
    sync = ref()
    if sync is not None and grad.is_sparse:
        before = sync.sparse.get(p)
        sync.sparse[p] = grad if before is None else before + grad


def _count(ref) -> None:
    sync = ref()
    if sync is not None and not sync.pass_open:
        sync.pass_open = True
        torch.autograd.Variable._execution_engine.queue_callback(sync.end_of_pass)


class _DistributedOptimizer:
    """The methods the dynamic subclass adds (Horovod's _DistributedOptimizer)."""

    def step(self, closure=None):
        sync: _Sync = self._hvd_sync
        if sync.should_synchronize:
            if sync.synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using optimizer.skip_synchronize() "
                              "context if you use optimizer.synchronize() in your code.")
            sync.synchronize()
        sync.synchronized = False
        return self._hvd_base_step(closure)

    def synchronize(self) -> None:
        """Wait for the gradients' reduction; `.grad` then holds the result
        (call before clipping or unscaling them)."""
        self._hvd_sync.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside does not synchronize (synchronize() was called)."""
        self._hvd_sync.should_synchronize = False
        try:
            yield
        finally:
            self._hvd_sync.should_synchronize = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_sync.reduced:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's setter: on every rank, between steps (the ranks compare
        it again)."""
        sync = self._hvd_sync
        sync.k = _check_passes(passes)
        sync.attach()

    def _hvd_base_step(self, closure=None):
        base = type(self).__mro__[1]
        step = getattr(base.step, "__wrapped__", base.step)   # torch's hooks run once, around ours
        return step(self, closure) if closure is not None else step(self)


def _check_passes(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"backward_passes_per_step: expected an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"backward_passes_per_step: expected an int >= 1, got {k}")
    return k


def _named(optimizer, named_parameters):
    """(names, params) of the optimizer's trainable parameters, checked as
    Horovod checks named_parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if named_parameters is None:
        return [f"allreduce.noname.{i}" for i in range(len(params))], params
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(dups))
    name_of = {id(p): n for n, p in named}
    unnamed = [i for i, p in enumerate(params) if id(p) not in name_of]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were "
                         f"not named (the optimizer's trainable parameters {unnamed[:8]}, in "
                         "param-group order)")
    return [name_of[id(p)] for p in params], params


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Horovod's DistributedOptimizer: `optimizer` whose gradients are
    reduced over the process set during backward (see the module's
    docstring for the semantics)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if hasattr(optimizer, "_hvd_sync"):
        raise ValueError("optimizer: is a DistributedOptimizer already; wrap the torch optimizer "
                         "once (a second wrapper would reduce every gradient twice)")
    op = handle_average_backwards_compatibility(op, None) if op != Adasum else op
    if op == Adasum:
        raise NotImplementedError(
            "op: hvd.Adasum is not implemented by mpidp; use op=hvd.Average (the default) and "
            "scale the learning rate by hvd.size(), as Horovod's examples do without Adasum")
    if op not in (Average, Sum):
        raise ValueError("op: DistributedOptimizer reduces gradients with hvd.Average or hvd.Sum")
    k = _check_passes(backward_passes_per_step)
    if isinstance(gradient_predivide_factor, bool) or \
            not isinstance(gradient_predivide_factor, (int, float)):
        raise TypeError("gradient_predivide_factor: expected a float")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning, stacklevel=2)
        groups = groups or num_groups
    if groups is not None and not (isinstance(groups, list) or
                                   (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")
    if not isinstance(sparse_as_dense, bool):
        raise TypeError("sparse_as_dense: expected a bool")
    if not (isinstance(compression, type) and issubclass(compression, (NoneCompressor,)) or
            getattr(compression, "wire_dtype", None) is not None):
        raise NotImplementedError(
            f"compression: {compression!r} -- DistributedOptimizer packs gradients in its "
            "buckets with Compression.none, .fp16 or .bf16; a custom Compressor works with "
            "hvd.allreduce")
    names, params = _named(optimizer, named_parameters)
    wire_dtype = getattr(compression, "wire_dtype", None)
    wire = _C.NO_WIRE
    if wire_dtype is not None and any(p.dtype == torch.float32 for p in params):
        wire = _WIRE[wire_dtype]
    base = type(optimizer)
    cls = type(base.__name__, (base,), {k_: v for k_, v in vars(_DistributedOptimizer).items()
                                        if k_ not in ("__dict__", "__weakref__")})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._patch_step_function()
    # Horovod's attribute: each trainable parameter's name (scripts read it).
    wrapped._parameter_names = dict(zip(params, names))
    wrapped._hvd_sync = _Sync(params, names, k, op, wire, process_set, sparse_as_dense)
    wrapped._hvd_sync.attach()
    # An optimizer the program dropped takes its hooks with it: otherwise the
    # parameters would go on reducing their gradients through it.
    weakref.finalize(wrapped, remove_handles, wrapped._hvd_sync.handles)
    _live.add(wrapped)
    return wrapped


def _reducing() -> bool:
    return any(opt._hvd_sync.reducer is not None for opt in list(_live))


def refuse_join() -> None:
    """hvd.join() on a rank whose DistributedOptimizer reduces gradients. An
    optimizer the program dropped may still sit in a reference cycle (the
    frames of an exception's traceback): it is collected before it counts."""
    if _reducing():
        gc.collect()
    if _reducing():
        raise NotImplementedError(
            "hvd.join(): this rank trains with a DistributedOptimizer, whose gradient buckets a "
            "joined rank cannot fill with zeros in mpidp; give every rank the same number of "
            "batches (DistributedSampler(..., drop_last=True)), or use mpidp.DataParallel's "
            "join() context")


def reattach_all() -> None:
    """Elastic reset: every live DistributedOptimizer reduces over the new world."""
    for opt in list(_live):
        opt._hvd_sync.attach()


def _detach_all() -> None:
    """hvd.shutdown(): the optimizers stop reducing (their steps are local)."""
    for opt in list(_live):
        opt._hvd_sync.detach()


_basics._world.on_shutdown.append(_detach_all)


_controller.join_refusals.append(refuse_join)
