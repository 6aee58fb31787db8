"""Reads of parameters whose update non-blocking DataParallel has not applied.

Non-blocking mode's optimizer.step() only marks the update as due; the next
forward applies it layer by layer. Until then the parameters hold the last
step's values, and code that reads them in between -- an EMA or
torch.optim.swa_utils.AveragedModel updated after each step, a regulariser
built from model.parameters() before the forward, a method of the model that
reads a parameter, state_dict() -- would get them one step stale.

Every read of a parameter through the module's API goes through the module's
`_parameters` dict: attribute access (nn.Module.__getattr__ reads
`_parameters[name]`), parameters() and named_parameters() (its items()),
state_dict() and .to() (items() again). So each module holding a wrapped
parameter gets a dict of its own type. While nothing is pending it is
QuietParameters, which adds no method to the read path; while an update is
due it is PendingParameters (the same layout, so the switch is a __class__
assignment), whose reads first tell the wrapper, which applies the pending
update -- the bucket of the parameter read inside the wrapper's forward, all
of it outside -- and the dict is quiet again. Membership tests, keys() and
len() read no values and pass through. Buffers have no pending update.

Both types pickle and deep-copy as plain dicts: a saved or copied model
carries nothing of mpidp."""

from __future__ import annotations

import copy


class QuietParameters(dict):
    """A module's `_parameters` that a wrapper watches, while nothing is
    pending. `_reader(params, value)` is called by PendingParameters' reads
    (value None: every value is read)."""

    __slots__ = ("_reader",)

    # items(): a pending dict settles first, so a copy holds the applied update.
    def __reduce_ex__(self, protocol):
        return dict, (dict(self.items()),)

    def __deepcopy__(self, memo):
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


class PendingParameters(QuietParameters):
    """The same dict while an update is due: every read of a value settles it first."""

    __slots__ = ()

    def __getitem__(self, name):
        value = dict.__getitem__(self, name)
        self._reader(self, value)
        return value

    def get(self, name, default=None):
        return self[name] if name in self else default

    def items(self):
        self._reader(self, None)
        return dict.items(self)

    def values(self):
        self._reader(self, None)
        return dict.values(self)

    def copy(self):
        self._reader(self, None)
        return dict.copy(self)

    def pop(self, *args):
        self._reader(self, None)
        return dict.pop(self, *args)

    def setdefault(self, name, default=None):
        self._reader(self, None)
        return dict.setdefault(self, name, default)


def watch(module, reader) -> QuietParameters:
    """Gives `module` a QuietParameters with the same entries, read through
    `reader`; returns it."""
    params = module.__dict__["_parameters"]
    if not isinstance(params, QuietParameters):
        params = QuietParameters(params)
        module.__dict__["_parameters"] = params
    params._reader = reader
    return params


def unwatch(module, params: QuietParameters) -> None:
    """Gives `module` a plain dict again, if `params` is still its dict."""
    if module.__dict__.get("_parameters") is params:
        module.__dict__["_parameters"] = dict(dict.items(params))


def set_pending(dicts, pending: bool) -> None:
    cls = PendingParameters if pending else QuietParameters
    for d in dicts:
        d.__class__ = cls
