"""Which gradient hook DataParallel registers: the C++ one (mpidp._grad_hook,
csrc/torch/grad_hook.cpp) where it was built for the running torch, else a
Python-level post-accumulate-grad hook per parameter (the same decisions,
csrc/py/reducer_pass.c, at a Python call per parameter per backward)."""

from __future__ import annotations

import functools
from typing import Optional, Tuple

from .._runtime import config as _config


@functools.lru_cache(maxsize=None)
def _load() -> Tuple[Optional[object], str]:
    try:
        from .. import _grad_hook
    except ImportError as exc:
        # Not built (MPIDP_TORCH_HOOK=0, or no torch at build time), or built
        # for another torch (the message says which).
        return None, str(exc) or type(exc).__name__
    return _grad_hook, "built for this torch"


def cpp_hook_module() -> Optional[object]:
    """mpidp._grad_hook when MPIDP_GRAD_HOOK=cpp (the default) and it loads, else None."""
    if _config.get("MPIDP_GRAD_HOOK") != "cpp":
        return None
    return _load()[0]


def describe() -> str:
    """One line for `python -m mpidp`: which hook runs and why."""
    module, why = _load()
    if _config.get("MPIDP_GRAD_HOOK") == "python":
        return "python (MPIDP_GRAD_HOOK=python)"
    return "cpp (mpidp._grad_hook)" if module else f"python (C++ hook unavailable: {why})"
