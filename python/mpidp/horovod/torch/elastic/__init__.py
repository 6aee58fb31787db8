"""Horovod's elastic API on mpidp's fault-tolerant mode (MPI's ULFM).

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader):   # ElasticSampler
                ...
                state.commit()

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    train(state)

A rank lost mid-epoch makes every survivor raise; run() then restores the
last commit, shrinks Horovod's world to the survivors (mpidp.recover()),
rebuilds every DistributedOptimizer over them, calls the reset callbacks,
syncs the state from rank 0 and calls the function again. Only lost ranks
are handled (no hosts join): launch with `mpirun --with-ft ulfm` and
MPIDP_FAULT_TOLERANCE=1 (Open MPI 5). Without ULFM, run() raises at once."""

from __future__ import annotations

import functools

from .... import fault_tolerance
from ...._C import RanksLost
from ... import _basics
from ..._basics import HorovodInternalError
from ..optimizer import reattach_all
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]


def _rank_lost(error: BaseException) -> bool:
    while error is not None:
        if isinstance(error, RanksLost):
            return True
        error = error.__cause__
    return False


def _reset() -> None:
    membership = fault_tolerance.recover()
    _basics.shutdown()
    _basics.init(comm=membership.comm)
    reattach_all()


def run(func):
    """Run func(state, ...) until it returns, going on over the survivors
    whenever a rank is lost (see the module's docstring)."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not fault_tolerance.enabled():
            raise RuntimeError(
                "hvd.elastic.run: needs mpidp's fault-tolerant mode, which survives the loss of "
                "a rank through MPI's ULFM: launch with `mpirun --with-ft ulfm` (Open MPI 5) and "
                "MPIDP_FAULT_TOLERANCE=1 (docs/fault-tolerance.md)")
        if not isinstance(state, State):
            raise TypeError(f"state: expected a hvd.elastic.State (TorchState), got "
                            f"{type(state).__name__}")
        # The survivors' agreement runs over mpidp's world: made now, while
        # every rank is here (collective).
        fault_tolerance.world_agreement()
        reset_required = False
        while True:
            if reset_required:
                _reset()
                state.on_reset()
            state.sync()
            try:
                return func(state, *args, **kwargs)
            except (HorovodInternalError, RanksLost) as error:
                if not _rank_lost(error):
                    raise
                state.restore()
                reset_required = True
    return wrapper
