"""The training algorithms: driver.py (the interface every algorithm
implements) and one module per algorithm -- DataParallel (data_parallel)
and its optimizer (optimizer), DataParallelMultiGPU, DASO, the model
averagers (averaging: LocalSGD), SlowMo, DiLoCo, SparseLoCo, MuLoCo,
NoLoCo, eager DiLoCo, DES-LOC, DeMo, QAdam, the decentralized ones and asynchronous averaging --
with Bagua's API in
bagua/ (with_bagua, the base class, the adapters of the algorithms that
have a public class of their own). The package's own names are Bagua's
algorithm classes (`mpidp.algorithms.GradientAllReduceAlgorithm`, ...)."""

from .async_average import AsyncModelAverageAlgorithm
from .bagua import (Algorithm, ByteGradAlgorithm, DESLOCAlgorithm, DiLoCoAlgorithm,
                    EagerDiLoCoAlgorithm, GradientAllReduceAlgorithm, LocalSGDAlgorithm,
                    MuLoCoAlgorithm, NoLoCoAlgorithm, SlowMoAlgorithm, SparseLoCoAlgorithm)
from .decentralized import DecentralizedAlgorithm, LowPrecisionDecentralizedAlgorithm
from .qadam import QAdamAlgorithm, QAdamOptimizer

__all__ = ["Algorithm", "GradientAllReduceAlgorithm", "ByteGradAlgorithm", "QAdamAlgorithm",
           "QAdamOptimizer", "DecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithm",
           "AsyncModelAverageAlgorithm", "LocalSGDAlgorithm", "SlowMoAlgorithm", "DiLoCoAlgorithm",
           "SparseLoCoAlgorithm", "MuLoCoAlgorithm", "NoLoCoAlgorithm", "EagerDiLoCoAlgorithm",
           "DESLOCAlgorithm"]
