"""Outer weights that are each rank's own (NoLoCo, eager DiLoCo): the
counterpart, in Python, of what the core's ParamSync keeps for DiLoCo --
θ beside the parameters, set from them and put back into them -- for the
algorithms whose θ no two ranks need share."""

from __future__ import annotations

from typing import Sequence

import torch


class RankTheta:
    """This rank's θ for `params` (the calls DiLoCo makes of a sync's θ)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self._params = list(params)
        self._theta = [torch.empty_like(p) for p in self._params]

    def set_reference(self) -> None:
        """θ = the parameters."""
        with torch.no_grad():
            for t, p in zip(self._theta, self._params):
                t.copy_(p)

    def restore(self) -> None:
        """The parameters = θ."""
        with torch.no_grad():
            for p, t in zip(self._params, self._theta):
                p.copy_(t)
