"""Hooks that mpidp puts on the user's modules, left out of copies and pickles.

A wrapper's hooks on the inner modules (non-blocking mode's layer-by-layer
update, the load watch, progress of syncs in flight, the decentralized
exchange) hold the wrapper; pickled with the model (torch.save(model)) they
failed ("cannot pickle 'weakref.ReferenceType'"), and a deep copy carried them
and drove the original wrapper from the copy's forward. Every such hook is
registered here: its handle id is recorded for the module, and the module gets
an instance-level __getstate__ (pickle and copy look it up on the instance)
that returns torch's state less those hooks, with a plain dict for a watched
`_parameters` (apply_on_read.py). A copy or a saved model is then exactly
the model as it was before mpidp touched it, and loading it needs no mpidp."""

from __future__ import annotations

import functools
import weakref

from .apply_on_read import QuietParameters

# id of every hook mpidp registered on a module, by module.
_OURS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def register(module, method: str, hook, **kwargs):
    """module.<method>(hook, **kwargs) (e.g. "register_forward_pre_hook"),
    kept out of the module's copies and pickles; returns the handle."""
    handle = getattr(module, method)(hook, **kwargs)
    _OURS.setdefault(module, set()).add(handle.id)
    if "__getstate__" not in module.__dict__:
        module.__dict__["__getstate__"] = functools.partial(_state_without_mpidp,
                                                            weakref.ref(module))
    return handle


def _state_without_mpidp(module_ref) -> dict:
    module = module_ref()
    state = module.__dict__.copy()
    del state["__getstate__"]
    ours = _OURS.get(module, set())
    for name, value in state.items():
        if isinstance(value, QuietParameters):
            state[name] = dict(value.items())   # settles a pending update first
        elif "hooks" in name and isinstance(value, dict) and not ours.isdisjoint(value):
            state[name] = type(value)((k, v) for k, v in value.items() if k not in ours)
    return state
