"""Hooks that progress asynchronous syncs during training.

A sync posted at one step and completed steps later (DASO's global average,
Streaming DiLoCo's fragments) moves its bytes over TCP only inside MPI calls:
without any, nothing would happen until the completion waits. So every
submodule's forward and every parameter's gradient accumulation test the
syncs in flight (one MPI_Test each while pending, a boolean check
otherwise); docs/design-notes.md has what they gain. MPIDP_HOOK_PROGRESS=0
(`_C.configure(hook_progress=False)`) turns them off."""

from __future__ import annotations

from typing import List, Sequence

import torch

from .. import _C
from . import module_hooks


def install_progress_hooks(model: torch.nn.Module, params: Sequence[torch.Tensor],
                           syncs: Sequence["_C.ParamSync"]) -> List:
    """The hook handles (remove them with hook_handles.remove_handles)."""
    if not syncs or not _C.process_state()["hook_progress"]:
        return []
    syncs = tuple(syncs)

    def progress(*_):
        for sync in syncs:
            if sync.pending:
                sync.test()

    return ([module_hooks.register(m, "register_forward_pre_hook", progress)
             for m in model.modules()] +
            [p.register_post_accumulate_grad_hook(progress) for p in params])
