"""DataParallel's gradient reducer: the order of a backward pass's calls.

`_C.Reducer` holds the buckets and the per-parameter loops over `.grad`; its
core (csrc/core/reducer.c, reducer_pass.c) decides everything (what each
`.grad` becomes, when a bucket is posted, what a deferred step needs). This
subclass says in which order those calls happen, per bucket, and copies
buckets between the device the gradients live on and the host buffers MPI
reads (staging, torch's API).

A pass:
  prepare()            before backward: None grads -> their zeroed bucket views;
  grad_arrived(i, p)   every parameter's hook (C, the hot path); the first of a
                       backward calls the reducer's on_backward_opened callback
                       (_backward_opened: begin_backward, which completes a pass
                       still open and queues _finalize_backward with autograd);
  _finalize_backward() end of backward: unhooked parameters are marked, every
                       bucket is posted; blocking mode then completes the pass;
  complete()           waits for every bucket; blocking: the mean is in `.grad`;
                       non-blocking, no step due: added where the user kept them;
  deliver_for_step(b) / after_step(b)   non-blocking, a step due: bucket b's
                       mean into `.grad` for the optimizer, then `.grad` back as
                       the user left it (the last bucket ends the pass).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import torch

from .. import _C
from .._runtime import config
from .._runtime import fault_tolerant_mode
from .device_reduction import DeviceReduction, device_comm_for
from .._runtime.dtypes import code_of
from .grad_hook_loader import cpp_hook_module
from .host_relay import HostRelay
from .._runtime.flat_buffers import grad_view
# Directions of a staging copy (host <-> where the .grad views live).
_TO_HOST, _TO_HOST_ASYNC, _TO_DEVICE = range(3)


def build_reducer(named, c_comm: _C.Comm, mpi_comm, *, blocking: bool, wire: int, wire_dtype,
                  caps: Tuple[int, int], hier_comms=None, argname: str,
                  name: str = "DataParallel", cls=None) -> "GradientReducer":
    """The reducer of the trainable (name, parameter) pairs `named` over
    `c_comm` (mpi_comm: its mpi4py communicator), on the path their device
    calls for: host buckets for CPU tensors; on a GPU, summed where they
    live where every rank has its own (the choice is collective), else
    staged through the host (non-blocking: relayed). Hooks not installed.
    cls: a subclass of GradientReducer to build (default GradientReducer)."""
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(f"{argname}: trainable parameters on several devices "
                         f"{sorted(map(str, devices))}; {name} needs one device per process")
    device = next(iter(devices), torch.device("cpu"))
    # MPIDP_DP_STAGING=1 forces the staged path for CPU tensors too (tests).
    staged = device.type != "cpu" or config.get("MPIDP_DP_STAGING")
    devcomm = device_comm_for(mpi_comm, c_comm, device, wire=wire != _C.NO_WIRE,
                              hierarchical=hier_comms is not None,
                              fault_tolerant=fault_tolerant_mode.enabled())
    params = tuple(p for _, p in named)
    dtypes = [code_of(p.dtype, f"{argname}: parameter {n!r}") for n, p in named]
    if wire != _C.NO_WIRE:
        for (pname, p), code in zip(named, dtypes):
            if code not in (code_of(torch.float32, ""), wire):
                raise ValueError(f"wire_dtype: parameter {pname!r} is {p.dtype}; gradients "
                                 f"can be compressed to {wire_dtype} from float32 only")
    # Non-blocking staged buckets without a device communicator keep their
    # passes on the device and only relay the sums through the host.
    relay = (devcomm is None and staged and not blocking and wire == _C.NO_WIRE
             and hier_comms is None and not fault_tolerant_mode.enabled())
    return (cls or GradientReducer).build(c_comm, params, dtypes, caps[0], caps[1],
                                          blocking=blocking, wire=wire, staged=staged, name=name,
                                          hier_comms=hier_comms, devcomm=devcomm, relay=relay)


class GradientReducer(_C.Reducer):
    """Create with `GradientReducer.build`; the C type's methods are the core's calls."""

    @classmethod
    def build(cls, comm: _C.Comm, params: Tuple[torch.Tensor, ...], dtypes: Sequence[int],
              first_cap: int, cap: int, blocking: bool, wire: int, staged: bool,
              name: str = "DataParallel", hier_comms=None, devcomm=None,
              relay: bool = False) -> "GradientReducer":
        """Plans the buckets (core), allocates them, and makes every parameter's
        gradient a view into its bucket. `staged`: the views live in device
        buckets (GPU gradients; forced on CPU by MPIDP_DP_STAGING), copied to
        pinned host buckets for MPI and back. `hier_comms`: None, or the
        hierarchical mode's node, cross-node and second node Comms. `devcomm`:
        a _C.DevComm that sums the device buckets where they live
        (device_reduction.py; the host buckets then carry only the flags).
        `relay` (non-blocking, no devcomm): the same, with the sums relayed
        through pinned host buffers (host_relay.py)."""
        device_mode = devcomm is not None or relay
        staged = staged or device_mode
        numel = [p.numel() for p in params]
        bucket_of, offset, infos = _C.plan_buckets(numel, list(dtypes), first_cap, cap)
        by_code = dict(zip(dtypes, (p.dtype for p in params)))
        device = params[0].device if params else torch.device("cpu")
        on_gpu = device.type == "cuda"
        host = tuple(torch.zeros(n + k, dtype=by_code[dt], pin_memory=on_gpu and not device_mode)
                     for n, k, dt in infos)
        dev = (tuple(torch.zeros(n + k, dtype=by_code[dt], device=device) for n, k, dt in infos)
               if staged else None)
        grads_in = dev if staged else host
        views = tuple(grad_view(grads_in[b], off, p) for p, b, off in zip(params, bucket_of, offset))
        self = cls(comm=comm, params=params, views=views, buckets=host, param_numel=tuple(numel),
                   param_dtype=tuple(dtypes), first_cap=first_cap, cap=cap, blocking=blocking,
                   name=name, wire_dtype=wire, staged=staged, hier_comms=hier_comms,
                   on_backward_opened=_backward_opened, device=device_mode,
                   on_bucket_full=_bucket_full)
        self.blocking = blocking
        self.param_bucket = bucket_of
        self.views = views
        self.backwards = 0     # backward passes that reached the hooks (steps compare it)
        # The tensors the .grad views are views of: their version counters
        # tell in-place changes (the user's zero_grad, clipping) apart.
        self._grad_buckets = grads_in
        if device_mode:
            members = [[] for _ in infos]
            for p, b, off in zip(params, bucket_of, offset):
                members[b].append((off, p.numel()))
            self._staging = (DeviceReduction(devcomm, dev, infos, members, separate=not blocking,
                                             name=name, rank=comm.rank) if devcomm is not None
                             else HostRelay(comm, dev, infos, members, name))
        else:
            self._staging = None if not staged else _Staging(host, dev, infos, on_gpu)
        # Summed on the device by a device communicator (not relayed through the host).
        self.device_resident = devcomm is not None
        self._device_mode = device_mode
        return self

    def install_hooks(self, params: Tuple[torch.Tensor, ...]) -> list:
        """Every parameter's gradient hook; returns handles with remove().

        Each runs once the parameter's gradient is accumulated into `.grad`,
        after any post-accumulate-grad hooks of the user's (a hook that edits
        the gradient is therefore included in the average): a post hook of the
        parameter's gradient accumulator node, as torch DDP's. In C++ where
        mpidp._grad_hook is available (no Python call per parameter); in
        Python otherwise, and always with host staging, which copies buckets
        from Python after each hook (in the core's device mode buckets are
        started by _bucket_full, called from C once per bucket)."""
        cpp = cpp_hook_module()
        if (self._staging is None or self._device_mode) and cpp is not None:
            return [cpp.install(self)]
        return [_AccumulatorHook(p, self._python_hook(i, p)) for i, p in enumerate(params)]

    def _python_hook(self, i: int, param: torch.Tensor):
        """Parameter i's accumulator post hook, called (grad_inputs, grad_outputs)."""
        if self._staging is None or self._device_mode:
            # Device mode: grad_arrived calls _bucket_full itself.
            # A C call per gradient, no Python frame.
            return functools.partial(self.grad_arrived, i, param)
        staging = self._staging

        def staged_hook(grad_inputs, grad_outputs, i=i, param=param, reducer=self):
            reducer.grad_arrived(i, param)
            staging.stage_full(reducer, flush=False)
        return staged_hook

    def broadcast_on_device(self, tensors) -> None:
        """Device-resident buckets: `tensors` (on the gradients' device) become
        rank 0's, summed where they live."""
        self._staging.broadcast_(tensors)

    # -- backward -------------------------------------------------------------

    def begin_backward(self, first: int) -> None:
        """Called (through _backward_opened) by grad_arrived for the first hook of a backward: finish a
        pass still open (non-blocking mode, or two backwards before one
        step), then ask autograd to call us when this backward ends."""
        if self.finalized:
            self._complete(accumulated=first)
        self.backwards += 1
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _finalize_backward(self) -> None:
        if self.blocking and self._staging is None:
            self.end_blocking_backward()  # the calls below and complete()'s, in one
            return
        self.mark_unhooked()
        if self._staging is not None:
            # Every bucket is full now: wait for the copies still on their way
            # to the host, so that every bucket is posted when backward returns.
            self._staging.stage_full(self, flush=True)
        # Non-blocking: every bucket is posted (and zeroed); any in-place change
        # from now on is the user's (zero_grad(set_to_none=False)) or a new backward.
        self.finalize(None if self.blocking else self._versions())
        if self.blocking:
            self.complete()

    def prepare(self) -> None:
        """Before backward: None grads point at their zeroed bucket views. A
        pass still open must be completed (blocking) or its step applied
        (non-blocking: DataParallel.forward decides which) first."""
        if self.finalized and self.blocking:
            self.complete()
        if self.n_ready == 0:
            super().prepare()

    # -- completing a pass ----------------------------------------------------

    def complete(self) -> None:
        """Finish the open pass (no step due); nothing when none is open."""
        self._complete(accumulated=-1)

    def _complete(self, accumulated: int) -> None:
        if self.n_ready == 0:
            return
        if not self.finalized:
            raise RuntimeError("DataParallel: the previous backward pass did not finish (it "
                               "raised, or its end was never reached); its gradients cannot be "
                               "completed")
        for b in range(self.n_buckets):
            self.wait_bucket(b)
            if self.blocking:
                if self.needs_unstaging(b):
                    self._stage(b, _TO_DEVICE)
                    self.unstaged(b)
                self.apply_missing_grads(b)
            else:
                now = self._grad_buckets[b]._version
                self._stage(b, _TO_HOST)  # what autograd added since
                self.apply_accumulate(b, now, accumulated)
                self._stage(b, _TO_DEVICE)
        self._reset()

    # -- non-blocking: a deferred step ------------------------------------------

    def deliver_for_step(self, b: int) -> None:
        if not self.delivered(b):
            self.wait_bucket(b)
            self.apply_deliver_for_step(b, self._grad_buckets[b]._version)
            self._stage(b, _TO_DEVICE)

    def after_step(self, b: int) -> None:
        if self.apply_after_step(b):
            self._reset()

    def deliver_now(self) -> None:
        """Between backward and step: the means into `.grad` now; the pass ends
        (the step that follows is an ordinary one)."""
        for b in range(self.n_buckets):
            self.wait_bucket(b)
            self.apply_deliver_now(b, self._grad_buckets[b]._version)
            self._stage(b, _TO_DEVICE)
        self._reset()

    def edited(self) -> bool:
        """True when gradients were changed in place since the end of backward."""
        return any(map(self.version_moved, range(self.n_buckets), self._versions()))

    # -- join ---------------------------------------------------------------------

    def shadow_pass(self) -> None:
        """Take part in one pass of bucket allreduces with zero contributions."""
        self.contribute_nothing()
        if self._staging is not None:
            # Staged buckets are posted only once copied from the device: zero
            # them there first (the core does not write staged gradients).
            for t in self._grad_buckets:
                t.zero_()
            self._staging.stage_full(self, flush=True)
        for b in range(self.n_buckets):
            self.wait_bucket(b)
        self._reset()

    # -- helpers ------------------------------------------------------------------

    def _versions(self) -> Tuple[int, ...]:
        return tuple(t._version for t in self._grad_buckets)

    def _stage(self, b: int, how: int) -> None:
        if self._staging is not None:
            self._staging.copy(self, b, how == _TO_DEVICE)

    def _reset(self) -> None:
        self.reset()
        if self._staging is not None:
            self._staging.new_pass()


