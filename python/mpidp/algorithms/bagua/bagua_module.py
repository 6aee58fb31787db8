"""`mpidp.with_bagua(module, optimizers, algorithm, comm=None)`: Bagua's one-call
API over mpidp's engines::

    model = mpidp.with_bagua(model, [optimizer], mpidp.algorithms.ByteGradAlgorithm())
    for x, y in loader:
        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

The result wraps the module (`.module`; forward runs the algorithm's). Calling
with_bagua again on it switches the algorithm -- between any two of
mpidp.algorithms, Bagua's and LocalSGD, SlowMo and DiLoCo alike: the old
one's pending communication is drained and its hooks removed, then every
rank takes rank 0's parameters, buffers and optimizer state, so after a
switch every rank's parameters equal rank 0's bit for bit. Each algorithm
is a driver (mpidp/algorithms/driver.py): BaguaModule only switches drivers.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Optional, Sequence

import torch

from ...collectives.model_state import broadcast_optimizer_state
from ..driver import Driver, reduce_wrapper, set_up
from .algorithm import Algorithm

__all__ = ["with_bagua", "BaguaModule"]


class BaguaModule(torch.nn.Module):
    """A module trained with a Bagua algorithm (what with_bagua returns)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.bagua_algorithm: Optional[Algorithm] = None
        self.bagua_optimizers: Sequence[torch.optim.Optimizer] = ()
        self._driver: Optional[Driver] = None      # the attached algorithm's driver
        self._trainable_at_setup = None    # TrainableAtSetup of the attached algorithm

    @property
    def bagua_driver(self) -> Driver:
        """The driver (mpidp/algorithms/driver.py) running the attached algorithm."""
        return self._driver

    def forward(self, *inputs, **kwargs):
        if self.training and torch.is_grad_enabled():
            self._trainable_at_setup.check()
        return self._driver.train_forward(*inputs, **kwargs)

    def join(self, adopt_optimizer_state: bool = False):
        """A context for uneven inputs (ranks with fewer batches finish early),
        as DataParallel.join(), for the algorithms that average gradients
        every step: GradientAllReduceAlgorithm and ByteGradAlgorithm. The
        others raise: QAdam averages momenta inside the optimizer's step, the
        decentralized ones and AsyncModelAverageAlgorithm average weights with
        peers that would wait for a finished rank."""
        return self._driver.join(adopt_optimizer_state)

    def __reduce_ex__(self, protocol):
        return reduce_wrapper(self, self.module)

    def bagua_state_dict(self):
        """The algorithm's own state (its optimizers' states are theirs)."""
        return self._driver.algorithm_state()

    def load_bagua_state_dict(self, state) -> None:
        self._driver.load_algorithm_state(state)

    def _set_up(self, optimizers, algorithm: Algorithm, comm, keep_own: bool = False) -> None:
        """The checks and broadcasts before a driver attaches: ranks with
        another algorithm or other settings would post different
        communication, so the settings of the algorithm join the model's
        check; every rank takes rank 0's parameters, buffers and optimizer
        states (they may differ) -- except, with `keep_own`, the ranks that
        already train (the survivors, where a replacement joins), which
        keep their own: the algorithm's recovery decides what they hold."""
        if keep_own:
            own = ([t.detach().clone() for t in self.module.state_dict().values()],
                   [copy.deepcopy(opt.state_dict()) for opt in optimizers])
        settings = {"algorithm": type(algorithm).__name__, **algorithm.shared_settings()}
        _, self._trainable_at_setup = set_up(
            self.module, comm, "with_bagua", settings, rebuild="Call mpidp.with_bagua(model, "
            "optimizers, algorithm) again after such a change")
        for opt in optimizers:
            broadcast_optimizer_state(opt, root=0, comm=comm)
        if keep_own:
            with torch.no_grad():
                for t, mine in zip(self.module.state_dict().values(), own[0]):
                    t.copy_(mine)
            for opt, mine in zip(optimizers, own[1]):
                opt.load_state_dict(mine)

    def with_bagua(self, optimizers, algorithm: Algorithm, comm=None) -> "BaguaModule":
        """Switch to `algorithm` (Bagua's method of the same name): the old
        driver drains and detaches, every rank takes rank 0's parameters,
        buffers and optimizer state, the new driver attaches."""
        if not isinstance(algorithm, Algorithm):
            raise TypeError("algorithm: expected an instance of a class of mpidp.algorithms "
                            "(e.g. mpidp.algorithms.GradientAllReduceAlgorithm()), got "
                            f"{type(algorithm).__name__}")
        optimizers = _check_optimizers(optimizers)
        if self._driver is not None:
            self._driver.detach("with_bagua switched the module to another algorithm")
        self._set_up(optimizers, algorithm, comm)
        self._driver = algorithm.attach(self.module, optimizers, comm)
        # Fault-tolerant mode: a replacement runs this set-up before the
        # driver's; the survivors run it again where one joins.
        self._driver._set_up_again = functools.partial(
            _set_up_again, weakref.ref(self), optimizers, algorithm)
        self.bagua_algorithm = algorithm
        self.bagua_optimizers = tuple(optimizers)
        return self


def _set_up_again(module_ref, optimizers, algorithm, comm) -> None:
    module = module_ref()
    if module is not None:
        module._set_up(optimizers, algorithm, comm, keep_own=True)


def _check_optimizers(optimizers) -> list:
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    try:
        optimizers = list(optimizers)
    except TypeError:
        raise TypeError("optimizers: expected a list of torch optimizers, got "
                        f"{type(optimizers).__name__}") from None
    bad = [type(o).__name__ for o in optimizers if not isinstance(o, torch.optim.Optimizer)]
    if bad:
        raise TypeError(f"optimizers: expected torch optimizers, got {', '.join(bad)}")
    return optimizers


def with_bagua(module: torch.nn.Module, optimizers, algorithm: Algorithm, comm=None,
               do_flatten: bool = True) -> BaguaModule:
    """Train `module` data-parallel with `algorithm` (an instance of a class of
    mpidp.algorithms) over `comm` (an mpi4py communicator; None: the world),
    stepping `optimizers` (the user's, stepped as usual). Returns the wrapped
    module; on a wrapped module it switches the algorithm (see above).
    do_flatten is accepted for Bagua's signature: mpidp always reduces
    flattened buckets."""
    if not isinstance(do_flatten, bool):
        raise TypeError(f"do_flatten: expected a bool, got {type(do_flatten).__name__}")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    wrapped = module if isinstance(module, BaguaModule) else BaguaModule(module)
    return wrapped.with_bagua(optimizers, algorithm, comm)
