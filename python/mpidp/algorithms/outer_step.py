"""The outer step of the algorithms whose outer optimizer is the user's
(DiLoCo, MuLoCo): the optimizer steps with outer gradients in place of the
gradients the user's backward left, which are put back afterwards."""

from __future__ import annotations

from typing import Sequence

import torch


def step_with_outer_gradients(optimizer: torch.optim.Optimizer,
                              params: Sequence[torch.nn.Parameter],
                              grads: Sequence[torch.Tensor]) -> None:
    """optimizer.step() seeing grads[i] as params[i]'s gradient, and none
    for its other parameters (a fragment's turn steps that fragment alone).
    A frozen parameter gets no outer gradient, so the outer optimizer
    leaves it (and its momentum) where it is, as torch's optimizers do."""
    saved = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]]
    mine = {id(p): g for p, g in zip(params, grads) if p.requires_grad}
    try:
        for p, _ in saved:
            p.grad = mine.get(id(p))
        optimizer.step()
    finally:
        for p, g in saved:
            p.grad = g
