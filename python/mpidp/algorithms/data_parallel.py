"""DataParallel: Heat-style data parallelism over MPI with a C gradient path."""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import List, Optional, Sequence, Union

import torch

from .._runtime import config
from .. import _C
from .._runtime import fault_tolerant_mode
from .._runtime.args import check_bool, check_real
from .._runtime.dtypes import code_of, wire_code
from .._runtime.model_consistency import check_every, check_in_sync
from .driver import Driver
from .._runtime.mpi import MPI, communicator
from .._runtime.hook_handles import remove_handles
from .._runtime.model_checks import check_module, name_list
from .._runtime.state_broadcast import broadcast_buffers, broadcast_state
from .._engines.load_watch import LoadWatch
from .._engines import module_hooks
from .._engines.deferred_step import DeferredStep, bucket_members
from .._engines.apply_on_read import QuietParameters, unwatch, watch
from .._engines.reducer import build_reducer
from .._engines.first_forward_watch import StaleReadDetector
from .optimizer import DataParallelOptimizer
from .driver import reduce_wrapper
from .._runtime.topology import nodes_are_even, useful_hierarchy

__all__ = ["DataParallel"]

_MB = 1 << 20

# Optimizers whose update of a parameter depends on that parameter's gradient
# and state only: non-blocking mode may apply their step bucket by bucket.
_ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.ASGD, torch.optim.Rprop)


def _nonblocking_obstacle(optimizers, module) -> str | None:
    """Why non-blocking updates cannot be used with these optimizers (Heat's
    rule: one optimizer holding exactly the model's parameters), or None."""
    if len(optimizers) != 1:
        return (f"non-blocking updates need exactly one DataParallelOptimizer, got "
                f"{len(optimizers)}")
    opt = optimizers[0].torch_optimizer
    if type(opt) not in _ELEMENTWISE_OPTIMIZERS:
        return (f"{type(opt).__name__} is not known to update each parameter independently, "
                "so its step cannot be applied bucket by bucket")
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    if held != trainable:
        return "the optimizer does not hold exactly the model's trainable parameters"
    if any(type(m).__name__ == "OptimizedModule" for m in module.modules()):
        # Compiled graphs save parameters for backward; updating them in place
        # during the next forward breaks autograd's version check.
        return "a torch.compile'd module cannot take its update layer by layer during forward"
    return None


def _apply_pending(wrapper_ref, buckets, module, _args) -> None:
    """A layer's forward pre-hook (non-blocking mode): inside the wrapper's
    forward, applies the pending update of the layer's buckets; when the inner
    module is run directly (evaluating `model` instead of `net`), applies the
    whole pending update first, so it never computes with stale parameters.
    The layer's own parameters are then current: its reads need no check.
    Holds its DataParallel weakly, so the inner module does not keep it alive."""
    wrapper = wrapper_ref()
    if wrapper is None:
        return
    if wrapper._deferred.applying:
        wrapper._deferred.apply(buckets)
    elif wrapper._deferred.due:
        wrapper.synchronize()
    params = module.__dict__.get("_parameters")
    if isinstance(params, QuietParameters):
        params.__class__ = QuietParameters


def _read_pending(wrapper_ref, params, value) -> None:
    """A read of a module's parameter `value` (None: of all of them) while an
    update is due (_engines/apply_on_read.py): inside the wrapper's forward the
    parameter's bucket is applied now (weight tying through another module's
    attribute); anywhere else the whole update is."""
    wrapper = wrapper_ref()
    if wrapper is None or not wrapper._deferred.due:
        params.__class__ = QuietParameters
    elif wrapper._deferred.stepping:
        return   # DataParallel's own delivery and step
    elif wrapper._deferred.applying:
        bucket_of = wrapper._bucket_of_param
        wanted = dict.values(params) if value is None else (value,)
        wrapper._deferred.apply(sorted({bucket_of[id(p)] for p in wanted if id(p) in bucket_of}))
    else:
        wrapper.synchronize()


def _check_direct_step(wrapper_ref, _optimizer, _args, _kwargs) -> None:
    """A step pre-hook of the wrapped torch optimizers (non-blocking mode):
    stepping the torch optimizer itself between backward and the deferred
    update (scaler.step(opt.torch_optimizer)) would step on the zeros that
    `.grad` holds until the averaged gradients arrive."""
    wrapper = wrapper_ref()
    if (wrapper is None or wrapper._deferred.stepping or wrapper._released is not None
            or wrapper._deferred.due or not wrapper._reducer.finalized):
        return
    raise RuntimeError(
        "DataParallel (non-blocking): the torch optimizer was stepped directly between backward() "
        "and the deferred update (e.g. scaler.step(opt.torch_optimizer)), but its gradients are "
        "zeros until the averaged ones arrive. Step the DataParallelOptimizer instead "
        "(scaler.step(dp_opt)), or call dp_opt.synchronize() first")


