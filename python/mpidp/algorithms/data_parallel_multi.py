"""DataParallelMultiGPU: node-local DistributedDataParallel, for DASO."""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref

import torch
import torch.distributed as dist

from .. import _C
from .._runtime import fault_tolerant_mode
from .driver import set_up
from .._runtime.mpi import MPI, communicator
from .._runtime.model_checks import check_module
from .._runtime.state_broadcast import broadcast_buffers
from .daso import DASO
from .data_parallel import DataParallel
from ..collectives.process_groups import init_process_group, node_process_group
from .._runtime.topology import node_comm, topology
from .driver import reduce_wrapper

__all__ = ["DataParallelMultiGPU"]


class DataParallelMultiGPU(torch.nn.Module):
    """Wraps `module` in torch DistributedDataParallel over the ranks of this
    node, for training with mpidp.DASO, which syncs the nodes with each other.
    On CPUs DDP runs on an "mpidp" node group, and its gradient buckets and
    buffers travel over MPI (shared memory within a node) through a DDP
    communication hook that reduces them in place, instead of gloo's TCP
    loopback; DDP still buckets, accumulates and switches (no_sync), and
    `module` is the DDP. On GPUs DDP uses the default group's backend (NCCL).

    torch.distributed's default group spans `comm` (created from MPI if it is
    not initialised yet, see mpidp.init_process_group), so torch's defaults
    (DistributedSampler, dist.all_reduce) mean every rank of the job; DDP gets
    the node-local group (mpidp.process_group.node_process_group). Parameters and buffers
    start equal on every rank of `comm` (rank 0's), then `optimizer.set_model`
    is called. broadcast_buffers (default True): buffers (BatchNorm
    statistics) are node rank 0's before every training forward (DDP's
    broadcast_buffers) and world rank 0's at every blocking global sync.
    With one rank per node there is nothing to do within a node, so the
    module is used as it is (with a warning).
    """

    def __init__(self, module: torch.nn.Module, optimizer: DASO, comm=MPI.COMM_WORLD, *,
                 broadcast_buffers: bool = True):
        check_module(module)
        if isinstance(module, (DataParallelMultiGPU, DataParallel)):
            raise TypeError(f"module: is already a mpidp.{type(module).__name__}; wrap the plain "
                            "model once (a second wrapper would average every gradient again)")
        if not isinstance(optimizer, DASO):
            raise TypeError("optimizer: expected a mpidp.DASO (DataParallelMultiGPU runs DASO; for "
                            f"other optimizers use mpidp.DataParallel), got {type(optimizer).__name__}")
        if not isinstance(broadcast_buffers, bool):
            raise TypeError(f"broadcast_buffers: expected a bool, got {type(broadcast_buffers).__name__}")
        super().__init__()
        # The module is DASO's (claimed in set_model below): checked and
        # broadcast here, with DASO's settings and this wrapper's.
        self._setup_settings = dict(optimizer.settings(), broadcast_buffers=broadcast_buffers)
        handle, _ = set_up(module, comm, "DataParallelMultiGPU", settings=self._setup_settings)
        mpi_comm = handle.mpi
        topo = topology(mpi_comm)
        self.comm = comm
        # torch's default group spans `comm` (the whole job), so that
        # DistributedSampler and dist.all_reduce with their defaults mean every
        # rank; DDP gets the node-local group explicitly.
        node_default = False
        if not dist.is_initialized():
            init_process_group(mpi_comm)
        elif (dist.get_world_size(), dist.get_rank()) == (topo.local_size, topo.local_rank) \
                and topo.n_nodes > 1:
            # Heat's convention: the script made the node-local group the
            # default one. It stays the user's choice, with what it implies.
            node_default = True
            warnings.warn("DataParallelMultiGPU: torch.distributed's default group is this node "
                          "(Heat's convention), so torch's defaults (DistributedSampler without "
                          "num_replicas/rank, dist.all_reduce) cover this node only; let "
                          "DataParallelMultiGPU create the process group to have them span the job",
                          stacklevel=2)
        elif dist.get_world_size() != mpi_comm.Get_size() or dist.get_rank() != mpi_comm.Get_rank():
            raise RuntimeError(
                f"DataParallelMultiGPU: torch.distributed is initialised as rank "
                f"{dist.get_rank()} of {dist.get_world_size()}, but this is rank "
                f"{mpi_comm.Get_rank()} of {mpi_comm.Get_size()} in comm; the default group must "
                "span comm's ranks (DataParallelMultiGPU makes the node-local groups itself): "
                "call mpidp.init_process_group() before, or let DataParallelMultiGPU do it")
        # Not a submodule of the wrapper (self.module holds it, under DDP).
        object.__setattr__(self, "_user_module", module)
        self._broadcast_buffers = broadcast_buffers
        if fault_tolerant_mode.enabled() and node_default:
            raise NotImplementedError(
                "DataParallelMultiGPU: in fault-tolerant mode mpidp makes torch.distributed's "
                "default group (over the whole job, made again over the survivors after a "
                "loss); do not make the node-local group the default one")
        if topo.local_size == 1:
            warnings.warn("DataParallelMultiGPU: one rank per node, so there is no node-local "
                          "data parallelism; DASO syncs the nodes only", stacklevel=2)
        self._wrap_node_local(mpi_comm, topo.local_size, node_default)
        optimizer.set_model(self.module, broadcast_buffers=broadcast_buffers)
        optimizer._wrapper = weakref.ref(self)
        self._daso = optimizer
        self._joining = False
        self._last_inputs = None
        if fault_tolerant_mode.joining():     # a replacement: rank 0's state, as DASO's survivors
            optimizer._take_rank_0s_state()

    def _wrap_node_local(self, mpi_comm, local_size: int, node_default: bool = False) -> None:
        """self.module: the user's module in a DDP over this node's ranks of
        mpi_comm, or the module itself where a node has one rank (local_size 1)."""
        module = self._user_module
        self.loc_gpus = local_size
        self._host_buffers_comm = None
        if local_size == 1:
            self.module = module
            return
        device_ids = None
        first = next(module.parameters(), None)
        if first is not None and first.is_cuda:
            device_ids = [first.device.index]
        on_host = first is None or first.device.type == "cpu"
        # Over MPI: host parameters, and in fault-tolerant mode GPU ones too,
        # through host memory (NCCL has no ULFM: a dead peer would leave the
        # node's kernels waiting; MPI reports it, and the loss is recovered
        # as on the host). DDP's own traffic (its start-up broadcast, the
        # bucket layout it sends after the first step) goes over MPI too:
        # the node group is an "mpidp" one, with no store behind it.
        over_mpi = on_host or fault_tolerant_mode.enabled()
        node_group = None if node_default else node_process_group(
            mpi_comm, "mpidp" if over_mpi else None)
        # On the host the gradients are views of DDP's buckets: the MPI
        # hook reduces them in place, with no copy in or out.
        self.module = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=device_ids, process_group=node_group,
            gradient_as_bucket_view=on_host,
            **_ddp_buffer_sync(self._broadcast_buffers and not over_mpi))
        node = communicator(node_comm(mpi_comm)).c if over_mpi else None
        self._host_buffers_comm = node if self._broadcast_buffers else None
        # Node-local gradients are summed and divided by this many ranks:
        # all of the node's, except during join() when some are out of data.
        self._divisor = _NodeMean(local_size, node_group, node)
        self.module.register_comm_hook(self._divisor,
                                       _mpi_allreduce_mean if over_mpi else _allreduce_mean)

    def _continue_on(self, mpi_comm, local_size: int) -> None:
        """Fault-tolerant mode (DASO._continue_on): the node-local DDP made
        again over the survivors' nodes (none where a node has one rank);
        where replacements joined, after this wrapper's set-up, which a
        replacement's construction runs there (its model becomes rank 0's)."""
        if fault_tolerant_mode.growing():
            set_up(self._user_module, mpi_comm, "DataParallelMultiGPU",
                   settings=self._setup_settings)
        if isinstance(self.module, torch.nn.parallel.DistributedDataParallel):
            # The old DDP's autograd hooks on the parameters go with it.
            self.module._remove_autograd_hooks()
        self._wrap_node_local(mpi_comm, local_size)

    def __reduce_ex__(self, protocol):
        inner = self.module
        model = inner.module if isinstance(inner, torch.nn.parallel.DistributedDataParallel) else inner
        return reduce_wrapper(self, model)

    def forward(self, *inputs, **kwargs):
        if (self.training and torch.is_grad_enabled() and not self._joining
                and self._daso.current_batch == 0):
            self._daso.check_schedules_agree()
        if self._joining and self.training and torch.is_grad_enabled():
            self._last_inputs = (inputs, kwargs)
            active_here, _ = self._daso.join_ballot(True)
            self._set_divisor(active_here)
        self._sync_host_buffers()
        return self.module(*inputs, **kwargs)

    def _sync_host_buffers(self) -> None:
        """DDP's buffer broadcast, over MPI on the host: node rank 0's
        buffers before a forward, when DDP would send them (after a forward
        that was followed by a synced backward: DDP's own flag)."""
        if self._host_buffers_comm is not None and self.module.require_forward_param_sync:
            broadcast_buffers(self.module.module, self._host_buffers_comm)

    @contextlib.contextmanager
    def no_sync(self):
        """torch DDP's gradient accumulation: backward passes inside do not
        average gradients within the node; the first backward after the
        context averages the accumulated sum. DASO.step() inside raises."""
        if self._joining:
            raise RuntimeError("DataParallelMultiGPU.no_sync() inside join() is not supported")
        local = (self.module.no_sync()
                 if isinstance(self.module, torch.nn.parallel.DistributedDataParallel)
                 else contextlib.nullcontext())
        with self._daso.no_sync(), local:
            yield

    def _set_divisor(self, n: int) -> None:
        if isinstance(self.module, torch.nn.parallel.DistributedDataParallel):
            self._divisor.n = max(n, 1)

    @contextlib.contextmanager
    def join(self):
        """Let ranks with fewer batches in an epoch finish it early::

            with net.join():
                for x, y in loader:     # loaders of different lengths
                    ...                 # the usual forward, backward, daso.step()
            daso.epoch_loss_logic(loss)

        Wrap one epoch's batch loop. Every training forward takes part in a
        world-wide ballot; the epoch's last batch is the longest rank's. A rank
        whose loop has ended keeps answering the others' collectives: node-
        local gradients with zeros (averaged over the node's ranks still
        training), and global syncs with zeros from nodes whose ranks are all
        done (those nodes are not counted in the average). The epoch ends, as
        always, with a blocking sync, so every rank holds the same parameters
        when the context exits. Each training forward must be followed by one
        backward and daso.step(), and the loop may run no other collectives."""
        if self._joining:
            raise RuntimeError("DataParallelMultiGPU.join() is already active")
        self._daso.join_begin()
        self._joining, self._last_inputs = True, None
        try:
            yield self
        except BaseException:
            self._joining = False
            self._daso.join_end()
            raise
        try:
            while True:
                active_here, anyone = self._daso.join_ballot(False)
                if not anyone:
                    break
                self._set_divisor(active_here)
                if active_here and isinstance(self.module, torch.nn.parallel.DistributedDataParallel):
                    self._shadow_backward()
                self._daso.shadow_step()
        finally:
            self._joining = False
            self._set_divisor(self.loc_gpus)
            self._daso.join_end()

    def _shadow_backward(self) -> None:
        """Run the node-local DDP collectives of one step with zero gradients:
        a forward on this rank's last batch and a backward of zeros."""
        if self._last_inputs is None:
            raise RuntimeError("DataParallelMultiGPU.join(): this rank trained no batch in the "
                               "epoch, so it cannot mirror the others' steps")
        inputs, kwargs = self._last_inputs
        # DDP reduces what autograd accumulated in .grad: start from nothing.
        self.module.zero_grad(set_to_none=True)
        self._sync_host_buffers()
        with torch.enable_grad():
            out = self.module(*inputs, **kwargs)
        tensors = [t for t in _tensors_in(out) if t.requires_grad]
        torch.autograd.backward(tensors, [torch.zeros_like(t) for t in tensors])


