"""Heat's `heat.optim` names: `import mpidp as ht` keeps `ht.optim.DASO(...)`
and `ht.optim.DataParallelOptimizer(...)` working unchanged."""

from .daso import DASO
from .optimizer import DataParallelOptimizer

__all__ = ["DASO", "DataParallelOptimizer"]