def _agreement_comm_of(wrapper_ref):
    """The wrapper's Driver._agreement_comm (held weakly by its DeferredStep,
    which the wrapper holds)."""
    wrapper = wrapper_ref()
    return None if wrapper is None else wrapper._agreement_comm()


def _before_optimizer_step(wrapper_ref, optimizer) -> None:
    """Before any step of an optimizer that updates wrapped parameters
    (LoadWatch.on_step): one stepped directly (DDP's pattern) must update
    nothing that DataParallel does not average. DataParallelOptimizer's own
    steps are checked in optimizer_step."""
    wrapper = wrapper_ref()
    if wrapper is None or wrapper._released is not None:
        return
    # Fault-tolerant mode: the step is applied only if every rank lived through
    # it. One agreement per backward: it vouches for every gradient averaged
    # in it, so the other optimizers of the same step need none.
    if wrapper.blocking_parameter_updates and fault_tolerant_mode.enabled():
        backwards = wrapper._reducer.backwards
        if backwards != wrapper._backwards_agreed:
            fault_tolerant_mode.step_boundary(wrapper._agreement_comm())
            wrapper._backwards_agreed = backwards
    if not wrapper._deferred.stepping:
        wrapper._refuse_outside_tensors(optimizer)


def _check_optimizers(optimizer) -> List[DataParallelOptimizer]:
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in items:
        if type(opt).__name__ == "DASO":
            raise TypeError("optimizer: DASO works with mpidp.DataParallelMultiGPU, not "
                            "DataParallel")
        if isinstance(opt, torch.optim.Optimizer):
            raise TypeError("optimizer: expected mpidp.DataParallelOptimizer, got the torch "
                            f"optimizer {type(opt).__name__}; wrap it: "
                            "mpidp.DataParallelOptimizer(torch_optimizer)")
        if not isinstance(opt, DataParallelOptimizer):
            raise TypeError("optimizer: expected a mpidp.DataParallelOptimizer (or a list of "
                            f"them), got {type(opt).__name__}")
    return items


def _hierarchy(mpi_comm):
    """The hierarchical reducer's communicators -- the node's (for the
    reduce-scatter), the ranks with this local rank on every node, and the
    node's again (a second duplicate, for the allgather) -- or None, with a
    warning, where a hierarchy cannot help (one rank per node, one node)."""
    comms = useful_hierarchy(mpi_comm, "DataParallel", "reducing gradients flat", stacklevel=3)
    if comms is None:
        return None
    node, across = comms
    return (communicator(node).c, communicator(across).c, _C.Comm(node))