def _bucket_full(reducer: GradientReducer) -> None:
    """The reducer's on_bucket_full callback (the core's device mode; called
    from C once per bucket a hook filled): the full buckets' sums start."""
    reducer._staging.stage_full(reducer, flush=False)


def _backward_opened(reducer: GradientReducer, first: int) -> None:
    """The reducer's on_backward_opened callback (a function, not a bound
    method: the reducer would hold itself)."""
    reducer.begin_backward(first)


class _AccumulatorHook:
    """A Python post hook on a parameter's gradient accumulator node, and the
    node itself: the parameter references its node only weakly, and a node
    that died would be rebuilt by the next forward without the hook."""

    __slots__ = ("node", "handle")

    def __init__(self, param: torch.Tensor, fn):
        with torch.enable_grad():
            self.node = param.view_as(param).grad_fn.next_functions[0][0]
        self.handle = self.node.register_hook(fn)

    def remove(self) -> None:
        if self.node is not None:
            self.handle.remove()
            self.node = None


class _Staging:
    """Copies of buckets between the device the gradients live on and the host
    buckets MPI reads. The core says which full bucket must go to the host
    (next_to_stage) and which mean must come back (needs_unstaging); this
    copies and reports (staged / unstaged). On a GPU the copies run
    asynchronously on torch's current stream: a copy to the host is followed
    by an event that says when its bytes are there; a copy back is ordered by
    the stream before everything that reads the gradients, and the host bucket
    is next written only after the next pass's copy to the host completed."""

    def __init__(self, host, dev, infos, on_gpu: bool):
        self._dev_buckets = dev
        # Only the gradient part is copied (the flags after it live on the host).
        self._host = tuple(h[:n] for h, (n, _, _) in zip(host, infos))
        self._dev = tuple(d[:n] for d, (n, _, _) in zip(dev, infos))
        self._on_gpu = on_gpu
        self._events: list = [None] * len(host)
        self._issued = [False] * len(host)

    def new_pass(self) -> None:
        self._issued = [False] * len(self._issued)

    def copy(self, r, b: int, to_device: bool) -> None:
        """GradientReducer's copies (r: the reducer, unused here): bucket b to
        the host, or its mean back to where the .grad views are."""
        self._copy(b, _TO_DEVICE if to_device else _TO_HOST)

    def _copy(self, b: int, how: int) -> None:
        # Only the backward hooks' copies to the host may run ahead (their
        # arrival is checked before the core reads them); every other caller
        # reads the host bucket right away.
        non_blocking = self._on_gpu and how != _TO_HOST
        if how == _TO_DEVICE:
            self._dev[b].copy_(self._host[b], non_blocking=non_blocking)
            return
        self._host[b].copy_(self._dev[b], non_blocking=non_blocking)
        if how == _TO_HOST_ASYNC and non_blocking:
            event = torch.cuda.Event()
            event.record()
            self._events[b] = event

    def stage_full(self, r: GradientReducer, flush: bool) -> None:
        """Copy every full bucket of `r` (its reducer; passed in, so that the
        two do not hold each other) to the host and tell the core which copies
        have arrived (it posts in bucket order); `flush` waits for every copy."""
        start = 0
        while (b := r.next_to_stage(start)) is not None:
            start = b + 1
            if not self._issued[b]:
                self._copy(b, _TO_HOST_ASYNC)
                self._issued[b] = True
                if not r.blocking:
                    # Non-blocking mode: the core zeroes the host bucket once it
                    # is copied for sending; the device bucket, where the .grad
                    # views are, must match (stream order puts this after the copy).
                    self._dev_buckets[b].zero_()
            event: Optional[torch.cuda.Event] = self._events[b]
            if event is not None:
                if flush:
                    event.synchronize()
                elif not event.query():
                    continue
                self._events[b] = None
            r.staged(b)
