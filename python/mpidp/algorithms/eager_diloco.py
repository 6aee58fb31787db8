"""DiLoCo with eager outer updates over MPI (arXiv 2502.12996, "1-outer-step
eager"): the outer gradients' all-reduce runs through the whole next inner
phase, and no rank waits for it at a sync.

At sync t every rank m has its outer gradient Δ_t^m = θ^m - x^m (its θ
minus its replica). It posts the all-reduce of Δ_t^m at once and steps its
own θ^m with

    Δ̂_t^m = Ḡ_{t-1} + (Δ_t^m - Δ_{t-1}^m) / M

where Ḡ_{t-1} is the mean of the previous sync's outer gradients (whose
all-reduce the inner phase just ended had to complete) and M the number of
ranks: the previous round's mean with this rank's own term replaced by its
fresh one -- the local outer gradient standing in for the others' until
their all-reduce arrives. Every Δ thus enters the outer step once, with
weight 1/M; the replicas' θ differ by their own fresh terms, so θ and the
outer optimizer are each rank's own. The first sync has no previous round
(Ḡ_0 = Δ_0 = 0). The paper gives the rule in words and a figure; the
formula above is our reading of it (docs/algorithms.md).

The rest is DiLoCo's (diloco.py): inner steps, set-up and per-sync checks,
checkpoints (Δ_{t-1}^m and Ḡ_{t-1} go in them; resume at more ranks with
load_shared_state: a new rank's Δ_{t-1} is zero) and fault tolerance: a
sync is agreed before any rank applies it, and after a loss -- in an inner
phase, with the all-reduce in flight, or in a sync -- the survivors post
the last applied round's all-reduce again over themselves (the lost rank's
Δ leaves with it) and redo an interrupted sync. Where replacements join,
each survivor keeps its θ, outer optimizer and Δ; a replacement starts from
rank 0's θ and outer optimizer and adds nothing to that round's mean."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from .. import _C
from .._runtime.dtypes import wire_code
from .._runtime.flat_buffers import flatten, write_back
from .diloco import DiLoCo
from .driver import set_up
from .rank_theta import RankTheta

__all__ = ["EagerDiLoCo"]


class _EagerSync(RankTheta):
    """Eager DiLoCo's counterpart of the core's ParamSync (the calls DiLoCo
    makes of it): this rank's θ, its outer gradient of the last round
    applied, and that round's all-reduce, in flight until the next sync."""

    def __init__(self, comm, params: Sequence[torch.Tensor], wire: int):
        super().__init__(params)
        self._comm, self._wire = comm, wire
        n = sum(p.numel() for p in self._params)
        self._last = torch.zeros(n)       # Δ_{t-1}: this rank's, of the last round applied
        self._mean = torch.zeros(n)       # Ḡ_{t-1}, once its all-reduce completed
        self._now: Optional[torch.Tensor] = None    # Δ_t, from send() to commit()
        # The all-reduce: [Σ Δ_{t-1}, the number of ranks that added one]
        # (a replacement that joined adds none).
        self._flight = torch.zeros(n + 1)
        self._work = None
        self.rounds = 0                   # rounds applied: none yet means Ḡ = 0

    @property
    def pending(self) -> bool:
        return self._work is not None

    def test(self) -> None:
        if self._work is not None:
            self._work.is_completed()

    def wait(self) -> None:
        """Completes the last round's all-reduce: Ḡ_{t-1}."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            n = self._mean.numel()
            torch.div(self._flight[:n], max(float(self._flight[n]), 1.0), out=self._mean)

    def abandon(self) -> None:
        """Forgets an all-reduce whose requests recover() ended."""
        self._work = None

    def send(self) -> None:
        """This round's Δ_t = θ - x (its all-reduce is posted by commit(),
        once the round is applied)."""
        self.wait()
        self._now = flatten(self._theta) - flatten([p.detach() for p in self._params])

    def outer_gradient(self) -> List[torch.Tensor]:
        """Δ̂_t = Ḡ_{t-1} + (Δ_t - Δ_{t-1}) / M, in the parameters' shapes."""
        eager = self._mean + (self._now - self._last) / self._comm.size
        grads = [torch.empty_like(p) for p in self._params]
        write_back(eager, grads)
        return grads

    def commit(self) -> None:
        """The round is applied: its Δ becomes the last, and its all-reduce
        goes on through the next inner phase."""
        self._last, self._now = self._now, None
        self.rounds += 1
        self.post(contribute=True)

    def post(self, contribute: bool) -> None:
        """Posts the last round's all-reduce (again, over the survivors, after
        a loss); a replacement that joined adds zeros and no count."""
        n = self._last.numel()
        if contribute:
            self._flight[:n].copy_(self._last)
        else:
            self._flight.zero_()
        self._flight[n] = 1.0 if contribute else 0.0
        self._work = self._comm.allreduce(self._flight, _C.OP_SUM, self._wire, True)

    def state(self) -> Dict[str, Any]:
        self.wait()
        return {"last": self._last.clone(), "mean": self._mean.clone(), "rounds": self.rounds}

    def load(self, state: Dict[str, Any]) -> None:
        if state["last"].shape != self._last.shape:
            raise ValueError("state: its 'eager' outer gradients do not match this model's")
        self._work, self._now = None, None
        self._last = state["last"].clone()
        self._mean.copy_(state["mean"])
        self.rounds = int(state["rounds"])


