"""DES-LOC over MPI (Iacob et al., "Desynced Low Communication Adaptive
Optimizers", arXiv 2505.22549, ICLR 2026): Local Adam whose three states
are averaged on periods of their own.

Every rank steps its replica with its own Adam (or AdamW). After every
`param_every`-th step the parameters become their mean over the ranks;
after every `exp_avg_every`-th step Adam's first moments do; after every
`exp_avg_sq_every`-th step its second moments do. The moments change more
slowly than the parameters (their half-lives, ln 0.5 / ln β), so they can
be averaged less often: the paper recommends 3 and 6 times the parameters'
period (the defaults here). With the three periods equal it is Local Adam.

The paper writes each average as taken before the step whose number the
period divides; here it is taken after the step that completes the period
-- the same averages, one step's index apart. The tensors due at a step
travel in one all-reduce (the core's, through collectives/means). Buffers
(BatchNorm's statistics) stay each replica's own.

Fault-tolerant mode: a sync is agreed before any rank takes it, so one a
loss interrupted is taken by no survivor and done again over the
survivors; the lost rank's replica and Adam state leave with it. Where
replacements join (recover(replace=True)), each survivor keeps its
replica and Adam state; a replacement starts from rank 0's parameters
(set-up) and, through share_state(), its Adam state, and takes part in
the interrupted sync."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .._runtime import fault_tolerant_mode
from .._runtime.args import check_int
from .._runtime.model_checks import trainable_parameters
from .._runtime.model_consistency import check_same_step, frozen_code, param_group_settings
from .._runtime.mpi import communicator
from ..collectives.means import average_tensors
from .driver import InnerStepRounds, set_up

__all__ = ["DESLOC"]

# Adam's states that DES-LOC averages, by the setting that gives their period.
_MOMENTS = (("exp_avg_every", "exp_avg"), ("exp_avg_sq_every", "exp_avg_sq"))


class DESLOC(InnerStepRounds):
    """with DESLOC(model, optimizer, param_every) as desloc:
    train as usual, stepping `optimizer`; the averages happen after its
    steps (see the module's docstring for the rule).

    optimizer: a torch.optim.Adam or AdamW (amsgrad off) stepping the
    model's parameters. param_every, exp_avg_every, exp_avg_sq_every: the
    periods, in steps, of the parameters', the first moments' and the
    second moments' averages (defaults: 3 and 6 times param_every; all
    equal: Local Adam). comm: an mpi4py communicator (None: every rank).
    Replicas start from rank 0's parameters. state_dict() holds the step
    count and this rank's replica (so that loading it works before or after
    the model's own state, which the set-up replaced with rank 0's); save
    the optimizer beside it (each rank its own)."""

    what = "DESLOC"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 param_every: int, comm=None, *, exp_avg_every: Optional[int] = None,
                 exp_avg_sq_every: Optional[int] = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError("optimizer: expected a torch.optim.Adam or AdamW (DES-LOC averages "
                            f"Adam's moments), got {type(optimizer).__name__}")
        if any(g.get("amsgrad") for g in optimizer.param_groups):
            raise ValueError("optimizer: amsgrad keeps a running maximum of the second moments, "
                             "which DES-LOC does not average; build it with amsgrad=False")
        check_int("param_every", param_every, 1)
        self.param_every = param_every
        self.exp_avg_every = check_int("exp_avg_every", 3 * param_every if exp_avg_every is None
                                       else exp_avg_every, 1)
        self.exp_avg_sq_every = check_int(
            "exp_avg_sq_every", 6 * param_every if exp_avg_sq_every is None
            else exp_avg_sq_every, 1)
        self.model = model
        self.inner_optimizer = optimizer
        self._communicator, self._trainable_at_setup = self._set_up(comm)
        self._comm = self._communicator.c
        self.step = 0          # optimizer steps taken under this DESLOC
        self._round_open = False
        self._redo_steps: List[int] = []
        self._handles: List = []
        if fault_tolerant_mode.joining():     # a replacement: rank 0's step and round
            self._take_shared_state(self._communicator.mpi.bcast(None, root=0))

    def _set_up(self, comm):
        return set_up(self.model, comm, self.what,
                      settings={"param_every": self.param_every,
                                "exp_avg_every": self.exp_avg_every,
                                "exp_avg_sq_every": self.exp_avg_sq_every},
                      rebuild="Build a new DESLOC after such a change")

    @property
    def periods(self) -> Dict[str, int]:
        return {"param_every": self.param_every, "exp_avg_every": self.exp_avg_every,
                "exp_avg_sq_every": self.exp_avg_sq_every}

    # -- the averages (driver.InnerStepRounds runs a round after each step) --------

    def _due(self, step: int) -> List[torch.Tensor]:
        """The tensors averaged after optimizer step `step` (0-based): the
        trainable parameters, and Adam's moments of the trainable parameters
        it has stepped, as their periods divide step + 1 (a frozen layer's
        stay where they are)."""
        n = step + 1
        tensors = list(trainable_parameters(self.model)) if n % self.param_every == 0 else []
        for setting, key in _MOMENTS:
            if n % getattr(self, setting) == 0:
                tensors += [s[key] for g in self.inner_optimizer.param_groups for p in g["params"]
                            if p.requires_grad
                            for s in [self.inner_optimizer.state.get(p, {})] if key in s]
        return tensors

    def _round(self, step: int) -> None:
        """The averages due after step `step`."""
        if not any((step + 1) % every == 0 for every in self.periods.values()):
            return
        tensors = self._due(step)
        # Every rank must average the same elements: the same frozen layers,
        # moments for the same parameters, the optimizer's settings alike.
        check_same_step(self._comm, step, self.what,
                        param_group_settings(self.inner_optimizer.param_groups)
                        + [("frozen parameters", frozen_code(self.model.parameters())),
                           ("elements averaged", sum(t.numel() for t in tensors))])
        with torch.no_grad():
            average_tensors(tensors, self._comm, self._communicator.mpi)

    def drain(self) -> None:
        """Takes an average a recovery left to redo (nothing is in flight
        otherwise)."""
        self._catch_up()

    # -- fault tolerance -----------------------------------------------------------

    def _continue_on(self, survivors) -> None:
        """Fault-tolerant mode, after a rank was lost (mpidp.recover()): the
        averages move to the survivors, each keeping its replica and Adam
        state; an average the loss interrupted (taken by no rank: it is
        agreed first) is done again before the next forward (_catch_up).
        Where replacements joined, the set-up gives them rank 0's
        parameters; each survivor keeps its own."""
        entered = bool(self._handles)
        if entered:
            self.__exit__(None, None, None)
        if fault_tolerant_mode.growing():
            own = [p.detach().clone() for p in self.model.parameters()]
            self._communicator, self._trainable_at_setup = self._set_up(survivors)
            with torch.no_grad():
                for p, x in zip(self.model.parameters(), own):
                    p.copy_(x)
            self._communicator.mpi.bcast(self._shared_state(), root=0)
        else:
            self._communicator = communicator(survivors)
        self._comm = self._communicator.c
        self._open_round_to_redo()
        if entered:
            self.__enter__()
        for p in self.model.parameters():     # the cut-short step's, spent
            p.grad = None

    def _open_round_to_redo(self) -> None:
        """The round a loss cut short: its step stands (as every local step
        does) and its average is done again."""
        if self._round_open:
            self._redo_steps.append(self.step)
            self._round_open = False
            self.step += 1
            fault_tolerant_mode.commit_step()

    def _shared_state(self) -> Optional[Dict[str, Any]]:
        if self._comm.rank != 0:
            return None
        return {"step": self.step, "round_open": self._round_open,
                "redo": list(self._redo_steps)}

    def _take_shared_state(self, state: Dict[str, Any]) -> None:
        """A replacement: rank 0's step, and the average it must redo with
        the survivors."""
        self.step = int(state["step"])
        self._redo_steps = [int(s) for s in state["redo"]]
        if state["round_open"]:
            self._redo_steps.append(self.step)
            self.step += 1

    def _takes_replacements(self) -> bool:
        return True

    # -- checkpoints ---------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The step count (the schedule's place) and this rank's replica;
        Adam's state is the optimizer's own."""
        self.drain()
        return {"step": self.step, **self.periods,
                "replica": [p.detach().clone() for p in self.model.parameters()]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The step and the replica (a new rank of a job resumed at more
        ranks loads any rank's)."""
        saved = {k: state.get(k) for k in self.periods}
        if saved != self.periods:
            raise ValueError(f"state: saved with the periods {saved}, this DESLOC has "
                             f"{self.periods}")
        params = list(self.model.parameters())
        if len(state["replica"]) != len(params) or any(
                x.shape != p.shape for x, p in zip(state["replica"], params)):
            raise ValueError("state: its replica does not match this model's parameters")
        with torch.no_grad():
            for p, x in zip(params, state["replica"]):
                p.copy_(x)
        self.step = int(state["step"])
        self._redo_steps, self._round_open = [], False
