"""The interface every algorithm of mpidp.algorithms implements (Bagua's API).

`_attach(module, optimizers, comm)` installs what averages the gradients (or
weights) from then on and returns a handle with `forward(*inputs, **kwargs)`,
`drain()` (finish pending communication), `detach()` (remove every hook: the
module is a plain module again) and the algorithm's own `state_dict()` /
`load_state_dict()`. mpidp.with_bagua drives it: attach, and on a switch
drain, detach, broadcast rank 0's state, attach the next.
"""

from __future__ import annotations

from typing import List

import torch


class Algorithm:
    """Base class of mpidp's Bagua algorithms."""

    def _attach(self, module: torch.nn.Module, optimizers: List[torch.optim.Optimizer], comm):
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"

