"""Which algorithm fits a cluster: a cost model of mpidp's algorithms
(costs.py: the collectives' closed forms; algorithm_costs.py: what each
algorithm communicates), fitted to an allocation by `python -m mpidp
calibrate` (calibrate.py, profile.py) and asked by `python -m mpidp plan`
(plan.py). docs/planning.md says how to use it and where it is wrong."""

import sys

from . import algorithm_costs
from .algorithm_costs import ALGORITHMS, Prediction, Workload, bandwidth_for, predict, predict_all
from .costs import Cluster, Level
from .profile import Profile, load

__all__ = ["ALGORITHMS", "Cluster", "Level", "Prediction", "Profile", "Workload",
           "bandwidth_for", "load", "predict", "predict_all"]

# The module's former name, for programs that import mpidp.planning.algorithms.
sys.modules.setdefault(f"{__name__}.algorithms", algorithm_costs)
algorithms = algorithm_costs
