"""Bagua's API on mpidp's drivers: the base class of an algorithm's settings
(algorithm.py), `with_bagua` and the module it returns (bagua_module.py),
and the adapters of the algorithms that have a public class of their own
(adapters.py: GradientAllReduce, ByteGrad, LocalSGD, SlowMo, DiLoCo,
SparseLoCo, MuLoCo, NoLoCo, eager DiLoCo, DES-LOC). An algorithm whose only
API is Bagua's (QAdam, the decentralized ones, asynchronous averaging) keeps
its class in its own module, mpidp/algorithms/<algorithm>.py."""

from .adapters import (ByteGradAlgorithm, DESLOCAlgorithm, DiLoCoAlgorithm,
                       EagerDiLoCoAlgorithm, GradientAllReduceAlgorithm, LocalSGDAlgorithm,
                       MuLoCoAlgorithm, NoLoCoAlgorithm, SlowMoAlgorithm, SparseLoCoAlgorithm)
from .algorithm import Algorithm
from .bagua_module import BaguaModule, with_bagua

__all__ = ["Algorithm", "BaguaModule", "with_bagua", "GradientAllReduceAlgorithm",
           "ByteGradAlgorithm", "LocalSGDAlgorithm", "SlowMoAlgorithm", "DiLoCoAlgorithm",
           "SparseLoCoAlgorithm", "MuLoCoAlgorithm", "NoLoCoAlgorithm",
           "EagerDiLoCoAlgorithm", "DESLOCAlgorithm"]