def _ddp_buffer_sync(on: bool) -> dict:
    """DDP's switch for syncing buffers before each forward: newer torch calls
    it forward_sync_buffers (broadcast_buffers is deprecated there)."""
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": on}


class _NodeMean:
    def __init__(self, n: int, group, comm: "_C.Comm | None" = None):
        self.n = n
        self.group = group
        self.comm = comm      # the node's MPI communicator, for host tensors


def _mpi_allreduce_mean(state: _NodeMean, bucket):
    """DDP comm hook over MPI: sum the bucket over the node, divide by
    state.n; a device bucket (fault-tolerant mode) through host memory.
    Blocking: DDP waits for every bucket's future at the end of backward,
    and nothing would complete a pending one there; a node's allreduce
    through shared memory costs little next to a step."""
    tensor = bucket.buffer()
    host = tensor if tensor.device.type == "cpu" else tensor.cpu()
    try:
        state.comm.allreduce(host, _C.OP_SUM, _C.NO_WIRE, False)
    except _C.RanksLost as lost:
        # Raised here, torch would hand the loop a RuntimeError: DASO.step()
        # raises it instead, and the step is discarded.
        fault_tolerant_mode.defer(lost)
    if host is not tensor:
        tensor.copy_(host)
    tensor.div_(state.n)
    done = torch.futures.Future()
    done.set_result(tensor)
    return done


def _allreduce_mean(state: _NodeMean, bucket):
    """DDP comm hook: sum the bucket over the node, divide by state.n."""
    tensor = bucket.buffer()
    fut = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(state.n))


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)
