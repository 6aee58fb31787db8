"""The training algorithms, one module each, on the driver interface
(driver.py): DataParallel and its optimizer, DataParallelMultiGPU, DASO,
the model averagers (LocalSGD), SlowMo, DiLoCo, SparseLoCo, DeMo, and
Bagua's family with with_bagua (bagua.py). The package's own names are
Bagua's algorithm classes (`mpidp.algorithms.GradientAllReduceAlgorithm`,
...), as before."""

from .bagua_family import (Algorithm, AsyncModelAverageAlgorithm, ByteGradAlgorithm,
                           DecentralizedAlgorithm, DiLoCoAlgorithm, GradientAllReduceAlgorithm,
                           LocalSGDAlgorithm, LowPrecisionDecentralizedAlgorithm, QAdamAlgorithm,
                           QAdamOptimizer, SlowMoAlgorithm, SparseLoCoAlgorithm)

__all__ = ["Algorithm", "GradientAllReduceAlgorithm", "ByteGradAlgorithm", "QAdamAlgorithm",
           "QAdamOptimizer", "DecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithm",
           "AsyncModelAverageAlgorithm", "LocalSGDAlgorithm", "SlowMoAlgorithm", "DiLoCoAlgorithm",
           "SparseLoCoAlgorithm"]
