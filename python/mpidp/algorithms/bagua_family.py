"""Bagua's algorithms, with Bagua's class names and defaults, for
`mpidp.with_bagua(module, optimizers, algorithm)`: GradientAllReduceAlgorithm,
ByteGradAlgorithm, QAdamAlgorithm with QAdamOptimizer, DecentralizedAlgorithm,
LowPrecisionDecentralizedAlgorithm and AsyncModelAverageAlgorithm. Each
implements the interface of mpidp/algorithms/algorithm.py on the core's engines: the
gradient reducer (flat or hierarchical, fp32 or the 8-bit quantized
allreduce), the peer graphs and the peer exchange, the background averager.
"""

from __future__ import annotations

import contextlib
import torch

from .algorithm import Algorithm
from .driver import Driver
from .._runtime.args import check_bool
from .async_average import AsyncModelAverageAlgorithm
from ..collectives.model_state import broadcast_optimizer_state
from .data_parallel import DataParallel
from .decentralized import DecentralizedAlgorithm, LowPrecisionDecentralizedAlgorithm
from .qadam import QAdamAlgorithm, QAdamOptimizer
from .replica_algorithms import (DiLoCoAlgorithm, LocalSGDAlgorithm, SlowMoAlgorithm,
                                 SparseLoCoAlgorithm)

__all__ = ["Algorithm", "GradientAllReduceAlgorithm", "ByteGradAlgorithm", "QAdamAlgorithm",
           "QAdamOptimizer", "DecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithm",
           "AsyncModelAverageAlgorithm", "LocalSGDAlgorithm", "SlowMoAlgorithm", "DiLoCoAlgorithm",
           "SparseLoCoAlgorithm"]


class _GradientHandle(Driver):
    """A reducer-based algorithm on a module: mpidp.DataParallel underneath
    (its part), with blocking updates: the user's own optimizers step as
    usual."""

    def __init__(self, what, module, optimizers, comm, wire_dtype, hierarchical: bool,
                 average: bool):
        self.what, self.module = what, module
        with self._building_parts():
            self.dp = DataParallel(module, comm, blocking_parameter_updates=True,
                                   wire_dtype=wire_dtype, hierarchical=hierarchical)
        self.dp.set_average(average)
        self.optimizers, self.comm = optimizers, comm

    @contextlib.contextmanager
    def join(self, adopt_optimizer_state: bool = False):
        """DataParallel.join() (uneven inputs); with adopt_optimizer_state
        every rank then also takes the optimizer states of the rank that
        trained longest."""
        check_bool("adopt_optimizer_state", adopt_optimizer_state)
        with self.dp.join():
            yield
        if adopt_optimizer_state:
            for opt in self.optimizers:
                broadcast_optimizer_state(opt, root=self.dp.join_root, comm=self.comm)

    def _remove_hooks(self) -> None:
        pass        # the hooks are the DataParallel's, a part

    def _continue_on(self, comm) -> None:
        """Fault-tolerant mode: the DataParallel underneath goes on over the
        survivors (the failed step was applied by none of them)."""
        self.dp._continue_on(comm)
        self.comm = comm


class _GradientAlgorithm(Algorithm):
    """The gradient reducer's algorithms, which differ only in their wire
    (_wire_dtype: None for float32) and in their defaults."""

    _wire_dtype = None

    def __init__(self, hierarchical: bool, average: bool):
        check_bool("hierarchical", hierarchical)
        check_bool("average", average)
        self.hierarchical = hierarchical
        self.average = average

    def attach(self, module, optimizers, comm):
        return _GradientHandle(type(self).__name__, module, optimizers, comm, self._wire_dtype,
                               self.hierarchical, self.average)


class GradientAllReduceAlgorithm(_GradientAlgorithm):
    """Gradients summed over the ranks every step (averaged with average=True),
    in float32; hierarchical=True sums within each node first (every local rank
    then carries 1/L of the bytes between nodes)."""

    def __init__(self, hierarchical: bool = False, average: bool = True):
        super().__init__(hierarchical, average)


class ByteGradAlgorithm(_GradientAlgorithm):
    """Gradients quantized to 8 bits (min-max blocks of 256, counted from each
    block's minimum) for the sum over the ranks; with hierarchical=True (the
    default, as Bagua's) the node sums in float32 first and only the
    cross-node exchange is quantized.

    average: divide the sum by the number of ranks (True) or keep the sum."""

    _wire_dtype = torch.uint8

    def __init__(self, hierarchical: bool = True, average: bool = True):
        super().__init__(hierarchical, average)
