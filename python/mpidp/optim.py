"""Heat's `heat.optim` names: `import mpidp as ht` keeps `ht.optim.DASO(...)`
and `ht.optim.DataParallelOptimizer(...)` working unchanged."""

from .algorithms.daso import DASO
from .algorithms.optimizer import DataParallelOptimizer

__all__ = ["DASO", "DataParallelOptimizer"]