class DataParallel(torch.nn.Module, Driver):
    """Data-parallel training of `module` over the ranks of `comm`.

    Every rank holds a full replica; each computes gradients on its own data,
    and backward averages them over all ranks through MPI, bucket by bucket
    while backward is still running. Parameters and buffers start as rank 0's.

    Parameters
    ----------
    module : torch.nn.Module
        The local model.
    comm : mpi4py communicator, optional
        The ranks to train over (default MPI.COMM_WORLD). Heat's communicator
        wrapper is accepted too (its `.handle` is used).
    optimizer : DataParallelOptimizer or a list of them, optional
        Heat's API: the optimizer(s) whose `step()` follows DataParallel's mode.
        With None, gradients are averaged and any optimizer can be stepped.
    blocking_parameter_updates : bool or None
        None (default): non-blocking when `optimizer` is one
        DataParallelOptimizer that allows it (Heat's behaviour), else blocking
        (a DDP-style `DataParallel(model)`), without a warning.
        True: gradients are averaged before `backward()` returns and
        `optimizer.step()` updates at once. False: backward
        only starts the averaging, `optimizer.step()` only marks the update as
        due, and the next forward applies it bucket by bucket, each just before
        the first layer that needs it, so communication overlaps everything in
        between. `.grad` then holds zeros until that forward; code that reads
        or edits gradients before `step()` (clipping, AMP's ``unscale_``) calls
        `optimizer.synchronize()` right after backward first (GradScaler
        through the DataParallelOptimizer does it by itself), which makes that
        step an ordinary, blocking one; an edit without it raises at `step()`.
        The inner model's `state_dict()` and forward apply a pending update
        before reading the parameters. False falls back to blocking with a
        warning for no or more than one optimizer, an optimizer not holding
        exactly the model's parameters, or one not known to be elementwise.
    wire_dtype : torch.bfloat16, torch.float16, torch.uint8 or None, keyword-only
        Send float32 gradient buckets compressed to this dtype: 16 bits halve
        the bytes on the wire (the sum is done in fp32 per element and
        rounded once per hop); torch.uint8 quantizes them to 8 bits in blocks
        of 256 (about a quarter of the bytes; see mpidp.allreduce), the
        "which parameters had a gradient" flags staying exact. None sends
        gradients in their own dtype.
    hierarchical : bool, keyword-only
        Reduce each gradient bucket within the node first (reduce-scatter),
        then each rank's slice across the nodes with the ranks of its local
        rank, then gather within the node: every rank of a node carries 1/L
        of the bytes between nodes. With torch.uint8 on the wire only the
        cross-node phase is quantized (Bagua's ByteGrad). Warns and stays
        flat with one rank per node or a single node.
    bucket_cap_mb, first_bucket_cap_mb : float, keyword-only
        Size caps of the gradient buckets (one allreduce each). The first
        bucket is small so communication starts early in backward.
    broadcast_buffers : bool, keyword-only
        As in torch DDP: every training forward (outside `no_sync()` and
        `join()`) first makes the module's buffers (BatchNorm running
        statistics) rank 0's, in one broadcast, so they cannot drift apart.
        False keeps each rank's own.
    """

    def __init__(self, module: torch.nn.Module, comm=MPI.COMM_WORLD,
                 optimizer: Union[DataParallelOptimizer, Sequence[DataParallelOptimizer], None] = None,
                 blocking_parameter_updates: Optional[bool] = None, *, wire_dtype=None,
                 bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0,
                 broadcast_buffers: bool = True, hierarchical: bool = False):
        check_module(module)
        optimizers = _check_optimizers(optimizer)
        if blocking_parameter_updates is not None and not isinstance(blocking_parameter_updates, bool):
            raise TypeError("blocking_parameter_updates: expected a bool or None, got "
                            f"{type(blocking_parameter_updates).__name__}")
        for name, value in (("bucket_cap_mb", bucket_cap_mb),
                            ("first_bucket_cap_mb", first_bucket_cap_mb)):
            check_real(name, value, 0.0, low_open=True)      # MiB
        check_bool("broadcast_buffers", broadcast_buffers)
        check_bool("hierarchical", hierarchical)
        wire = wire_code(wire_dtype, quantized=True)
        if wire == code_of(torch.float32, "wire_dtype"):
            wire = _C.NO_WIRE  # float32 on the wire: no compression
        if isinstance(module, DataParallel):
            raise TypeError("module: is already a mpidp.DataParallel; wrap the plain model once "
                            "(a second wrapper would average every gradient again)")
        communicator(comm)          # checked before anything else
        super().__init__()
        self.module = module
        self.comm = comm
        if not blocking_parameter_updates:
            obstacle = _nonblocking_obstacle(optimizers, module)
            if obstacle and blocking_parameter_updates is False:  # asked for explicitly
                warnings.warn(f"DataParallel: {obstacle}; falling back to blocking parameter "
                              "updates", stacklevel=2)
            blocking_parameter_updates = bool(obstacle)
        self.blocking_parameter_updates = blocking_parameter_updates
        self.wire_dtype = wire_dtype
        self._wire = wire
        # Held weakly: each optimizer holds its wrapper (opt.data_parallel), and the
        # reverse reference would make a cycle that keeps a dropped wrapper
        # and its buckets alive until the garbage collector runs.
        self._optimizer_refs = [weakref.ref(opt) for opt in optimizers]
        for opt in optimizers:
            opt.blocking_parameter_updates = blocking_parameter_updates
            opt.data_parallel = self
        self._average = True     # gradients averaged; Bagua's average=False sums them
        self.broadcast_buffers = broadcast_buffers
        self._caps = (int(first_bucket_cap_mb * _MB), int(bucket_cap_mb * _MB))
        self._setup_settings = {
            "blocking_parameter_updates": blocking_parameter_updates, "wire_dtype": wire_dtype,
            "bucket_cap_mb": float(bucket_cap_mb), "first_bucket_cap_mb": float(first_bucket_cap_mb),
            "broadcast_buffers": broadcast_buffers, "hierarchical": hierarchical,
            "MPIDP_CHECK every": check_every(),
            "MPIDP_DP_DEVICE_COMM": config.get("MPIDP_DP_DEVICE_COMM")}
        self._attach(comm)

    def _attach(self, comm) -> None:
        """Everything that depends on the communicator: the set-up (settings
        compared, rank 0's state broadcast), the gradient buckets and every
        hook. Run again on the survivors after a rank was lost (_continue_on)."""
        module = self.module
        optimizers = self._dp_optimizers
        handle = self._set_up(module, comm, settings=self._setup_settings,
                              rebuild="Build mpidp.DataParallel(model, ...) again after such a "
                                      "change (the new wrapper takes over the model and its "
                                      "optimizers)")
        c_comm = self._c_comm = handle.c
        self._mpi_comm = handle.mpi
        self._hier_comms = _hierarchy(self._mpi_comm) if self._setup_settings["hierarchical"] else None
        self.hierarchical = self._hier_comms is not None
        self._check_every = check_every()
        self._forwards = 0
        self._build_reducer(*self._caps)
        self._backwards_agreed = None    # fault-tolerant mode: the backward whose step was agreed
        # Loads on one rank only and optimizer settings that differ are found
        # at the next training forwards (_engines/load_watch.py), also for plain torch
        # optimizers stepped directly (DDP's pattern).
        self._loads = LoadWatch(c_comm, "DataParallel", self._params)
        self._loads.on_step = functools.partial(_before_optimizer_step, weakref.ref(self))
        self._hook_handles += self._loads.install(list(module.modules()),
                                                  [opt.torch_optimizer for opt in optimizers])
        self._joining = False    # inside join(): every training forward takes part in a ballot
        self._join_steps = 0     # training steps this rank took inside join()
        # optimizer -> (its groups' layout, the tensors it holds that no bucket holds)
        self._outside_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        # Non-blocking: the modules whose _parameters are watched, and those dicts
        # (_engines/apply_on_read.py).
        self._watched_modules, self._watched_params = [], []
        # The optimizer step (non-blocking: deferred to the next forward) has one owner.
        self._deferred = DeferredStep(self._reducer, self._params,
                                      bucket_members(self._param_bucket, self._reducer.n_buckets),
                                      self._watched_params,
                                      device_resident=self._reducer.device_resident,
                                      agreement_comm=functools.partial(
                                          _agreement_comm_of, weakref.ref(self)))
        if not self.blocking_parameter_updates:
            self._install_layer_hooks()
            self._watch_reads()
            self._hook_handles += [
                opt.torch_optimizer.register_step_pre_hook(
                    functools.partial(_check_direct_step, weakref.ref(self)))
                for opt in optimizers]

    # -- construction -------------------------------------------------------

    def _build_reducer(self, first_cap: int, cap: int) -> None:
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self._param_names = [n for n, _ in named]
        self._params = tuple(p for _, p in named)
        self._reducer = build_reducer(
            named, self._c_comm, self._mpi_comm, blocking=self.blocking_parameter_updates,
            wire=self._wire, wire_dtype=self.wire_dtype, caps=(first_cap, cap),
            hier_comms=self._hier_comms, argname="module")
        self._param_bucket = self._reducer.param_bucket
        self._hook_handles = self._reducer.install_hooks(self._params)
        # A wrapper the program dropped takes its hooks with it: otherwise the
        # parameters would go on averaging their gradients through it.
        weakref.finalize(self, remove_handles, self._hook_handles)

    def _install_layer_hooks(self) -> None:
        """Forward pre-hooks on every module that owns trainable parameters: each
        applies the pending update of the buckets holding that module's
        parameters before it runs. Device-resident buckets are applied whole
        at the start of the forward (_engines/deferred_step.py), so only the inner
        model gets one: run directly, it applies a pending update first (the
        modules inside it read their parameters through the watched dicts,
        _engines/apply_on_read.py, when run directly themselves)."""
        index = {id(p): i for i, p in enumerate(self._params)}
        if self._reducer.device_resident:
            self._hook_handles.append(module_hooks.register(
                self.module, "register_forward_pre_hook",
                functools.partial(_apply_pending, weakref.ref(self), tuple(range(self._reducer.n_buckets)))))
            return
        for module in self.module.modules():
            own = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if not own:
                continue
            buckets = tuple(sorted({self._param_bucket[i] for i in own}))
            self._hook_handles.append(module_hooks.register(
                module, "register_forward_pre_hook",
                functools.partial(_apply_pending, weakref.ref(self), buckets)))

    def _watch_reads(self) -> None:
        """Reads of the parameters through the modules' API while an update is
        due apply it first (_engines/apply_on_read.py)."""
        self._bucket_of_param = {id(p): b for p, b in zip(self._params, self._param_bucket)}
        reader = functools.partial(_read_pending, weakref.ref(self))
        self._watched_modules = [m for m in self.module.modules()
                                 if any(id(p) in self._bucket_of_param
                                        for p in m.__dict__["_parameters"].values())]
        self._watched_params[:] = [watch(m, reader) for m in self._watched_modules]

    # -- training -------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        self._check_attached()
        training = self.training and torch.is_grad_enabled()
        if training:
            self._trainable_at_setup.check()
            self._vote_if_joining()
            self._share_buffers_and_check_loads()
        if self.training:
            self._check_replicas_every_n_forwards()
        self._finish_previous_pass()
        out = self._run_module(inputs, kwargs)
        if training:
            self._prepare_backward()
        return out

    # The steps of a forward, in order:

    def _vote_if_joining(self) -> None:
        """Inside join(), ranks that ran out of data answer this ballot with 0
        and add zeros to this step's gradients, averaged over the rest."""
        if self._joining:
            active = self._ballot(True)
            self._reducer.set_divisor(active if self._average else 1)
            self._join_steps += 1

    def _share_buffers_and_check_loads(self) -> None:
        """Rank 0's buffers (broadcast_buffers), and a checkpoint loaded on one
        rank only or optimizer settings that differ are found (_engines/load_watch.py)."""
        if self._joining or self._reducer.paused:
            return
        if self.broadcast_buffers:
            if self._reducer.device_resident and self._c_comm.size > 1:
                # Where the gradients are summed on the device, so are the
                # buffers: the host path's copy to the host would wait for
                # the GPU at every forward.
                self._reducer.broadcast_on_device([b.data for b in self.module.buffers()])
            else:
                broadcast_buffers(self.module, self._c_comm)
        self._loads.check(self._shared_state, "mpidp.broadcast_parameters(model) and "
                          "mpidp.broadcast_optimizer_state(optimizer)")

    def _check_replicas_every_n_forwards(self) -> None:
        """MPIDP_CHECK: every n-th training forward the ranks compare their
        parameters."""
        if not self._check_every:
            return
        if self._forwards % self._check_every == 0:
            check_in_sync(self._c_comm, list(self.module.named_parameters()), "DataParallel",
                          f"before training step {self._forwards}")
        self._forwards += 1

    def _finish_previous_pass(self) -> None:
        """Non-blocking: a finished backward either has its step due (applied
        during this forward) or, with no step, adds its mean to the
        accumulated gradients now."""
        if not self.blocking_parameter_updates and self._reducer.finalized \
                and not self._deferred.begin():
            self._reducer.complete()

    def _run_module(self, inputs, kwargs):
        """The module's forward; a due step is applied layer by layer as it
        runs (the layers' pre-hooks), and whatever it did not reach (dynamic
        graphs, an exception) right after, so it is never left half applied."""
        deferred = self._deferred
        if not deferred.applying:
            return self.module(*inputs, **kwargs)
        try:
            if deferred.apply_all_first:
                deferred.apply_all()
            if not deferred.reads_checked:
                return self._forward_watching_reads(inputs, kwargs)
            return self.module(*inputs, **kwargs)
        finally:
            deferred.apply_all()

    def _prepare_backward(self) -> None:
        try:
            self._reducer.prepare()
        except RuntimeError as e:
            self._refuse_converted_params(e)
            raise

    def _refuse_converted_params(self, error: RuntimeError) -> None:
        """prepare() failed: say so plainly where it is because the model was
        converted after wrapping (model.double(), model.to(device)), which
        leaves the gradient buckets in the old dtype or device."""
        views = self._reducer.views
        moved = [(n, p, v) for n, p, v in zip(self._param_names, self._params, views)
                 if p.dtype != v.dtype or p.device != v.device]
        if moved:
            n, p, v = moved[0]
            more = f" (and {len(moved) - 1} more)" if len(moved) > 1 else ""
            raise RuntimeError(
                f"DataParallel: parameter {n!r}{more} is now {p.dtype} on {p.device}, but "
                f"DataParallel was set up with {v.dtype} on {v.device}: convert the model "
                "(model.double(), model.to(device)) before wrapping it, or wrap it again after"
            ) from error

    def _shared_state(self) -> list:
        """What every rank must hold alike besides the optimizers' states (the
        LoadWatch's): parameters and buffers (when broadcast)."""
        tensors = list(self.module.parameters())
        if self.broadcast_buffers:
            tensors += list(self.module.buffers())
        return tensors

    @property
    def _dp_optimizers(self) -> List[DataParallelOptimizer]:
        return [opt for opt in (ref() for ref in self._optimizer_refs) if opt is not None]

    def _forward_watching_reads(self, inputs, kwargs):
        """The first forward that applies an update: see _engines/first_forward_watch.py."""
        deferred = self._deferred
        deferred.reads_checked = True
        params = self._params
        detector = StaleReadDetector(deferred, {id(p): b for p, b in zip(params, self._param_bucket)},
                                     {id(p): n for p, n in zip(params, self._param_names)})
        with detector:
            out = self.module(*inputs, **kwargs)
        if detector.found is not None:
            deferred.apply_all_first = True
            warnings.warn(f"DataParallel (non-blocking): parameter {detector.found!r} is read "
                          "before its own layer runs (weight tying through a functional call, or "
                          "a module using another's parameter), so applying the update layer by "
                          "layer would hand it out one step stale; the whole pending update is "
                          "applied at the start of each forward instead", stacklevel=4)
        return out

    def synchronize(self) -> None:
        """Finish all pending communication and apply a pending update."""
        if self.blocking_parameter_updates or not self._reducer.finalized \
                or not self._deferred.begin():
            self._reducer.complete()
        else:
            self._deferred.apply_all()

    @contextlib.contextmanager
    def no_sync(self):
        """torch DDP's gradient accumulation without communication::

            with net.no_sync():
                for x, y in micro_batches[:-1]:
                    loss_fn(net(x), y).backward()   # no communication
            loss_fn(net(x_last), y_last).backward()  # reduces the accumulated sum
            optimizer.step()

        Backward passes inside leave this rank's gradients in `.grad`, added
        up; the first backward after the context averages the whole sum over
        the ranks. A step before that backward raises (the gradients would be
        this rank's alone). Buffers are not broadcast inside, as in DDP."""
        self._check_attached()
        reducer = self._reducer
        if reducer.paused:
            raise RuntimeError("DataParallel.no_sync() is already active")
        if self._joining:
            raise RuntimeError("DataParallel.no_sync() inside join() is not supported: join's "
                               "ballot expects one averaged backward per forward")
        self.synchronize()  # a pass still open, or an update due, is finished first
        reducer.paused = True
        try:
            yield
        finally:
            reducer.paused = False

    # -- uneven inputs ------------------------------------------------------------

    @contextlib.contextmanager
    def join(self, adopt_optimizer_state: bool = False):
        """Let ranks with fewer batches finish training early::

            with net.join():
                for x, y in loader:      # loaders of different lengths
                    ...

        Inside, every training forward counts the ranks still training (one
        tiny allreduce), and gradients are averaged over those only. A rank
        whose loop has ended keeps answering the others' collectives with
        zeros until everyone is done; then every rank takes the parameters and
        buffers of the rank that trained longest. Optimizer states stay each
        rank's own (reflecting its own steps) unless `adopt_optimizer_state`:
        then every rank also takes that rank's optimizer states -- what one
        process would hold, and what training that continues after join()
        needs (momentum would otherwise move the ranks apart). Each training
        forward must be followed by one backward, and the loop may run no
        other collectives. Without join(), uneven batches end, after
        MPIDP_TIMEOUT, with an error saying so."""
        if self._joining:
            raise RuntimeError("DataParallel.join() is already active")
        check_bool("adopt_optimizer_state", adopt_optimizer_state)
        self._joining, self._join_steps = True, 0
        try:
            yield self
        except BaseException:
            self._joining = False  # a failing rank ends the job; no shadowing
            raise
        try:
            self.synchronize()
            while True:
                active = self._ballot(False)
                if active == 0:
                    break
                self._reducer.set_divisor(active if self._average else 1)
                self._reducer.shadow_pass()
            self._reducer.set_divisor(self._c_comm.size if self._average else 1)
            steps = torch.zeros(self._c_comm.size, dtype=torch.float64)
            steps[self._c_comm.rank] = self._join_steps
            self._c_comm.allreduce(steps, _C.OP_SUM, _C.NO_WIRE, False)
            root = int(torch.argmax(steps))
            self.join_root = root       # whose state every rank took (wrappers adopt from it)
            broadcast_state(self.module, self._c_comm, root=root)
            if adopt_optimizer_state:
                for opt in self._dp_optimizers:
                    mine = opt.torch_optimizer.state_dict() if self._c_comm.rank == root else None
                    opt.torch_optimizer.load_state_dict(self._mpi_comm.bcast(mine, root=root))
        finally:
            self._joining = False

    def _ballot(self, active: bool) -> int:
        vote = torch.tensor([1.0 if active else 0.0], dtype=torch.float64)
        self._c_comm.allreduce(vote, _C.OP_SUM, _C.NO_WIRE, False)
        return int(vote.item())

    def train(self, mode: bool = True):
        if not mode:
            self.synchronize()  # eval() sees the parameters of every step taken
        return super().train(mode)

    def state_dict(self, *args, **kwargs):
        self.synchronize()
        return super().state_dict(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        return reduce_wrapper(self, self.module)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's, without applying a pending update (non-blocking mode):
        clearing gradients reads no parameter values, and the update keeps
        its overlap with whatever runs before the next forward."""
        with self._deferred.reads_unwatched():
            super().zero_grad(set_to_none)

    # -- the optimizer's side (DataParallelOptimizer calls these) ---------------

    @property
    def update_pending(self) -> bool:
        """Non-blocking: a step() was called and its update is applied during
        the next forward (or by synchronize())."""
        return self._deferred.due

    def synchronize_gradients(self) -> None:
        """Non-blocking mode, between backward and step: wait for the averaging
        and put the means in `.grad`; the step that follows is an ordinary one."""
        if not self.blocking_parameter_updates and not self._deferred.due \
                and self._reducer.finalized:
            self._reducer.deliver_now()

    def optimizer_step(self, optimizer: DataParallelOptimizer) -> None:
        """`optimizer`'s step(): now (blocking), or deferred to the next
        forward (non-blocking), after the checks that keep the ranks equal."""
        if self._released is not None:
            raise RuntimeError(f"DataParallel: the optimizer's wrapper is detached: "
                               f"{self._released}")
        if self._reducer.held:
            raise RuntimeError(
                "DataParallel: optimizer.step() after a backward inside no_sync(), before any "
                "backward outside it: those gradients are this rank's alone, so the ranks would "
                "drift apart. Run the accumulation's last backward outside no_sync() (torch DDP's "
                "pattern); it averages everything accumulated")
        backwards = self._reducer.backwards
        if backwards == self._deferred.backwards_at_step:
            self._refuse_unaveraged_grads()
        self._deferred.backwards_at_step = backwards
        if self.blocking_parameter_updates or not self._reducer.finalized:
            self._refuse_outside_tensors(optimizer.torch_optimizer)
            with self._deferred.own_step():
                optimizer.torch_optimizer.step()
            return
        if self._reducer.edited():
            raise RuntimeError(
                "DataParallel (non-blocking): gradients were changed in place between backward() "
                "and optimizer.step() (clip_grad_norm_, GradScaler.unscale_, p.grad.mul_, ...), "
                "but in non-blocking mode .grad holds zeros until the averaged gradients arrive, "
                "so the change would be lost. Call optimizer.synchronize() right after backward() "
                "to have the averaged gradients in .grad, then edit them and step; or use "
                "blocking_parameter_updates=True")
        if self._deferred.due:
            raise RuntimeError("DataParallel (non-blocking): optimizer.step() was called twice "
                               "without a forward pass in between")
        self._refuse_outside_tensors(optimizer.torch_optimizer)
        self._deferred.schedule(optimizer)
        # LR schedulers check this flag (set by the real step) to warn about a
        # scheduler stepped before its optimizer; the step is merely deferred.
        optimizer.torch_optimizer._opt_called = True

    def _refuse_outside_tensors(self, opt: torch.optim.Optimizer) -> None:
        """A tensor that `opt` updates but no bucket holds (a learnable
        tensor outside the model, a group added after set-up) is never
        averaged: in blocking mode each rank would step it on its own
        gradient and the ranks drift apart; in non-blocking mode, whose step
        is applied bucket by bucket, it would never be updated at all. The
        tensors are found again only when the optimizer's groups change."""
        groups = opt.param_groups
        sig = tuple(id(g["params"]) for g in groups) + tuple(len(g["params"]) for g in groups)
        known = self._outside_of.get(opt)
        if known is None or known[0] != sig:
            planned = {id(p) for p in self._params}
            known = (sig, [(j, i, p) for j, g in enumerate(groups)
                           for i, p in enumerate(g["params"]) if id(p) not in planned])
            self._outside_of[opt] = known
        outside = known[1]
        if not outside:
            return
        nonblocking = not self.blocking_parameter_updates
        stepped = outside if nonblocking else [t for t in outside if t[2].grad is not None]
        if not stepped:
            return
        where = ", ".join(f"param group {j} [{i}] (shape {list(p.shape)})" for j, i, p in stepped[:3])
        more = f" and {len(stepped) - 3} more" if len(stepped) > 3 else ""
        if nonblocking:
            raise RuntimeError(
                f"DataParallel (non-blocking): the optimizer holds tensor(s) that are not "
                f"parameters DataParallel averages ({where}{more}): the update is applied bucket "
                "by bucket, so they would never be updated. Use blocking_parameter_updates=True, "
                "or step them with another optimizer")
        raise RuntimeError(
            f"DataParallel: the optimizer steps tensor(s) with gradients that are not parameters "
            f"of the wrapped model ({where}{more}), so their gradients are this rank's alone and "
            "the ranks would drift apart. Make them parameters of the model before wrapping it "
            "(then they are averaged), or average their gradients yourself "
            "(mpidp.allreduce(t.grad, op='avg')) and step them with an optimizer of their own")

    def _refuse_unaveraged_grads(self) -> None:
        """A step with no backward through the hooks since the last one: a
        .grad that is not its bucket view came from elsewhere
        (torch.autograd.grad, assigned by hand) and was never averaged."""
        names = [n for n, p, v in zip(self._param_names, self._params, self._reducer.views)
                 if p.grad is not None and p.grad is not v]
        if names:
            raise RuntimeError(
                f"DataParallel: optimizer.step() with gradients of {name_list(names)} that no "
                "backward() through DataParallel produced since the last step "
                "(torch.autograd.grad, or assigned by hand), so they were never averaged and each "
                "rank would step on its own. Compute them with loss.backward(); code that "
                "averages its own gradients (mpidp.allreduce(grad, op='avg')) steps the torch "
                "optimizer itself, in blocking mode")

    def set_average(self, average: bool) -> None:
        """Average the gradients (the default) or sum them (Bagua's
        average=False), from the next backward on."""
        check_bool("average", average)
        self._average = average
        self._reducer.set_divisor(self._c_comm.size if average else 1)

    def remove_hooks(self) -> None:
        """Detach DataParallel from the module's parameters (the module keeps working
        as a plain, local torch module; this wrapper cannot be used again)."""
        self.detach("remove_hooks() detached it from its module")

    # -- the driver interface (mpidp/algorithms/driver.py) ---------------------

    what = "DataParallel"

    def drain(self) -> None:
        self.synchronize()

    def _remove_hooks(self) -> None:
        remove_handles(self._hook_handles)
        for m, params in zip(self._watched_modules, self._watched_params):
            unwatch(m, params)

    def _takes_replacements(self) -> bool:
        return True       # _continue_on is its set-up again, a replacement's included

    def _continue_on(self, comm) -> None:
        """Fault-tolerant mode, after a rank was lost (mpidp.recover()): the
        step in flight was discarded on every survivor, so the replicas are
        equal; the buckets and hooks are built again over the survivors'
        communicator. The discarded step's gradients are dropped (they hold
        the dead rank's share or nothing), and so is a non-blocking step that
        was due (its agreement failed)."""
        self._remove_hooks()
        for p in self._params:
            p.grad = None
        # Growing back restores the launch's size, and a replacement's set-up
        # (which this must match call for call) asks nothing of the nodes.
        if self._setup_settings["hierarchical"] and not fault_tolerant_mode.growing() \
                and not nodes_are_even(comm):
            warnings.warn("DataParallel: after the loss of ranks the nodes hold different "
                          "numbers of ranks; reducing gradients flat from now on", stacklevel=2)
            self._setup_settings = dict(self._setup_settings, hierarchical=False)
        self.comm = comm
        self._attach(comm)
        self.set_average(self._average)

    def train_forward(self, *inputs, **kwargs):
        return self(*inputs, **kwargs)

    @property
    def bucket_count(self) -> int:
        return self._reducer.n_buckets
