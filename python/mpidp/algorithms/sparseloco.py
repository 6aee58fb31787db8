"""SparseLoCo over MPI: DiLoCo whose outer momentum is an error-feedback
buffer, and whose ranks send only the top few entries of each tile of it,
quantized to a few bits (docs/error-feedback.md gives the rule).

Every rank trains its replica with its own inner optimizer. Every
`sync_every` inner steps each rank takes its outer gradient Δ = θ̃ - x (θ̃
the shared weights, x its replica), folds it into its error-feedback buffer
e ← βe + αΔ, sends the top k entries of each tile of e as 2-bit codes (by
default) and keeps what it did not send in e. The ranks' payloads are
gathered and decoded in rank order into their sparse mean G, and every
replica restarts from θ̃ ← θ̃ - αG: the same bits on every rank.

The kernels are the core's (mpidp/efcomp.h); the payloads travel through
mpidp/_engines/ef_wire.py."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .._runtime import fault_tolerant_mode
from .._runtime.args import check_bool, check_choice, check_int, check_real
from .._runtime.model_consistency import frozen_code
from .driver import InnerStepContext, check_inner_optimizers, set_up
from .._runtime.mpi import communicator
from .._engines.ef_wire import Wire
from .._runtime.flat_buffers import write_back
from ..collectives.means import mean_over_ranks
from .. import _C

__all__ = ["SparseLoCo"]

_MEANS = ("chosen", "all")


class SparseLoCo(InnerStepContext):
    """with SparseLoCo(model, inner_optimizer, sync_every) as sparseloco:
    train as usual, stepping `inner_optimizer`; the syncs happen after its steps.

    The defaults are the paper's 512M run (the reference constructor's own
    defaults differ; docs/error-feedback.md lists both): lr (α, the outer
    learning rate) 1.0, error_decay (β) 0.95, top_k 128 entries per
    chunk_size x chunk_size (64 x 64) tile -- a tile of another size keeps
    the same share, max(1, round(len * top_k / chunk_size²)) -- and the
    statistical quantizer with quantization_bins 4 (2-bit codes) over
    quantization_range 6 standard deviations. use_quantization=False sends
    the kept values as float32. weight_decay: decoupled outer weight decay
    (θ̃ ← θ̃(1 - α·weight_decay) at each sync; 0 in the paper, whose weight
    decay lives in the inner AdamW). mean: "chosen" (the reference's: each
    entry is divided by the number of ranks that sent it) or "all" (by
    every rank). α is applied twice, as in the reference code: in e's update
    and in θ̃'s.

    comm: an mpi4py communicator (None: every rank). sync_buffers: the
    floating-point buffers (BatchNorm statistics) become their mean at each
    sync. sync_delay (0 .. sync_every - 1): inner steps between a sync's
    send and its turn; the allgather runs under the inner steps in between,
    whose local progress the replica drops at the turn (Streaming DiLoCo's
    rule). The model's trainable parameters must be contiguous float32 CPU
    tensors. Replicas start from rank 0's parameters. state_dict() /
    load_state_dict() hold θ̃, this rank's replica and error-feedback
    buffer, the step count and a sync in flight, so a resumed job continues
    exactly (each rank saves its own; save the inner optimizer beside it).
    At another number of ranks, the ranks without a checkpoint of their own
    call load_shared_state() with any rank's.

    Every sync checks, from the gathered bytes and without another
    message, that the ranks are at the same step with the same settings
    and the same θ̃; each rank's `bytes_sent` says what one sync sends."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 sync_every: int, comm=None, *, lr: float = 1.0, error_decay: float = 0.95,
                 top_k: int = 128, chunk_size: int = 64, use_quantization: bool = True,
                 quantization_bins: int = 4, quantization_range: float = 6.0,
                 weight_decay: float = 0.0, mean: str = "chosen", sync_buffers: bool = True,
                 sync_delay: int = 0):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        check_inner_optimizers(inner_optimizer)
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.lr = check_real("lr", lr, 0.0, None)
        self.error_decay = check_real("error_decay", error_decay, 0.0, 1.0)
        self.top_k = check_int("top_k", top_k, 1)
        self.chunk_size = check_int("chunk_size", chunk_size, 1)
        if chunk_size > _C.EF_MAX_CHUNK:
            raise ValueError(f"chunk_size: expected 1 .. {_C.EF_MAX_CHUNK} (slots travel as 16 "
                             f"bits), got {chunk_size!r}")
        self.use_quantization = check_bool("use_quantization", use_quantization)
        self.quantization_bins = check_int("quantization_bins", quantization_bins, 2)
        if quantization_bins > _C.EF_MAX_BINS:
            raise ValueError(f"quantization_bins: expected 2 .. {_C.EF_MAX_BINS}, got "
                             f"{quantization_bins!r}")
        self.quantization_range = check_real("quantization_range", quantization_range, 0.0, None)
        if not self.quantization_range > 0:
            raise ValueError("quantization_range: expected a positive number of standard "
                             f"deviations, got {quantization_range!r}")
        self.weight_decay = check_real("weight_decay", weight_decay, 0.0, None)
        self.mean = check_choice("mean", mean, _MEANS)
        self.sync_buffers = check_bool("sync_buffers", sync_buffers)
        if check_int("sync_delay", sync_delay, 0) >= self.sync_every:
            raise ValueError(f"sync_delay: expected 0 .. {self.sync_every - 1} (the send must "
                             f"come before its sync, every {self.sync_every} steps), got "
                             f"{sync_delay!r}")
        self.sync_delay = sync_delay
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                raise TypeError(f"model: {self.what} syncs contiguous float32 CPU parameters, got "
                                f"{p.dtype} on {p.device}")
        self._communicator, self._trainable_at_setup = self._set_up(comm)
        self._comm = self._communicator.c
        self._buffers = ([b for b in model.buffers() if b.is_floating_point()]
                         if sync_buffers else [])
        self.step = 0  # inner steps taken under this SparseLoCo
        self._wire = self._make_wire()
        with torch.no_grad():
            self.shared = [p.detach().clone() for p in self.params]       # θ̃
        self.error = [torch.zeros_like(p) for p in self.params]          # e
        # Δ of one tensor at a time, then its G
        self._scratch = torch.empty(max((p.numel() for p in self.params), default=0))
        self._received: Optional[List[torch.Tensor]] = None   # G of a sync in flight, drained
        self._sent_settings: List[Tuple[str, float]] = []     # _settings() at the last send
        self._handles: List = []
        # Fault-tolerant mode: a round (the hook after an inner step) under
        # way; from a send until its turn is applied, what redoing that send
        # over the survivors needs (its step, e before it and, with
        # sync_delay, the replica it sent: the inner steps since changed the
        # parameters); and what a recovery left to redo (_catch_up).
        self._round_open = False
        self._unapplied_send: Optional[Tuple[int, List[torch.Tensor],
                                             Optional[List[torch.Tensor]]]] = None
        self._resend_due = False
        self._apply_due = False
        # The step of the last sync applied: where every replica goes back
        # to when replacements join (recover(replace=True)).
        self._resume_step = 0
        if fault_tolerant_mode.joining():     # a replacement: the rest of rank 0's state
            self._take_shared_state(self._communicator.mpi.bcast(None, root=0))

    def _set_up(self, comm):
        return set_up(self.model, comm, self.what, settings=self._settings_dict(),
                      rebuild=f"Build a new {self.what} after such a change")

    def _make_wire(self) -> Wire:
        return Wire(self._comm, [p.shape for p in self.params], self.chunk_size, self._k_of,
                    self._bins(), self.what, self._communicator.mpi)

    def _k_of(self, length: int) -> int:
        """k of a tile of `length` entries: the share top_k / chunk² of it."""
        return round(length * self.top_k / self.chunk_size ** 2)

    def _settings_dict(self) -> Dict[str, Any]:
        return {"sync_every": self.sync_every, "lr": self.lr, "error_decay": self.error_decay,
                "top_k": self.top_k, "chunk_size": self.chunk_size,
                "use_quantization": self.use_quantization,
                "quantization_bins": self.quantization_bins,
                "quantization_range": self.quantization_range,
                "weight_decay": self.weight_decay, "mean": self.mean,
                "sync_buffers": self.sync_buffers, "sync_delay": self.sync_delay}

    def _settings(self) -> List[Tuple[str, float]]:
        """The (name, number) settings every sync compares (those a user may
        change in flight)."""
        return [("sync_every", float(self.sync_every)), ("sync_delay", float(self.sync_delay)),
                ("lr", self.lr), ("error_decay", self.error_decay), ("top_k", float(self.top_k)),
                ("quantization_bins", float(self.quantization_bins)),
                ("quantization_range", self.quantization_range),
                ("weight_decay", self.weight_decay),
                ("frozen parameters", frozen_code(self.params))]

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sends at each sync (what each other rank receives from it)."""
        return self._wire.bytes_sent

    # -- the context: driver.InnerStepContext's __enter__/__exit__ ---------------

    # -- the driver interface (mpidp/algorithms/driver.py) ---------------------

    what = "SparseLoCo"

    def drain(self) -> None:
        """Completes a sync in flight (sync_delay > 0): its mean G is kept
        for its turn."""
        self._catch_up()
        if self._wire.in_flight:
            self._received = self._decode()

    # -- the syncs ---------------------------------------------------------------

    def _after_inner_step(self, optimizer, args, kwargs) -> None:
        self._trainable_at_setup.check()
        self._catch_up()      # where no forward came since a recovery
        self.step += 1
        self._round_open = True
        phase = self.step % self.sync_every
        if phase == (self.sync_every - self.sync_delay) % self.sync_every:
            self._send()
        if phase == 0:
            self._apply()
        self._round_open = False
        fault_tolerant_mode.commit_step()

    def _continue_on(self, survivors) -> None:
        """Fault-tolerant mode, after a rank was lost (mpidp.recover()): the
        syncs go on over the survivors. The lost rank's error feedback
        leaves with it. A send not yet applied (its allgather interrupted,
        or complete but not agreed) is redone over the survivors from each
        one's error feedback and replica as they were at it, and a turn the
        loss cut short is then applied: both before the next forward
        (_catch_up). The inner step of a round the loss cut short stands, as
        every local step does. θ̃, equal on every survivor, stays.

        Where replacements joined (recover(replace=True)), every replica
        goes back to θ̃ and every rank to the step of the last sync applied
        instead (_go_back_to_last_sync), as under DiLoCo: a replacement can
        only start from θ̃."""
        entered = bool(self._handles)
        if entered:
            self.__exit__(None, None, None)
        growing = fault_tolerant_mode.growing()
        if growing:
            kept = self._go_back_to_last_sync()
            # The set-up the replacements run: rank 0's parameters (θ̃ now).
            self._communicator, self._trainable_at_setup = self._set_up(survivors)
        else:
            self._communicator = communicator(survivors)
        self._comm = self._communicator.c
        self._wire = self._make_wire()    # recover() ended the old one's requests
        if growing:
            self._received = kept
            self._communicator.mpi.bcast(self._shared_state(), root=0)
        else:
            self._received = None
            self._resend_due = self._unapplied_send is not None
            if self._round_open:
                self._apply_due = self._apply_due or self.step % self.sync_every == 0
                self._round_open = False
                fault_tolerant_mode.commit_step()
        if entered:
            self.__enter__()
        for p in self.model.parameters():     # the cut-short step's, spent
            p.grad = None

    @torch.no_grad()
    def _go_back_to_last_sync(self) -> Optional[List[torch.Tensor]]:
        """Every survivor back to θ̃ and to the step of the last sync applied
        -- the same on each, as every sync is agreed -- its error feedback
        as it was then (before a send since, which is dropped and sent
        again by the schedule). The inner optimizers keep their state.
        Returns a mean G a checkpoint brought, which stays (its send was
        not this job's)."""
        kept = None
        if self._unapplied_send is not None:
            for e, before in zip(self.error, self._unapplied_send[1]):
                e.copy_(before)
        else:
            kept = self._received
        for p, theta in zip(self.params, self.shared):
            p.copy_(theta)
        taken = self.step - self._resume_step - (1 if self._round_open else 0)
        fault_tolerant_mode.roll_back_steps(taken)   # the open round's step was not committed
        self.step = self._resume_step
        self._round_open = self._resend_due = self._apply_due = False
        self._unapplied_send = None
        return kept

    def _shared_state(self) -> Optional[Dict[str, Any]]:
        """What a replacement takes beyond the parameters (rank 0's; equal on
        every survivor): the step and a mean G a checkpoint brought. Its
        error feedback starts at zero: the lost rank's left with it."""
        if self._comm.rank != 0:
            return None
        return {"step": self.step, "in_flight": self._received}

    def _take_shared_state(self, state: Dict[str, Any]) -> None:
        self.step = self._resume_step = int(state["step"])
        self._received = (None if state["in_flight"] is None
                          else [g.clone() for g in state["in_flight"]])

    def _takes_replacements(self) -> bool:
        return True       # from θ̃, at the step of the last sync (_continue_on)

    def _catch_up(self) -> None:
        if self._resend_due:
            step, errors, replica = self._unapplied_send
            with torch.no_grad():
                for e, before in zip(self.error, errors):
                    e.copy_(before)
            self._send(replica, step)
            self._resend_due = False
        if self._apply_due:
            self._apply()
            self._apply_due = False

    def sync(self) -> None:
        """One outer round now (collective; the inner steps call it every
        sync_every steps, in two halves when sync_delay > 0)."""
        self._send()
        self._apply()

    @torch.no_grad()
    def _send(self, replica: Optional[List[torch.Tensor]] = None,
              step: Optional[int] = None) -> None:
        """Steps 1-5 of the round: each tensor's Δ = θ̃ - x (x: `replica`,
        default the parameters) folded into e, compressed into its bucket,
        each bucket's allgather posted once it is full. `step`: the step it
        was first sent at (a redo's), default now."""
        wire, bins = self._wire, self._bins()
        step = self.step if step is None else step
        self._received = None
        if fault_tolerant_mode.enabled() and self._unapplied_send is None:
            self._unapplied_send = (
                step, [e.clone() for e in self.error],
                None if self.sync_delay == 0 else [p.detach().clone() for p in self.params])
        xs = self.params if replica is None else replica
        self._sent_settings = self._settings()
        wire.write_header(step, [v for _, v in self._sent_settings], self.shared)
        last_bucket = 0
        alphas = self._ef_alphas()
        for i, (p, x, theta, e) in enumerate(zip(self.params, xs, self.shared, self.error)):
            t = wire.tensors[i]
            if t.bucket != last_bucket:  # the previous bucket is complete: send it
                wire.post(last_bucket)
                last_bucket = t.bucket
            d = self._scratch[:p.numel()].view_as(p)
            bucket, offset = wire.buckets_of(i)
            if not p.requires_grad:
                # Frozen: it takes no outer step and keeps its error buffer;
                # zeros keep the payload's layout.
                d.zero_()
                _C.ef_compress(torch.zeros_like(e), d, t.tiling, self.error_decay, alphas[i],
                               t.k, bins, self.quantization_range, bucket, offset)
                continue
            torch.sub(theta, x, out=d)
            _C.ef_compress(e, d, t.tiling, self.error_decay, alphas[i], t.k, bins,
                           self.quantization_range, bucket, offset)
        wire.post(last_bucket)

    def _ef_alphas(self) -> List[float]:
        """Each tensor's α in e ← βe + αΔ (SparseLoCo: lr, every tensor)."""
        return [self.lr] * len(self.params)

    def _bins(self) -> int:
        return self.quantization_bins if self.use_quantization else 0

    @torch.no_grad()
    def _decode(self) -> List[torch.Tensor]:
        """Waits for the gathers and returns each tensor's sparse mean G."""
        wire = self._wire
        wire.wait([name for name, _ in self._sent_settings])
        out = []
        for i, p in enumerate(self.params):
            t = wire.tensors[i]
            g = torch.empty_like(p)
            gathered, offset, stride = wire.gathered_of(i)
            _C.ef_sparse_mean(g, gathered, offset, stride, self._comm.size, t.tiling, t.k,
                              self._bins(), self.mean == "all")
            out.append(g)
        return out

    @torch.no_grad()
    def _apply(self) -> None:
        """Steps 6-7: θ̃ ← θ̃(1 - α·wd) - αG, and the replica restarts from θ̃
        (the local steps since the send, with sync_delay, are dropped, as in
        Streaming DiLoCo)."""
        buffer_means = mean_over_ranks(self._buffers, self._comm) if self._buffers else None
        means = self._received if self._received is not None else self._decode()
        self._received = None
        if fault_tolerant_mode.enabled():
            fault_tolerant_mode.agree_all_alive(f"{self.what} outer sync", "no rank applied it",
                                                self._communicator.mpi)
            self._unapplied_send = None
        self._resume_step = self.step
        self._outer_step(means)
        for p, theta in zip(self.params, self.shared):
            p.copy_(theta)       # the replica restarts from θ̃
        if buffer_means is not None:
            write_back(buffer_means, self._buffers)

    @torch.no_grad()
    def _outer_step(self, means: List[torch.Tensor]) -> None:
        """θ̃ ← θ̃(1 - α·wd) - αG; a frozen parameter's θ̃ stays."""
        for p, theta, g in zip(self.params, self.shared, means):
            if not p.requires_grad:
                continue
            if self.weight_decay:
                theta.mul_(1.0 - self.lr * self.weight_decay)
            theta.sub_(g, alpha=self.lr)

    # -- checkpoints ---------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """θ̃, this rank's replica and error-feedback buffer, the step, and
        the mean G of a sync in flight (completed here)."""
        self.drain()
        return {"step": self.step, "shared": [t.clone() for t in self.shared],
                "local": [p.detach().clone() for p in self.params],
                "error": [e.clone() for e in self.error],
                "in_flight": (None if self._received is None
                              else [g.clone() for g in self._received])}

    def load_shared_state(self, state: Dict[str, Any]) -> None:
        """A job resumed at more ranks than saved it: a rank with no
        checkpoint of its own takes, from any rank's state_dict(), what the
        saved job's ranks shared -- θ̃, the step, a mean G in flight
        (MuLoCo: the outer optimizer's state) -- and starts as a replacement
        does when a job grows back: its replica at θ̃, its error feedback
        at zero. The ranks that have a checkpoint load it with
        load_state_dict(); at fewer ranks, the error feedback of the ranks
        left out leaves with them."""
        if isinstance(state, dict) and {"shared", "error"} <= set(state):
            state = dict(state, local=[t.clone() for t in state["shared"]],
                         error=[torch.zeros_like(e) for e in state["error"]])
        self.load_state_dict(state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores what state_dict saved (construction made the replicas
        rank 0's)."""
        keys = {"step", "shared", "local", "error", "in_flight"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"state: expected a {self.what} state_dict (keys {sorted(keys)})")
        for key in ("shared", "local", "error", "in_flight"):
            values = state[key]
            if key == "in_flight" and values is None:
                continue
            if len(values) != len(self.params) or any(
                    tuple(v.shape) != tuple(p.shape) for v, p in zip(values, self.params)):
                raise ValueError(f"state: its {key!r} tensors do not match this model's trainable "
                                 "parameters")
        with torch.no_grad():
            for p, theta, e, s, x, err in zip(self.params, self.shared, self.error,
                                              state["shared"], state["local"], state["error"]):
                theta.copy_(s)
                p.copy_(x)
                e.copy_(err)
        self.step = self._resume_step = check_int("state['step']", state["step"], 0)
        self._unapplied_send, self._resend_due, self._apply_due = None, False, False
        if self._wire.in_flight:      # this instance's own sync in flight is replaced
            self._decode()
        self._received = (None if state["in_flight"] is None
                          else [g.clone() for g in state["in_flight"]])
