"""MuLoCo over MPI (arXiv 2505.23725): DiLoCo whose outer gradient is
compressed with error feedback -- to 2-bit codes of every entry by
default, or to the top entries of each tile -- and whose inner optimizer
is Muon (the user's: torch.optim.Muon for the matrices beside AdamW for the
rest, passed as a list).

Every `sync_every` inner steps each rank takes its outer gradient Δ = θ̃ - x
(θ̃ the shared weights, x its replica), folds it into its error-feedback
buffer e ← βe + ηΔ (η: the outer optimizer's learning rate of the tensor's
param group), sends e compressed and keeps what it did not send in e. The
ranks' payloads are gathered and decoded in rank order into their mean G
(divided by every rank), the outer optimizer (SGD with Nesterov momentum in
the paper) steps θ̃ with G as its gradient, and every replica restarts from
θ̃: the same bits on every rank.

The round, the wire, checkpoints and fault tolerance are SparseLoCo's
(sparseloco.py); MuLoCo changes the compression's reach (dense by default),
the mean (over every rank) and the outer step (the user's outer optimizer,
whose state travels with checkpoints and to replacements)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .._runtime.args import check_int
from .._runtime.model_consistency import frozen_code, param_group_settings
from .outer_step import step_with_outer_gradients
from .sparseloco import SparseLoCo

__all__ = ["MuLoCo"]


class MuLoCo(SparseLoCo):
    """with MuLoCo(model, inner_optimizer, outer_optimizer, sync_every) as muloco:
    train as usual, stepping the inner optimizer(s); the syncs happen after
    their steps.

    inner_optimizer: an optimizer or a list of them that together make one
    inner step (the paper's: torch.optim.Muon over the 2-D weights, AdamW
    over the rest); the round runs once each has stepped. outer_optimizer:
    holds exactly the model's trainable parameters (the paper's:
    torch.optim.SGD(lr=0.8, momentum=0.9, nesterov=True)); its learning rate
    also scales Δ into the error feedback, as in the authors' code.

    Compression (the paper's two, with error feedback): top_k None (the
    default) sends every entry, quantization_bins 4 (2-bit codes) over
    quantization_range 6 standard deviations of each tensor; top_k k sends
    the k entries of largest magnitude of each chunk_size x chunk_size tile
    (a tile of another size keeps the same share) -- quantized, or as
    float32 with quantization_bins None. error_decay: β (0.9, the paper's).

    comm, sync_buffers, sync_delay, bytes_sent, state_dict() and the checks
    at every sync are SparseLoCo's; state_dict() also holds the outer
    optimizer's state."""

    what = "MuLoCo"

    def __init__(self, model: torch.nn.Module,
                 inner_optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
                 outer_optimizer: torch.optim.Optimizer, sync_every: int, comm=None, *,
                 error_decay: float = 0.9, top_k: Optional[int] = None, chunk_size: int = 64,
                 quantization_bins: Optional[int] = 4, quantization_range: float = 6.0,
                 sync_buffers: bool = True, sync_delay: int = 0):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(outer_optimizer, torch.optim.Optimizer):
            raise TypeError("outer_optimizer: expected a torch.optim.Optimizer, got "
                            f"{type(outer_optimizer).__name__}")
        trainable = [p for p in model.parameters() if p.requires_grad]
        outer = [p for g in outer_optimizer.param_groups for p in g["params"]]
        if {id(p) for p in outer} != {id(p) for p in trainable} or len(outer) != len(trainable):
            raise ValueError("outer_optimizer: expected exactly the model's trainable parameters "
                             "(build it from model.parameters())")
        self.dense = top_k is None
        if not self.dense:
            check_int("top_k", top_k, 1)
        if quantization_bins is not None:
            check_int("quantization_bins", quantization_bins, 2)
        self.outer_optimizer = outer_optimizer
        super().__init__(model, inner_optimizer, sync_every, comm,
                         error_decay=error_decay, top_k=1 if self.dense else top_k,
                         chunk_size=chunk_size, use_quantization=quantization_bins is not None,
                         quantization_bins=4 if quantization_bins is None else quantization_bins,
                         quantization_range=quantization_range, mean="all",
                         sync_buffers=sync_buffers, sync_delay=sync_delay)
        if self.dense:
            self.top_k = None

    def _k_of(self, length: int) -> int:
        return length if self.dense else super()._k_of(length)

    def _settings_dict(self) -> Dict[str, Any]:
        settings = {k: v for k, v in super()._settings_dict().items()
                    if k not in ("lr", "weight_decay", "mean")}
        settings["top_k"] = self.top_k if not self.dense else None
        settings.update(param_group_settings(self.outer_optimizer.param_groups))
        return settings

    def _settings(self) -> List[Tuple[str, float]]:
        return ([("sync_every", float(self.sync_every)), ("sync_delay", float(self.sync_delay)),
                 ("error_decay", self.error_decay),
                 ("top_k", 0.0 if self.dense else float(self.top_k)),
                 ("quantization_bins", float(self._bins())),
                 ("quantization_range", self.quantization_range),
                 ("frozen parameters", frozen_code(self.params))]
                + param_group_settings(self.outer_optimizer.param_groups))

    def _ef_alphas(self) -> List[float]:
        lr = {id(p): float(g["lr"]) for g in self.outer_optimizer.param_groups
              for p in g["params"]}
        return [lr[id(p)] for p in self.params]

    @torch.no_grad()
    def _outer_step(self, means: List[torch.Tensor]) -> None:
        """The outer optimizer steps θ̃ with G as its gradient, on the
        parameters, which hold θ̃ for it (a frozen one keeps θ̃ and its
        momentum)."""
        for p, theta in zip(self.params, self.shared):
            p.copy_(theta)
        step_with_outer_gradients(self.outer_optimizer, self.params, means)
        for p, theta in zip(self.params, self.shared):
            theta.copy_(p)

    # -- what a replacement and a checkpoint take beyond SparseLoCo's -----------------

    def _shared_state(self) -> Optional[Dict[str, Any]]:
        state = super()._shared_state()
        if state is not None:
            state["outer_optimizer"] = self.outer_optimizer.state_dict()
        return state

    def _take_shared_state(self, state: Dict[str, Any]) -> None:
        super()._take_shared_state(state)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])

    def state_dict(self) -> Dict[str, Any]:
        """SparseLoCo's (θ̃, this rank's replica and error feedback, the
        step, a sync in flight) and the outer optimizer's state."""
        state = super().state_dict()
        state["outer_optimizer"] = self.outer_optimizer.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict) or "outer_optimizer" not in state:
            raise ValueError("state: expected a MuLoCo state_dict (with 'outer_optimizer')")
        super().load_state_dict({k: v for k, v in state.items() if k != "outer_optimizer"})
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
