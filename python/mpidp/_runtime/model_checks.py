"""Checks of the model a wrapper is given: floating-point parameters
(check_module), which parameters are trainable (trainable_parameters,
float32_cpu_trainable), and that the trainable set stays what it was at
set-up (TrainableAtSetup); name_list names parameters in messages."""

from __future__ import annotations

from typing import List

import torch

from .dtypes import CODE_OF

__all__ = ["check_module", "trainable_parameters", "float32_cpu_trainable", "name_list",
           "TrainableAtSetup"]

FLOAT_DTYPES = tuple(CODE_OF)


def check_module(module, argname: str = "module") -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{argname}: expected a torch.nn.Module, got {type(module).__name__}")
    for name, p in module.named_parameters():
        if p.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{argname}: parameter {name!r} has dtype {p.dtype}; data-parallel "
                             "training averages floating-point parameters only (float32, float64, "
                             "bfloat16, float16)")


def trainable_parameters(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The parameters of `module` that require grad, in its order."""
    return [p for p in module.parameters() if p.requires_grad]


def float32_cpu_trainable(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """trainable_parameters, refused unless each is float32 on the CPU (what
    the decentralized algorithms and asynchronous averaging average)."""
    params = trainable_parameters(module)
    for p in params:
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise TypeError(f"module: decentralized algorithms average float32 CPU parameters, "
                            f"got {p.dtype} on {p.device}")
    return params


def name_list(names, most: int = 4) -> str:
    """'a', 'b', 'c', 'd' and 3 more: parameter names for an error message."""
    shown = ", ".join(map(repr, names[:most]))
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


# Counts every parameter and submodule registration of any module (torch's
# global registration hooks), so that a wrapper rescans its model only when
# some model changed: a step costs one integer comparison otherwise.
_registrations = 0


def _count_registration(*_hook_args) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


class TrainableAtSetup:
    """What a wrapper averages is the set of parameters trainable when it was
    set up. A parameter outside that set that requires grad later -- one
    frozen then and unfrozen since (progressive unfreezing), or one added
    since (a new head: model.fc = nn.Linear(...)) -- would train on each
    rank's own gradients and the replicas would drift apart with no error;
    torch DDP lets that happen. The wrapper calls check() once a training
    step and it raises instead: a scan of the parameters outside the set
    (nothing when there are none), and of the whole model only after some
    module registered a parameter or a submodule."""

    def __init__(self, module: torch.nn.Module, what: str, rebuild: str):
        self._module = module
        self._what = what
        self._rebuild = rebuild    # how this wrapper is set up again, one sentence
        # Held, not only their ids: a freed parameter's id could be reused by a new one.
        self._known = {id(p): p for p in module.parameters()}
        self._outside = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self._registrations = _registrations

    def check(self) -> None:
        if self._registrations != _registrations:
            self._registrations = _registrations
            added = [(n, p) for n, p in self._module.named_parameters() if id(p) not in self._known]
            self._known.update((id(p), p) for _, p in added)
            self._outside += added
        if not self._outside or not any(p.requires_grad for _, p in self._outside):
            return
        names = [n for n, p in self._outside if p.requires_grad]
        raise RuntimeError(
            f"{self._what}: parameter(s) {name_list(names)} require grad but were not trainable "
            f"parameters of the model when {self._what} was set up (frozen then, or added "
            "since), so their gradients would not be averaged and every rank would train its own "
            f"copy. {self._rebuild}, or keep such parameters trainable from the start and add "
            "them to the optimizer when they should train")