class EagerDiLoCo(DiLoCo):
    """with EagerDiLoCo(model, inner_optimizer, outer_optimizer, sync_every) as diloco:
    train as usual, stepping the inner optimizer(s); the syncs happen after
    their steps and never wait for the ranks' all-reduce, which overlaps the
    next inner phase (see the module's docstring for the rule).

    inner_optimizer: an optimizer or a list of them that together make one
    inner step. outer_optimizer: this rank's, holding exactly the model's
    trainable parameters (DiLoCo's: torch.optim.SGD(lr=0.7, momentum=0.9,
    nesterov=True)). comm: an mpi4py communicator (None: every rank).
    wire_dtype: None (float32), torch.bfloat16 or torch.float16 for the
    outer gradients' all-reduce. sync_buffers: as DiLoCo's (BatchNorm's
    statistics become the ranks' mean at each sync). model_fragments:
    Streaming DiLoCo's (modules whose trainable parameters partition the
    model's), taking turns one every sync_every / len(model_fragments)
    steps, each with its own rounds: its θ, Δ and mean (the paper combines
    the two). A fragment's all-reduce runs until its next turn, so there is
    no fragment_sync_delay."""

    what = "EagerDiLoCo"
    _theta_per_rank = True

    def __init__(self, model: torch.nn.Module,
                 inner_optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
                 outer_optimizer: torch.optim.Optimizer, sync_every: int, comm=None, *,
                 wire_dtype: Optional[torch.dtype] = None, sync_buffers: bool = True,
                 model_fragments: Optional[Sequence[torch.nn.Module]] = None):
        super().__init__(model, inner_optimizer, outer_optimizer, sync_every, comm,
                         model_fragments=model_fragments, wire_dtype=wire_dtype,
                         sync_buffers=sync_buffers)

    def _set_up(self, comm):
        return set_up(self.model, comm, self.what,
                      settings={"sync_every": self.sync_every, "wire_dtype": self.wire_dtype,
                                "sync_buffers": self.sync_buffers,
                                "fragments": len(self._fragments)},
                      rebuild="Build a new EagerDiLoCo, its outer optimizer holding the "
                              "parameters trainable now, after such a change")

    def _make_syncs(self) -> List[_EagerSync]:
        syncs = [_EagerSync(self._comm, [p.data for p in frag], wire_code(self.wire_dtype))
                 for frag in self._fragments]
        # A recovery's new syncs (over the survivors): each rank's Δ and
        # round count carry over.
        for sync, old in zip(syncs, getattr(self, "_syncs", ())):
            sync._last, sync.rounds = old._last, old.rounds
        return syncs

    def _outer_gradient(self, f: int) -> List[torch.Tensor]:
        return self._syncs[f].outer_gradient()

    def _apply(self, f: int) -> None:
        super()._apply(f)
        self._syncs[f].commit()

    def drain(self) -> None:
        """Completes the last round's all-reduce (kept for the next sync)."""
        super().drain()
        for sync in self._syncs:
            sync.wait()

    # -- fault tolerance -----------------------------------------------------------

    def _continue_on(self, survivors) -> None:
        """DiLoCo's recovery (an interrupted sync redone over the survivors;
        where replacements join, each survivor keeps its own θ), then the
        last applied round's all-reduce posted again over the survivors, who
        keep their Δ: the lost rank's leaves with it."""
        super()._continue_on(survivors)
        for sync in self._syncs:        # their Δ and rounds: carried over by _make_syncs
            if sync.rounds:
                sync.post(contribute=True)

    def _shared_state(self) -> Optional[Dict[str, Any]]:
        state = super()._shared_state()
        if state is not None:
            state["eager_rounds"] = [s.rounds for s in self._syncs]
        return state

    def _take_shared_state(self, state: Dict[str, Any]) -> None:
        """A replacement: rank 0's step and outer optimizer (DiLoCo's), no Δ
        of its own, and its part (none) in the survivors' all-reduce."""
        super()._take_shared_state(state)
        for sync, rounds in zip(self._syncs, state["eager_rounds"]):
            sync.rounds = int(rounds)
            if sync.rounds:
                sync.post(contribute=False)

    # -- checkpoints ---------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """DiLoCo's (this rank's θ), with this rank's last Δ and the last
        round's mean."""
        return dict(super().state_dict(), eager=[s.state() for s in self._syncs])

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "eager" not in state or len(state["eager"]) != len(self._syncs):
            raise ValueError("state: not an EagerDiLoCo's state_dict() (no 'eager' entry)")
        super().load_state_dict(state)
        for sync, s in zip(self._syncs, state["eager"]):
            sync.load(s)

    def load_shared_state(self, state: Dict[str, Any]) -> None:
        """DiLoCo's (the saved rank's θ as this rank's θ and replica), with
        no Δ of this rank's in the last round: Ḡ stays the saved job's."""
        if isinstance(state, dict) and "eager" in state:
            state = dict(state, eager=[dict(s, last=torch.zeros_like(s["last"]))
                                       for s in state["eager"]])
        super().load_shared_state(state)
