"""DiLoCo and Streaming DiLoCo over MPI (torchft's semantics).

Every rank trains its replica with its own inner optimizer; every
`sync_every` inner steps the ranks average the outer gradient -- the shared
parameters θ minus the replica, Δ = θ - x -- and an outer optimizer steps θ
with it (DiLoCo: SGD, lr 0.7, momentum 0.9, Nesterov). Streaming DiLoCo
splits the model into fragments that take turns, one every
sync_every / len(fragments) steps, sends each fragment's Δ
`fragment_sync_delay` steps before it is applied (the allreduce overlaps the
inner steps in between), and can keep part of the local progress
(`fragment_update_alpha`: x = (1 - α) θ_new + α x_local).

The engines are the core's: the averaging schedule says when to send and
apply (mpidp/averaging_schedule.h), and one parameter sync per fragment (core
paramsync.c) holds θ, sends x - θ (compressed with `wire_dtype`) and writes
the averaged outer gradient."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _C
from .._runtime import fault_tolerant_mode
from .._runtime.args import check_bool, check_int, check_real
from .._runtime.dtypes import wire_code
from .._runtime.model_consistency import check_same_step, frozen_code, param_group_settings
from .driver import InnerStepRounds, check_inner_optimizers, set_up, wait_pending
from .outer_step import step_with_outer_gradients
from .._runtime.mpi import communicator
from .._runtime.flat_buffers import write_back
from .._runtime.model_checks import trainable_parameters
from .._engines.progress import install_progress_hooks
from ..collectives.means import mean_over_ranks

__all__ = ["DiLoCo"]

# Elements per MPI call of a fragment's sync (chunks are all posted at once).
_CHUNK = 1 << 22


class DiLoCo(InnerStepRounds):
    """with DiLoCo(model, inner_optimizer, outer_optimizer, sync_every) as diloco:
    train as usual, stepping `inner_optimizer`; the syncs happen after its steps.

    model_fragments: modules whose trainable parameters partition the model's
    (default: the whole model, plain DiLoCo). comm: an mpi4py communicator
    (None: every rank). wire_dtype: None (float32), torch.bfloat16 or
    torch.float16 for the averaged outer gradients. sync_buffers (mpidp's
    addition, on by default): at a fragment's turn its floating-point buffers
    (BatchNorm's running statistics) become their mean over the ranks, so the
    replicas evaluate the shared parameters with statistics of the shared
    data rather than each its own (without it, a BatchNorm model evaluated
    right after a turn can be far worse than its training loss suggests). The outer optimizer must
    hold exactly the model's trainable parameters. Replicas start from rank
    0's parameters. state_dict() / load_state_dict() hold θ, this rank's
    replica, the step count, the outer optimizer's state and any outer
    gradient in flight, so a resumed job continues exactly (save the inner
    optimizer beside it; each rank saves its own). At another number of
    ranks, the ranks without a checkpoint of their own call
    load_shared_state() with any rank's.

    fragment_sync_delay: steps between posting a fragment's outer-gradient
    allreduce and applying it (0 .. sync_every - 1; the communication overlaps
    the inner steps in between, Streaming DiLoCo). fragment_update_alpha: in
    [0, 1], how much of the local weights a fragment keeps when its update is
    applied: x = (1 - alpha) theta_new + alpha x_local."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer, sync_every: int, comm=None, *,
                 model_fragments: Optional[Sequence[torch.nn.Module]] = None,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0,
                 wire_dtype: Optional[torch.dtype] = None, sync_buffers: bool = True):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        check_inner_optimizers(inner_optimizer)
        if not isinstance(outer_optimizer, torch.optim.Optimizer):
            raise TypeError("outer_optimizer: expected a torch.optim.Optimizer, got "
                            f"{type(outer_optimizer).__name__}")
        if isinstance(model_fragments, torch.nn.Module) and \
                not isinstance(model_fragments, torch.nn.ModuleList):
            raise TypeError("model_fragments: expected a list of modules (one per fragment), got "
                            f"the module {type(model_fragments).__name__}; wrap it: [module]")
        try:
            fragments = [model] if model_fragments is None else list(model_fragments)
        except TypeError:
            raise TypeError("model_fragments: expected a list of modules, got "
                            f"{type(model_fragments).__name__}") from None
        check_bool("sync_buffers", sync_buffers)
        self._fragments = self._partition(model, fragments)
        self._buffers = self._fragment_buffers(model, fragments) if sync_buffers else None
        n = len(fragments)
        if check_int("sync_every", sync_every, 1) % n:
            raise ValueError(f"sync_every: expected a positive multiple of the {n} fragment(s), "
                             f"got {sync_every!r}")
        every = sync_every // n
        if check_int("fragment_sync_delay", fragment_sync_delay, 0) >= every:
            raise ValueError(f"fragment_sync_delay: expected 0 .. {every - 1} (a fragment's send "
                             f"must come before its turn, every {every} steps), got "
                             f"{fragment_sync_delay!r}")
        check_real("fragment_update_alpha", fragment_update_alpha, 0.0, 1.0)
        params = [p for frag in self._fragments for p in frag]
        outer = [p for g in outer_optimizer.param_groups for p in g["params"]]
        if {id(p) for p in outer} != {id(p) for p in params} or len(outer) != len(params):
            raise ValueError("outer_optimizer: expected exactly the model's trainable parameters "
                             "(build it from model.parameters())")
        wire = wire_code(wire_dtype)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.outer_optimizer = outer_optimizer
        self.sync_every = sync_every
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = float(fragment_update_alpha)
        self.wire_dtype = wire_dtype
        self.sync_buffers = bool(sync_buffers)
        self._setup_settings = {
            "sync_every": sync_every, "fragments": len(self._fragments),
            "fragment_sync_delay": fragment_sync_delay,
            "fragment_update_alpha": float(fragment_update_alpha), "wire_dtype": wire_dtype,
            "sync_buffers": bool(sync_buffers)}
        # Claimed when entered: a DiLoCo is the model's algorithm inside its `with` block.
        self._communicator, self._trainable_at_setup = self._set_up(comm)
        self._comm = self._communicator.c
        self._schedule = {"n_fragments": n, "fragment_every": every,
                          "fragment_delay": fragment_sync_delay}
        self.step = 0  # inner steps taken under this DiLoCo
        self._wire = _C.DTYPE_F32 if wire == _C.NO_WIRE else wire
        self._syncs = self._make_syncs()
        for sync in self._syncs:
            sync.set_reference()
        # Fault-tolerant mode: a round (the hook after an inner step) under
        # way; each fragment sent and not yet applied: (its step, with
        # fragment_sync_delay the replica it sent, which the inner steps since
        # changed); the steps whose hooks a recovery left to redo (_catch_up).
        self._round_open = False
        self._unapplied: Dict[int, Tuple[int, Optional[List[torch.Tensor]]]] = {}
        self._redo_steps: List[int] = []
        self._outer_grads = [None] * n     # per fragment, allocated at its first sync
        self._sent: set = set()  # fragments sent and not yet applied
        self._received: Dict[int, List[torch.Tensor]] = {}  # outer gradients kept by state_dict
        self._handles: List = []
        # The inner step after the last turn applied: where every replica
        # goes back to when replacements join (recover(replace=True)).
        self._resume_step = 0
        if fault_tolerant_mode.joining():     # a replacement: the rest of rank 0's state
            self._take_shared_state(self._communicator.mpi.bcast(None, root=0))

    def _set_up(self, comm):
        return set_up(self.model, comm, "DiLoCo", settings=self._setup_settings,
                      rebuild="Build a new DiLoCo, its outer optimizer holding the parameters "
                              "trainable now, after such a change")

    def _make_syncs(self) -> List:
        return [_C.ParamSync(self._comm, tuple(p.data for p in frag), self._wire, _CHUNK,
                             what="DiLoCo outer-gradient sync")
                for frag in self._fragments]

    @staticmethod
    def _fragment_buffers(model, fragments) -> List[List[torch.Tensor]]:
        """Each fragment's floating-point buffers; buffers of the model outside
        every fragment go with every turn."""
        mine = [[b for b in f.buffers() if b.is_floating_point()] for f in fragments]
        claimed = {id(b) for bs in mine for b in bs}
        orphans = [b for b in model.buffers() if b.is_floating_point() and id(b) not in claimed]
        return [bs + orphans for bs in mine]

    @staticmethod
    def _partition(model, fragments) -> List[List[torch.nn.Parameter]]:
        if not fragments:
            raise ValueError("model_fragments: expected at least one module")
        seen: Dict[int, int] = {}
        out = []
        for i, frag in enumerate(fragments):
            if not isinstance(frag, torch.nn.Module):
                raise TypeError(f"model_fragments[{i}]: expected a torch.nn.Module, got "
                                f"{type(frag).__name__}")
            params = trainable_parameters(frag)
            for p in params:
                if id(p) in seen:
                    raise ValueError(f"model_fragments[{i}]: shares parameters with fragment "
                                     f"{seen[id(p)]} (fragments must not overlap)")
                seen[id(p)] = i
                if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                    raise TypeError(f"model: DiLoCo syncs contiguous float32 CPU parameters, got "
                                    f"{p.dtype} on {p.device}")
            out.append(params)
        own = {id(p) for p in trainable_parameters(model)}
        missing = sum(1 for i in own if i not in seen)
        foreign = sum(1 for i in seen if i not in own)
        if missing or foreign:
            raise ValueError(f"model_fragments: the fragments must cover the model's trainable "
                             f"parameters exactly ({missing} not covered, {foreign} not the "
                             f"model's)")
        return out

    # -- the context (driver.InnerStepContext's __enter__/__exit__) ----------------

    def _more_hooks(self) -> list:
        # Progress of the syncs in flight during the next inner phase.
        return install_progress_hooks(self.model, [p for f in self._fragments for p in f],
                                      self._syncs)

    # -- the driver interface (mpidp/algorithms/driver.py) ---------------------

    what = "DiLoCo"
    # θ is each rank's own (NoLoCo, eager DiLoCo): where replacements join,
    # the survivors keep theirs (and their outer optimizers) rather than
    # taking rank 0's.
    _theta_per_rank = False

    def drain(self) -> None:
        """Completes the outer-gradient syncs in flight (kept for their turns)."""
        self._catch_up()
        for f in sorted(self._sent):
            if f not in self._received:
                self._received[f] = [g.clone() for g in self._outer_gradient(f)]

    def _continue_on(self, survivors) -> None:
        """Fault-tolerant mode, after a rank was lost (mpidp.recover()): θ
        moves to syncs over the survivors and each keeps its replica. A
        fragment sent and not yet applied (its allreduce interrupted, or
        complete but not agreed) is sent again over the survivors, from the
        replica it was sent from, and a turn the loss cut short is then
        applied: the hooks of those steps are redone before the next
        forward (_catch_up). The inner step of a round the loss cut short
        stands, as every local step does.

        Where replacements joined (recover(replace=True)), every replica
        goes back to θ and the step after the last turn applied instead
        (_go_back_to_last_turn): a replacement can only start from θ, and
        the survivors, possibly a step apart, have no later point in
        common."""
        entered = bool(self._handles)
        if entered:
            self.__exit__(None, None, None)
        with torch.no_grad():
            local = [[p.detach().clone() for p in params] for params in self._fragments]
            for old in self._syncs:
                old.abandon()          # a sync in flight: recover() ended its requests
                old.restore()          # x = θ
        growing = fault_tolerant_mode.growing()
        if growing:    # the set-up the replacements run: rank 0's parameters (θ: restored above)
            own = ([[p.detach().clone() for p in params] for params in self._fragments]
                   if self._theta_per_rank else None)
            self._communicator, self._trainable_at_setup = self._set_up(survivors)
            if own is not None:      # each survivor keeps its θ; a replacement takes rank 0's
                with torch.no_grad():
                    for params, theta in zip(self._fragments, own):
                        for p, t in zip(params, theta):
                            p.copy_(t)
        else:
            self._communicator = communicator(survivors)
        self._comm = self._communicator.c
        self._syncs = self._make_syncs()
        for sync in self._syncs:
            sync.set_reference()       # θ, on the new syncs
        self._outer_grads = [None] * len(self._fragments)
        # Outer gradients a checkpoint brought (no send of this job's to
        # redo) stay; the rest are sent again.
        kept = {f: g for f, g in self._received.items() if f not in self._unapplied}
        self._sent, self._received = set(kept), kept
        if growing:
            self._go_back_to_last_turn()
            self._communicator.mpi.bcast(self._shared_state(), root=0)
        else:
            with torch.no_grad():
                for params, x in zip(self._fragments, local):
                    for p, v in zip(params, x):
                        p.copy_(v)
            # A redo an earlier recovery left and this loss cut short (before
            # its send, so _unapplied does not hold it) stays to do.
            redo = set(self._redo_steps) | {step for step, _ in self._unapplied.values()}
            if self._round_open:
                redo.add(self.step)
                self._round_open = False
                self.step += 1
                fault_tolerant_mode.commit_step()
            self._redo_steps = sorted(redo)
        if entered:
            self.__enter__()
        for p in self.model.parameters():     # the cut-short step's, spent
            p.grad = None

    def _go_back_to_last_turn(self) -> None:
        """Every survivor (replicas at θ already) back to the inner step
        after the last turn applied -- the same on each, as every turn is
        agreed -- with the sends since, and any redo, dropped: the schedule
        sends them again. The inner optimizers keep their state."""
        fault_tolerant_mode.roll_back_steps(self.step - self._resume_step)
        self.step = self._resume_step
        self._round_open = False
        self._unapplied, self._redo_steps = {}, []

    def _shared_state(self) -> Dict[str, Any]:
        """What a replacement takes beyond the parameters (rank 0's; equal on
        every survivor): the step, the outer optimizer, outer gradients a
        checkpoint brought."""
        if self._comm.rank != 0:
            return None
        return {"step": self.step, "outer_optimizer": self.outer_optimizer.state_dict(),
                "in_flight": self._received}

    def _take_shared_state(self, state: Dict[str, Any]) -> None:
        self.step = self._resume_step = int(state["step"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self._received = {int(f): [g.clone() for g in gs] for f, gs in state["in_flight"].items()}
        self._sent = set(self._received)

    def _takes_replacements(self) -> bool:
        return True       # from θ, at the step after the last turn (_continue_on)

    # -- the syncs (driver.InnerStepRounds runs a round after each inner step) -----

    def _round(self, step: int) -> None:
        """What the schedule does after inner step `step` (0-based): a
        fragment's send, a fragment's turn."""
        due = _C.avgsched_actions(step, **self._schedule)
        if due.send_fragment >= 0 or due.apply_fragment >= 0:
            # The outer optimizer steps the shared parameters: its settings must match.
            check_same_step(self._comm, step, self.what,
                            param_group_settings(self.outer_optimizer.param_groups)
                            + [("frozen parameters", frozen_code(self.model.parameters()))])
        if due.send_fragment >= 0:
            self._send(due.send_fragment, step)
        if due.apply_fragment >= 0:
            self._apply(due.apply_fragment)
            self._resume_step = step + 1

    def _send(self, f: int, step: int) -> None:
        """Posts fragment f's outer-gradient allreduce: from the replica it
        was first sent from where this is a recovery's redo."""
        params = self._fragments[f]
        if fault_tolerant_mode.enabled() and f not in self._unapplied:
            self._unapplied[f] = (step, None if self.fragment_sync_delay == 0
                                  else [p.detach().clone() for p in params])
        sent_from = self._unapplied.get(f, (step, None))[1]
        if sent_from is None or step == self.step:    # sent now, from the parameters
            self._syncs[f].send()
        else:
            with torch.no_grad():
                now = [p.detach().clone() for p in params]
                for p, x in zip(params, sent_from):
                    p.copy_(x)
                self._syncs[f].send()    # x - θ is packed here
                for p, x in zip(params, now):
                    p.copy_(x)
        self._sent.add(f)

    def _outer_gradient(self, f: int) -> List[torch.Tensor]:
        """Completes fragment f's sync: θ - mean(x) over the ranks."""
        if f in self._received:
            return self._received.pop(f)
        if self._outer_grads[f] is None:
            self._outer_grads[f] = [torch.empty_like(p) for p in self._fragments[f]]
        grads = self._outer_grads[f]
        self._syncs[f].grad_into(tuple(grads), -1.0 / self._comm.size)  # -(sum of x - θ) / n
        return grads

    def _apply(self, f: int) -> None:
        params, sync = self._fragments[f], self._syncs[f]
        grads = self._outer_gradient(f)
        buffers = self._buffers[f] if self._buffers is not None else []
        buffer_means = mean_over_ranks(buffers, self._comm) if buffers else None
        if fault_tolerant_mode.enabled():
            fault_tolerant_mode.agree_all_alive(f"{self.what} outer sync", "no rank applied it",
                                                self._communicator.mpi)
            self._unapplied.pop(f, None)
        self._sent.discard(f)
        alpha = self.fragment_update_alpha
        local = [p.detach().clone() for p in params] if alpha > 0.0 else None
        sync.restore()  # x = θ
        # The outer step sees this fragment's outer gradient only.
        step_with_outer_gradients(self.outer_optimizer, params, grads)
        sync.set_reference()  # θ = the outer step's result
        if local is not None:
            with torch.no_grad():
                for p, x in zip(params, local):
                    if p.requires_grad:
                        p.lerp_(x, alpha)
        if buffer_means is not None:
            write_back(buffer_means, buffers)

    # -- checkpoints ---------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """θ of every fragment, this rank's replica (so loading works before
        or after the model's own state), the step, the outer optimizer's
        state and the averaged outer gradients of syncs in flight (completed
        here)."""
        self.drain()
        in_flight = {f: [g.clone() for g in self._received[f]] for f in sorted(self._sent)}
        return {"step": self.step, "shared": [self._shared(f) for f in range(len(self._syncs))],
                "local": [[p.detach().clone() for p in frag] for frag in self._fragments],
                "outer_optimizer": self.outer_optimizer.state_dict(), "in_flight": in_flight}

    def _shared(self, f: int) -> List[torch.Tensor]:
        """θ of fragment f (read through restore, the parameters put back)."""
        params = self._fragments[f]
        with torch.no_grad():
            now = [p.detach().clone() for p in params]
            self._syncs[f].restore()
            shared = [p.detach().clone() for p in params]
            for p, x in zip(params, now):
                p.copy_(x)
        return shared

    def load_shared_state(self, state: Dict[str, Any]) -> None:
        """A job resumed at more ranks than saved it: a rank with no
        checkpoint of its own takes, from any rank's state_dict(), what the
        saved job's ranks shared -- θ, the step, the outer optimizer's
        state, the outer gradients of syncs in flight -- and starts as a
        replacement does when a job grows back: its replica at θ. The ranks
        that have a checkpoint load it with load_state_dict()."""
        if isinstance(state, dict) and "shared" in state:
            state = dict(state, local=[[t.clone() for t in frag] for frag in state["shared"]])
        self.load_state_dict(state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores θ and this rank's replica (construction made the replicas
        rank 0's), the step, the outer optimizer and syncs in flight."""
        for key in ("shared", "local"):
            values = state[key]
            if len(values) != len(self._fragments) or any(
                    len(v) != len(f) or any(a.shape != p.shape for a, p in zip(v, f))
                    for v, f in zip(values, self._fragments)):
                raise ValueError(f"state: its {key!r} fragments do not match this DiLoCo's")
        wait_pending(self._syncs)
        with torch.no_grad():
            for f, params in enumerate(self._fragments):
                for p, x in zip(params, state["shared"][f]):
                    p.copy_(x)
                self._syncs[f].set_reference()
                for p, x in zip(params, state["local"][f]):
                    p.copy_(x)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.step = self._resume_step = int(state["step"])
        self._received = {int(f): [g.clone() for g in gs] for f, gs in state["in_flight"].items()}
        self._sent = set(self._received)
        self._unapplied, self._redo_steps = {}, []
