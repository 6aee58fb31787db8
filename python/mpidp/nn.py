"""Heat's `heat.nn` names: `import mpidp as ht` keeps `ht.nn.DataParallel(...)`
and `ht.nn.DataParallelMultiGPU(...)` working unchanged."""

from .algorithms.data_parallel import DataParallel
from .algorithms.data_parallel_multi import DataParallelMultiGPU

__all__ = ["DataParallel", "DataParallelMultiGPU"]
