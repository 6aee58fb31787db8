"""DASO: Distributed Asynchronous and Selective Optimization (Heat's API).

Two levels of synchronisation: node-local gradient averaging every batch (or
every few), by torch DistributedDataParallel on a node-local process group
(see mpidp.DataParallelMultiGPU); and global parameter averaging between
nodes over MPI, only every `global_skip` batches, received `batches_to_wait`
batches after it was sent, compressed to `downcast_type`, with blocking
averages during warm-up, cool-down and on every epoch's last batch. The
schedule is a C state machine (mpidp._C.Schedule); the sync packs each
parameter's difference from the last blocking sync (mpidp._C.ParamSync).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
import weakref

import torch

from .._runtime import config
from .. import _C
from .._runtime import fault_tolerant_mode
from .._runtime.args import check_bool, check_dtype, check_int, check_real
from .._runtime.dtypes import CODE_OF
from .._runtime.model_consistency import (check_every, check_in_sync, param_group_settings,
                                    ranks_differing, refuse_different_settings)
from .driver import Driver, wait_pending
from .._runtime.mpi import MPI, communicator, revocable
from .._engines.device_paramsync import DeviceParamSync
from .._runtime.hook_handles import remove_handles
from .._runtime.model_checks import TrainableAtSetup
from .._runtime.state_broadcast import broadcast_state, broadcast_tensors
from .._engines.progress import install_progress_hooks
from .._engines.kept_values import KeptValues
from .._runtime.topology import node_comm, nodes_are_even, topology

__all__ = ["DASO"]

_STATE_FORMAT = "mpidp.DASO/1"


class DASO(Driver):
    """Optimizer wrapper for DASO training; see the module docstring.

    Use it with mpidp.DataParallelMultiGPU, call `step()` after every backward,
    set `last_batch` to the index of each epoch's last batch (len(loader) - 1)
    and call `epoch_loss_logic(loss)` after every epoch. Arguments follow
    Heat's; every one is checked.

    Parameters
    ----------
    local_optimizer : torch.optim.Optimizer
        The optimizer of the model's parameters, stepped by `step()`.
    total_epochs : int
        Epochs of the whole training (>= 1); the cool-down is the last
        `cooldown_epochs` of them.
    comm : mpi4py communicator or MPICommunication
        The ranks that train together (default: the world).
    warmup_epochs : int
        Epochs at the start with a blocking global average every batch.
    cooldown_epochs : int
        Epochs at the end with a blocking global average every batch.
    scheduler : learning-rate scheduler, optional
        Stepped by `step()` instead of the optimizer (Heat's convention).
    stability_level : float
        In [0, 1): an epoch loss improves when it is below
        best * (1 - stability_level); three epochs without improvement are a
        plateau, which makes the global syncs more frequent.
    max_global_skips : int
        The most batches between two global syncs (>= 1).
    sending_chunk_size : int
        Elements per MPI message of a global sync (<= 2**31 - 1).
    downcast_type : torch.dtype
        The wire dtype of the global syncs: torch.bfloat16, torch.float16 or
        torch.float32 (a string is a TypeError).
    use_mpi_groups : bool
        Build the sync groups (local rank i of every node) with
        MPI_Comm_create_group (True) or MPI_Comm_split (False).
    skip_reduction_factor : int
        On a plateau the global and local skips are divided by it (>= 2).
    local_skip_factor : int
        After the skips reach 1, they restart at max_global_skips and the
        local skip and the batches to wait at max_global_skips //
        local_skip_factor.
    verbose : bool
        Print the schedule's changes on rank 0.
    """

    def __init__(self, local_optimizer: torch.optim.Optimizer, total_epochs: int,
                 comm=MPI.COMM_WORLD, warmup_epochs: int = 4, cooldown_epochs: int = 4,
                 scheduler=None, stability_level: float = 0.05, max_global_skips: int = 8,
                 sending_chunk_size: int = 10_000_000, downcast_type: torch.dtype = torch.bfloat16,
                 use_mpi_groups: bool = True, skip_reduction_factor: int = 2,
                 local_skip_factor: int = 4, verbose: bool = False):
        if not isinstance(local_optimizer, torch.optim.Optimizer):
            raise TypeError("local_optimizer: expected a torch.optim.Optimizer, got "
                            f"{type(local_optimizer).__name__}")
        total_epochs = check_int("total_epochs", total_epochs, 1)
        warmup_epochs = check_int("warmup_epochs", warmup_epochs, 0)
        cooldown_epochs = check_int("cooldown_epochs", cooldown_epochs, 0)
        max_global_skips = check_int("max_global_skips", max_global_skips, 1)
        sending_chunk_size = check_int("sending_chunk_size", sending_chunk_size, 1)
        if sending_chunk_size > 2**31 - 1:
            raise ValueError(f"sending_chunk_size: expected at most 2**31 - 1, got {sending_chunk_size}")
        skip_reduction_factor = check_int("skip_reduction_factor", skip_reduction_factor, 2)
        local_skip_factor = check_int("local_skip_factor", local_skip_factor, 1)
        stability_level = check_real("stability_level", stability_level, 0.0, 1.0, high_open=True)
        check_dtype("downcast_type", downcast_type, (torch.bfloat16, torch.float16, torch.float32))
        check_bool("use_mpi_groups", use_mpi_groups)
        check_bool("verbose", verbose)
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError("scheduler: expected a learning-rate scheduler with a step() method, "
                            f"got {type(scheduler).__name__}")

        self.local_optimizer = local_optimizer
        self.total_epochs = total_epochs
        self.warmup_epochs = warmup_epochs
        self.cooldown_epochs = cooldown_epochs
        self.scheduler = scheduler
        self.stability_level = float(stability_level)
        self.max_global_skips = max_global_skips
        self.sending_chunk_size = sending_chunk_size
        self.downcast_type = downcast_type
        self.use_mpi_groups = use_mpi_groups
        self.skip_reduction_factor = skip_reduction_factor
        self.local_skip_factor = local_skip_factor
        self.verbose = verbose

        self._one_rank_nodes = False   # every rank a node (fault-tolerant mode, uneven nodes)
        self._wrapper = None   # weakref to the DataParallelMultiGPU that runs this DASO
        self._kept = KeptValues()   # fault-tolerant mode: the parameters before a sync's writes
        self._attach_comms(comm)
        self._schedule = _C.Schedule(total_epochs, warmup_epochs, cooldown_epochs, max_global_skips,
                                     skip_reduction_factor, local_skip_factor, self.loc_size,
                                     self.stability_level)
        self.module = None
        self.scaler = None
        self.amp = False
        self.last_batch = None
        self.current_batch = 0
        self._epochs_unclosed = 0      # epochs ended since the last epoch_loss_logic
        self._warned_unclosed = False
        self._warned_nonfinite = False
        self.bytes_sent = 0          # global-sync bytes this rank has put on the wire
        self._sync = None
        self._progress_handles = []   # hooks that progress a sync in flight
        # A DASO the program dropped takes its hooks with it.
        weakref.finalize(self, remove_handles, self._progress_handles)
        self._params = ()
        self._pointers = ()
        self._flat = None
        self._needs_reference = False
        # Set by set_model: rank 0's buffers at every blocking global sync
        # (broadcast_buffers). Set by no_sync(): its context is active.
        self._broadcast_buffers = False
        self._no_sync = False
        self._schedule_checked = None   # the epoch whose schedule the ranks compared
        # Uneven inputs (DataParallelMultiGPU.join): what the last ballot said.
        self._joining = False
        self._common_last = None      # the epoch's last batch: the longest rank's
        self._node_mixed = False      # some of this node's ranks are done, some not
        self._node_active_root = 0    # the lowest local rank still training
        self._node_active = True      # some rank of this node still trains
        self._active_nodes = self.n_nodes
        self._pending_senders = self.n_nodes

    # -- construction helpers -------------------------------------------------

    def _attach_comms(self, comm) -> None:
        """The communicators of `comm`'s layout: the world, this rank's node,
        and its sync group (with _one_rank_nodes, every rank is a node)."""
        self.comm = comm
        self._world_comm = communicator(comm)
        self._world, mpi_comm = self._world_comm.c, self._world_comm.mpi
        self.rank = mpi_comm.Get_rank()
        if self._one_rank_nodes:
            self.n_nodes, self.local_rank, self.loc_size = mpi_comm.Get_size(), 0, 1
            self._node = None
            self._group = self._world if self.n_nodes > 1 else None
            self._node_of = list(range(self.n_nodes))
            return
        topo = topology(mpi_comm)
        self.n_nodes, self.local_rank, self.loc_size = topo.n_nodes, topo.local_rank, topo.local_size
        self._node = communicator(node_comm(mpi_comm)).c
        # Global syncs take turns over `loc_size` groups; group i holds local
        # rank i of every node. Each rank only ever needs its own group.
        self._group = communicator(self._make_group(mpi_comm, topo)).c if self.n_nodes > 1 else None
        self._node_of = mpi_comm.allgather(topo.node)

    def _make_group(self, comm, topo):
        key = topo.node
        if self.use_mpi_groups:
            local = [r for r, lr in enumerate(comm.allgather(topo.local_rank)) if lr == topo.local_rank]
            group = comm.Get_group().Incl(local)
            sub = comm.Create_group(group)
            group.Free()
            return revocable(sub)
        return revocable(comm.Split(color=topo.local_rank, key=key))

    # -- Heat's API -----------------------------------------------------------------

    @property
    def global_skip(self) -> int:
        return self._schedule.global_skip

    @property
    def local_skip(self) -> int:
        return self._schedule.local_skip

    @property
    def batches_to_wait(self) -> int:
        return self._schedule.batches_to_wait

    @property
    def epoch(self) -> int:
        return self._schedule.epoch

    @property
    def phase(self) -> str:
        """"warmup", "cycling" or "cooldown"."""
        return self._schedule.phase

    def settings(self) -> dict:
        """The settings every rank must share (DataParallelMultiGPU compares
        them across ranks at construction: a difference would hang the
        schedule's collectives or merge different wire formats)."""
        return {"total_epochs": self.total_epochs, "warmup_epochs": self.warmup_epochs,
                "cooldown_epochs": self.cooldown_epochs, "max_global_skips": self.max_global_skips,
                "skip_reduction_factor": self.skip_reduction_factor,
                "local_skip_factor": self.local_skip_factor,
                "stability_level": self.stability_level, "downcast_type": self.downcast_type,
                "sending_chunk_size": self.sending_chunk_size,
                "use_mpi_groups": self.use_mpi_groups, "MPIDP_CHECK every": check_every()}

    def set_model(self, model: torch.nn.Module, *, broadcast_buffers: bool = False) -> None:
        """The (node-locally wrapped) model whose parameters DASO syncs;
        mpidp.DataParallelMultiGPU calls this. Every rank must hold the same
        parameter values when it is called. broadcast_buffers: the buffers
        become world rank 0's at every blocking global sync."""
        check_bool("broadcast_buffers", broadcast_buffers)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.dtype != torch.float32:
                raise TypeError(f"model: DASO averages float32 parameters (AMP keeps them so), got "
                                f"{p.dtype}")
        if len({p.device for p in params}) > 1:
            raise ValueError("model: DASO needs all trainable parameters on one device, got "
                             f"{sorted(str(d) for d in {p.device for p in params})}")
        held = {id(p) for g in self.local_optimizer.param_groups for p in g["params"]}
        if not held.issubset({id(p) for p in model.parameters()}):
            raise ValueError("local_optimizer: it holds tensors that are not parameters of the model")
        self.module = model
        self._broadcast_buffers = broadcast_buffers
        # Named as the user's model names them, not as DDP's wrapper (module.*).
        user_model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
            else model
        self._trainable_at_setup = TrainableAtSetup(
            user_model, "DASO", "Call daso.set_model(model) again after such a change, through a "
            "new mpidp.DataParallelMultiGPU(model, daso) where DASO runs in one")
        self._device_params = tuple(p.detach() for p in params)
        self._param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self._pointers = tuple(p.data_ptr() for p in params)
        # Parameters in device memory are packed and merged where they live
        # (_engines/device_paramsync.py: only the packed bytes cross to the host);
        # MPIDP_DASO_DEVICE_SYNC=1 does the same for CPU parameters (tests).
        # MPIDP_DASO_STAGING=1 instead syncs any parameters through a host
        # mirror -- pulled before packing or merging, pushed back after a
        # merge or a node-local broadcast -- the path GPU parameters took
        # before, kept as the fallback and tested on machines without a GPU.
        on_device = any(p.device.type != "cpu" for p in params)
        staged = bool(config.get("MPIDP_DASO_STAGING"))
        device_sync = not staged and (on_device or config.get("MPIDP_DASO_DEVICE_SYNC"))
        if staged:
            pin = any(p.is_cuda for p in params)
            self._params = tuple(torch.empty(p.shape, dtype=p.dtype, pin_memory=pin).copy_(p)
                                 for p in self._device_params)
        else:
            self._params = self._device_params
        self._staged = staged
        self.drain()
        wire = CODE_OF[torch.float16 if self.downcast_type == torch.half else self.downcast_type]
        engine = DeviceParamSync if device_sync else _C.ParamSync
        self._sync = (engine(self._group, self._params, wire, self.sending_chunk_size,
                             what="DASO global sync")
                      if self._group is not None else None)
        numel = sum(p.numel() for p in params)
        self._flat = torch.empty(numel, dtype=torch.float32) if self.loc_size > 1 else None
        self._install_progress_hooks(model, params)

    def _install_progress_hooks(self, model: torch.nn.Module, params) -> None:
        """Forward and gradient hooks test the global sync in flight
        (_engines/progress.py); DASO claims the user's model (under
        DataParallelMultiGPU's DDP), so a newer DASO of it takes over."""
        remove_handles(self._progress_handles)
        self._claim(getattr(model, "module", model), self._world_comm)
        if self._sync is not None:
            self._progress_handles += install_progress_hooks(model, params, [self._sync])

    def add_scaler(self, scaler) -> None:
        """Use `scaler` (torch.amp.GradScaler) for automatic mixed precision:
        step() then steps the local optimizer through it."""
        if not (hasattr(scaler, "step") and hasattr(scaler, "update") and hasattr(scaler, "scale")):
            raise TypeError(f"scaler: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler
        self.amp = True

    def print0(self, *args, **kwargs) -> None:
        """print() on rank 0 when `verbose` is set."""
        if self.verbose and self.rank == 0:
            print(*args, **kwargs)

    def zero_grad(self) -> None:
        """Reset the gradients of the local optimizer's parameters."""
        self.local_optimizer.zero_grad()

    def step(self) -> None:
        """One optimizer step: the local step (through the scaler if one was
        added; then the scheduler, once per batch, if one was given), then
        whatever the schedule says for this batch: complete a pending global
        sync, send a new one, switch node-local sync for the next backward."""
        self._check_attached()
        if self.module is None:
            raise RuntimeError("DASO.step: no model; wrap it with mpidp.DataParallelMultiGPU(module, "
                               "daso) or call daso.set_model(model)")
        if self._no_sync:
            raise RuntimeError(
                "DASO.step() inside DataParallelMultiGPU.no_sync(): the gradients of its backward "
                "passes are not averaged within the node yet, so the node's ranks would drift "
                "apart. Run the accumulation's last backward outside no_sync(), then step")
        if self.last_batch is None:
            raise ValueError("last_batch: set daso.last_batch to the index of the epoch's last "
                             "batch (len(loader) - 1) before training")
        last = check_int("last_batch", self.last_batch, 0)
        self._trainable_at_setup.check()
        if self._joining:
            last = self._common_last
        if not fault_tolerant_mode.enabled():
            self._step(last)
            return
        # Fault-tolerant mode: every rank first agrees that its backward (its
        # node's averaging) is in; from then on the step stands, so the
        # local step never needs undoing. What a loss can still cut short is
        # a global sync or node broadcast that writes the parameters: those
        # are kept first and put back unless every rank agrees that the
        # writes completed (a second agreement, on such steps only), so the
        # survivors' parameters are those of the local step, the sync dropped.
        fault_tolerant_mode.raise_deferred()     # the node-local averaging saw a loss
        fault_tolerant_mode.step_boundary(self._agreement_comm())
        self._local_step()
        act = self._advance_schedule(last)
        if not self._writes_parameters(act):
            self._act(act)
            return
        self._kept.keep(self._written_by_syncs())
        try:
            self._act(act)
            fault_tolerant_mode.agree_all_alive(
                "DASO's global sync", "its parameters were put back to those of the local step "
                "(the sync dropped)", self._agreement_comm())
        except fault_tolerant_mode.RanksLost:
            self._kept.put_back()
            raise

    def _step(self, last: int) -> None:
        self._local_step()
        self._schedule_step(last)

    def _local_step(self) -> None:
        if self._needs_reference:
            self._set_reference()
        if self.scaler is not None:
            self.scaler.step(self.local_optimizer)
            self.scaler.update()
        else:
            self.local_optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def _schedule_step(self, last: int) -> None:
        """Carry out the schedule's actions for this batch (every rank, joined
        ones too, runs exactly these collectives in this order)."""
        self._act(self._advance_schedule(last))

    def _advance_schedule(self, last: int):
        """The schedule's actions for this batch, with the batch and epoch
        counters moved on (no communication: fault-tolerant mode moves them
        on before any collective, so that every survivor's are those of the
        step whatever collective a loss cut short)."""
        act = self._schedule.batch(self.current_batch, last)
        self._set_local_sync(act.local_sync)
        self.current_batch = 0 if act.epoch_done else self.current_batch + 1
        if act.epoch_done:
            self._epochs_unclosed += 1
            if self._epochs_unclosed == 2 and not self._warned_unclosed:
                self._warned_unclosed = True
                warnings.warn("DASO: two epochs ended without epoch_loss_logic(loss); the schedule "
                              "advances only through it, so DASO stays in its current phase "
                              f"({self.phase}: warm-up syncs globally every batch) -- call "
                              "daso.epoch_loss_logic(epoch_loss) after every epoch", stacklevel=3)
        return act

    def _act(self, act) -> None:
        """The collectives of `act`, the batch's actions."""
        if self._sync is not None and self._sync.pending:
            self._sync.test()  # progress the sync in flight (MPI advances only inside calls)
        if self._joining and self._node_mixed:
            # Ranks of this node that are out of data follow its training
            # ranks, so whichever of them syncs for the node sends current values.
            self._node_broadcast(self._node_active_root)
        if act.complete:
            self._complete(act.complete_group, act.complete_btw)
        if act.send:
            self._send(act.send_group)
        if act.send_blocking:
            self._complete(act.send_group, 0)

    def _writes_parameters(self, act) -> bool:
        """Whether the actions `act` write the parameters (a merge, a node
        broadcast) or the buffers: only a send and a test of the sync in
        flight do not."""
        return bool(act.complete or act.send_blocking or (self._joining and self._node_mixed))

    def _written_by_syncs(self) -> list:
        """What a merge or node broadcast writes: the parameters where they
        live and, where the buffers follow rank 0's, the buffers."""
        written = list(self._device_params)
        if self._broadcast_buffers:
            written += list(self.module.buffers())
        return written

    # -- the driver interface (mpidp/algorithms/driver.py) ---------------------

    what = "DASO"

    def drain(self) -> None:
        """Completes the global sync in flight (merged at its scheduled batch)."""
        wait_pending([self._sync])

    def _remove_hooks(self) -> None:
        remove_handles(self._progress_handles)

    def algorithm_state(self) -> dict:
        return self.state_dict()

    def load_algorithm_state(self, state: dict) -> None:
        self.load_state_dict(state)

    # -- fault-tolerant mode (mpidp/fault_tolerance/) ---------------------------------------------

    def _state_beside_optimizer(self) -> dict:
        return {"schedule": self._schedule.state(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def _load_state_beside_optimizer(self, state: dict) -> None:
        self._schedule.load(state["schedule"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def _continue_on(self, comm) -> None:
        """Fault-tolerant mode, after a rank was lost (mpidp.recover()): a
        step whose backward some rank did not finish was not taken, and a
        global sync that a loss cut short was put back to the parameters of
        its step's local step, on every survivor. DASO is set up again over
        the survivors -- the node-local DDP over the survivors of each node,
        or, where the nodes now hold different numbers of ranks, every rank a
        node of its own from then on -- and every survivor takes the new rank
        0's replica, optimizer state and schedule (replicas differ between
        global syncs). A global sync that was in flight is sent again, from
        those parameters, by the group whose turn it was. Where replacements
        joined (recover(replace=True)), this is their construction, call for
        call: DASO's communicators, the wrapper's set-up (rank 0's model for
        every rank), the node-local DDP over whole nodes again, then rank
        0's state for all (_take_rank_0s_state)."""
        self._remove_hooks()
        self._sync = None            # recover() drained what it had in flight
        growing = fault_tolerant_mode.growing()
        if growing:
            # The replacements' construction, call for call (the wrapper's
            # set-up included): the job is back to its size as launched, so
            # its nodes are whole again.
            self._one_rank_nodes = False
        elif not self._one_rank_nodes and not nodes_are_even(comm):
            warnings.warn("DASO: after the loss of ranks the nodes hold different numbers of "
                          "ranks; every rank is a node of its own from now on (no node-local "
                          "DDP, every rank in the global syncs)", stacklevel=2)
            self._one_rank_nodes = True
        self._attach_comms(comm)
        self._active_nodes = self._pending_senders = self.n_nodes
        wrapper = self._wrapper() if self._wrapper is not None else None
        if wrapper is not None:
            wrapper._continue_on(self._world_comm.mpi, self.loc_size)
        model = wrapper.module if wrapper is not None else self.module
        for p in model.parameters():
            p.grad = None
        self.set_model(model, broadcast_buffers=self._broadcast_buffers)
        if not growing:      # (growing, the wrapper's set-up did)
            ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
            broadcast_state(model.module if ddp else model, self._world)
        self._take_rank_0s_state()

    def _takes_replacements(self) -> bool:
        return True    # _continue_on repeats a replacement's construction (with its wrapper's)

    def _take_rank_0s_state(self) -> None:
        """Every rank (the survivors after a loss, a replacement at its
        construction) takes rank 0's optimizer state, schedule and batch
        counters; the global sync that was in flight is sent again."""
        mpi_comm = self._world_comm.mpi
        mine = None
        if mpi_comm.Get_rank() == 0:
            beside = self._state_beside_optimizer()
            # The global syncs take turns over the new number of ranks per node.
            schedule = beside["schedule"]
            schedule = dict(schedule, send_mod=schedule["send_mod"] % self.loc_size,
                            pending_group=schedule["pending_group"] % self.loc_size,
                            **{"cfg.n_groups": self.loc_size})
            mine = (self.local_optimizer.state_dict(), dict(beside, schedule=schedule),
                    self.current_batch, self._epochs_unclosed)
        optimizer, beside, self.current_batch, self._epochs_unclosed = mpi_comm.bcast(mine, root=0)
        self.local_optimizer.load_state_dict(optimizer)
        self._load_state_beside_optimizer(beside)
        self._schedule_checked = None
        self._set_reference()          # every rank holds rank 0's parameters
        if self._schedule.pending:
            # The sync in flight was lost with the old communicators: its
            # group sends again, now the common parameters, for the merge
            # the schedule has due.
            self._send(self._schedule.state()["pending_group"])

    # -- the host wrapper's interface (DataParallelMultiGPU drives these) -------------

    @contextlib.contextmanager
    def no_sync(self):
        """DataParallelMultiGPU.no_sync(): step() inside raises (the node's
        gradients are not averaged yet)."""
        if self._no_sync:
            raise RuntimeError("DataParallelMultiGPU.no_sync() is already active")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    # Uneven inputs (DataParallelMultiGPU.join):

    def join_begin(self) -> None:
        if self.current_batch != 0:
            raise RuntimeError("join() must wrap one epoch's batch loop: it started at batch "
                               f"{self.current_batch} of an epoch")
        self._joining, self._common_last = True, None

    def join_end(self) -> None:
        self._joining = False
        self._node_mixed, self._node_active = False, True
        self._active_nodes = self.n_nodes

    def join_ballot(self, active: bool) -> tuple[int, bool]:
        """One world-wide ballot: who still trains, and with which last_batch.
        Returns (ranks of this node still training, anyone training at all)."""
        world = len(self._node_of)
        vote = torch.zeros(2 * world, dtype=torch.float64)
        if active:
            vote[self.rank] = 1.0
            vote[world + self.rank] = float(check_int("last_batch", self.last_batch, 0))
        self._world.allreduce(vote, _C.OP_SUM, _C.NO_WIRE, False)
        training = [r for r in range(world) if vote[r] > 0]
        if not training:
            return 0, False
        if self.current_batch == 0:
            self._common_last = int(max(vote[world + r].item() for r in training))
        my_node = self._node_of[self.rank]
        mine = [r for r in training if self._node_of[r] == my_node]
        self._node_active = bool(mine)
        self._node_mixed = 0 < len(mine) < self.loc_size
        if mine:
            local = [r for r in range(world) if self._node_of[r] == my_node]
            self._node_active_root = local.index(mine[0])
        self._active_nodes = len({self._node_of[r] for r in training})
        return len(mine), True

    def shadow_step(self) -> None:
        """A rank out of data mirrors one step of the others."""
        self._schedule_step(self._common_last)

    def epoch_loss_logic(self, loss, loss_globally_averaged: bool = False) -> None:
        """End-of-epoch logic: feed the epoch's training loss (averaged over all
        ranks here unless `loss_globally_averaged`) to the schedule."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"loss: expected a scalar, got a tensor of shape {tuple(loss.shape)}")
            loss = loss.detach().item()
        if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
            raise TypeError(f"loss: expected a number or a scalar tensor, got {type(loss).__name__}")
        check_bool("loss_globally_averaged", loss_globally_averaged)
        if self.current_batch != 0:
            raise RuntimeError("DASO.epoch_loss_logic: the epoch has not ended (the step of batch "
                               f"last_batch={self.last_batch} has not run; batch {self.current_batch} "
                               "is next)")
        value = float(loss)
        if not loss_globally_averaged:
            t = torch.tensor([value], dtype=torch.float64)
            self._world.allreduce(t, _C.OP_AVG, _C.NO_WIRE, False)
            value = t.item()
        if check_every():
            # Every epoch ends with a blocking sync: all ranks must match bit for bit.
            check_in_sync(self._world, list(zip(self._param_names, self._params)), "DASO",
                          f"after epoch {self.epoch + 1}")
        else:
            self._reconcile()
        if not math.isfinite(value) and not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(f"DASO.epoch_loss_logic: the epoch loss is {value} (on some rank, if "
                          "averaged here); the schedule compares losses to decide when to skip "
                          "syncs, and a non-finite loss tells it nothing -- training has diverged "
                          "or the loss is computed wrongly", stacklevel=2)
        self._epochs_unclosed = 0
        self._schedule.epoch_end(value)
        self.print0(f"DASO epoch {self.epoch}: loss {value:.5g}, phase {self.phase}, global_skip "
                    f"{self.global_skip}, local_skip {self.local_skip}, batches_to_wait "
                    f"{self.batches_to_wait}")

    def reset(self) -> None:
        """Back to the base state (epoch 0, warm-up), as at construction."""
        self.drain()
        self._schedule.reset()
        self.current_batch = 0
        self._needs_reference = True
        self.zero_grad()

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's DASO state (schedule, detector, counters, local optimizer,
        scheduler, scaler). Take it between epochs; with the model's state it
        restarts the job exactly. Optimizer states differ between nodes, so
        every rank saves its own."""
        if self.current_batch != 0 or self._schedule.pending:
            raise RuntimeError("DASO.state_dict: take checkpoints between epochs (after "
                               "epoch_loss_logic); a global sync is in flight mid-epoch")
        return {
            "format": _STATE_FORMAT,
            "n_nodes": self.n_nodes,
            "local_size": self.loc_size,
            "rank": self.rank,
            "last_batch": self.last_batch,
            "bytes_sent": self.bytes_sent,
            "local_optimizer": self.local_optimizer.state_dict(),
            **self._state_beside_optimizer(),    # schedule, scheduler, scaler
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict() output (of this rank, same job layout). Load
        the model's parameters too; the first step() after this takes them as
        the shared reference of the global syncs."""
        if not isinstance(state, dict):
            raise TypeError(f"state: expected the dict of DASO.state_dict(), got "
                            f"{type(state).__name__}")
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"state: expected the dict of DASO.state_dict() ({_STATE_FORMAT})")
        if (state["n_nodes"], state["local_size"]) != (self.n_nodes, self.loc_size):
            raise ValueError(f"state: saved on {state['n_nodes']} nodes x {state['local_size']} "
                             f"ranks, this job has {self.n_nodes} x {self.loc_size}")
        if (state["scheduler"] is None) != (self.scheduler is None):
            raise ValueError("state: the saved job and this one differ in having a scheduler")
        if (state["scaler"] is None) != (self.scaler is None):
            raise ValueError("state: the saved job and this one differ in having a scaler")
        self.drain()
        self._load_state_beside_optimizer(state)    # schedule, scheduler, scaler
        # This job's own settings win over the checkpoint's (a restart may ask
        # for more epochs); the next epoch's phase is recomputed for them.
        self._schedule.reconfigure(self.total_epochs, self.warmup_epochs, self.cooldown_epochs,
                                   self.max_global_skips, self.skip_reduction_factor,
                                   self.local_skip_factor, self.loc_size, self.stability_level)
        self.local_optimizer.load_state_dict(state["local_optimizer"])
        if self.last_batch is None:  # the data may have changed: a value set already stays
            self.last_batch = state["last_batch"]
        self._schedule_checked = None
        self.bytes_sent = state["bytes_sent"]
        self.current_batch = 0
        self._needs_reference = True

    # -- the sync itself ---------------------------------------------------------------

    def _pull(self) -> None:
        """Host mirror <- device parameters (no-op without staging)."""
        if self._staged:
            for host, dev in zip(self._params, self._device_params):
                host.copy_(dev)

    def _push(self) -> None:
        """Device parameters <- host mirror (no-op without staging)."""
        if self._staged:
            for host, dev in zip(self._params, self._device_params):
                dev.copy_(host)

    def _set_reference(self) -> None:
        """The values the ranks share, from which the global syncs average
        differences (equal on every rank; see _reconcile)."""
        if self._sync is not None:
            self._check_pointers()
            self._pull()
            self._sync.set_reference()
        self._needs_reference = False

    def _reconcile(self) -> None:
        """At every epoch end (which every rank reaches, after a blocking sync)
        all ranks must hold the same parameters: the global syncs average
        differences from a reference each rank keeps, so a rank that loaded
        another checkpoint, or changed its model alone, would otherwise keep
        its offset for ever. Where they differ, every rank takes rank 0's
        parameters and buffers (with a warning) and the reference is set
        again; with MPIDP_CHECK=1 the difference is an error instead. One
        checksum pass and two small collectives per epoch."""
        if self._world.size == 1:
            return
        self.drain()
        # Parameters only: buffers (BatchNorm statistics) are node-local under DASO.
        differ = ranks_differing(self._world, self._device_params)
        if differ:
            warnings.warn(f"DASO: at the end of epoch {self.epoch + 1} the ranks' parameters "
                          f"differ (rank(s) {differ} do not match rank 0: a rank that "
                          "loaded another checkpoint, or changed its model alone); every rank "
                          "takes rank 0's, so that the global syncs average from one common "
                          "reference", stacklevel=3)
            broadcast_state(self.module, self._world)
            self._set_reference()

    def check_schedules_agree(self) -> None:
        """Called at the first training forward of each epoch, where every rank
        is at batch 0 of some epoch: the ranks' schedules must be one. A rank
        that loaded another epoch's checkpoint would otherwise run other
        collectives than the rest and hang them until the timeout."""
        epoch = self._schedule.epoch
        if self._schedule_checked == epoch or self._world.size == 1:
            return
        self._schedule_checked = epoch
        state = self._schedule.state()
        numbers = torch.tensor([float(v) for _, v in sorted(state.items())], dtype=torch.float64)
        differ = ranks_differing(self._world, [numbers])
        if differ:
            raise RuntimeError(
                f"DASO: at the start of an epoch the ranks' schedules differ: rank(s) {differ} "
                f"do not match rank 0 (this rank has completed {epoch} epochs). A rank loaded "
                "another epoch's DASO checkpoint? Load every rank's checkpoint of the same epoch")
        # An lr that differs (a scheduler stepped on one rank) would make the
        # ranks drift apart until each epoch's end takes rank 0's parameters.
        refuse_different_settings(self._world, "DASO",
                                  param_group_settings(self.local_optimizer.param_groups))

    def _check_pointers(self) -> None:
        now = tuple(p.data_ptr() for p in self.module.parameters() if p.requires_grad)
        if now != self._pointers:
            raise RuntimeError("DASO: the model's parameters were re-allocated after set_model() "
                               "(module.to(), p.data = ...); call daso.set_model(model) again "
                               "between epochs")

    def _send(self, group: int) -> None:
        # How many nodes contribute: all of them, except (during join) nodes
        # whose ranks are all out of data, which send zeros and do not count.
        self._pending_senders = self._active_nodes if self._joining else self.n_nodes
        if self._sync is None or self.local_rank != group:
            return
        self._check_pointers()
        self._pull()
        self._sync.send(self._joining and not self._node_active)
        self.bytes_sent += self._sync.wire_bytes

    def _complete(self, group: int, btw: int) -> None:
        """Merge the sync sent `btw` batches ago by group `group` (Heat's
        weighting: the members' current parameters count 2*btw times, a plain
        average when btw is 0), then give the whole node the merged values."""
        if self._sync is not None and self.local_rank == group:
            self._pull()   # the local steps since the send moved the parameters
            self._sync.merge_average(self._pending_senders, btw)
            self._push()
        if self.loc_size > 1:
            self._node_broadcast(group)
        if btw == 0:
            self._set_reference()  # every rank now holds the same parameters
            if self._broadcast_buffers:
                # ... and the same buffers (BatchNorm statistics): node-local DDP
                # keeps a node's equal, this keeps the nodes together.
                broadcast_tensors(list(self.module.buffers()), self._world)

    def _node_broadcast(self, root: int) -> None:
        # Through host memory (self._flat): the node's ranks may share a GPU.
        params = self._params
        if self.local_rank == root:
            self._pull()
            self._flat.copy_(torch.cat([p.reshape(-1) for p in params]))
        self._node.bcast(self._flat, root)
        if self.local_rank != root:
            flat = self._flat.to(params[0].device)
            for p, part in zip(params, flat.split([p.numel() for p in params])):
                p.copy_(part.view_as(p))
            self._push()

    def _set_local_sync(self, on: bool) -> None:
        # DDP reads this before each backward; it is what no_sync() toggles.
        if isinstance(self.module, torch.nn.parallel.DistributedDataParallel):
            self.module.require_backward_grad_sync = bool(on)
