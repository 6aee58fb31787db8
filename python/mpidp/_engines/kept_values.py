"""Tensors' values kept, to be put back.

Fault-tolerant DASO (algorithms/daso.py) keeps the parameters (and the
buffers, where they follow rank 0's) before the collectives of a step that
write them -- a global sync's merge, a node broadcast -- and puts them back
when a rank was lost before every rank completed those writes. Kept on
every such step, so the copy must cost little next to the step: one fused
copy into buffers kept from step to step, made again only for other
tensors (a tensor resized in place makes the copy raise, not go wrong)."""

from __future__ import annotations

from typing import List, Sequence

import torch


class KeptValues:
    def __init__(self):
        self._tensors: List[torch.Tensor] = []
        self._copies: List[torch.Tensor] = []

    def keep(self, tensors: Sequence[torch.Tensor]) -> None:
        """Keep the values `tensors` hold now (the tensors themselves are
        what put_back() writes)."""
        tensors = list(tensors)
        same = len(tensors) == len(self._tensors) and all(
            a is b for a, b in zip(tensors, self._tensors))
        if not same:
            self._copies = [torch.empty_like(t, requires_grad=False) for t in tensors]
            self._tensors = tensors
        if tensors:
            with torch.no_grad():
                torch._foreach_copy_(self._copies, tensors)

    def put_back(self) -> None:
        """Write the values keep() kept back into its tensors."""
        if self._tensors:
            with torch.no_grad():
                torch._foreach_copy_(self._tensors, self._copies)
