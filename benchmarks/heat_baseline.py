"""Heat (helmholtz-analytics/heat) as a baseline of the benchmarks, when installed.

scripts/install_heat.sh installs Heat 1.9 into .venv-heat beside our torch:
Heat's wheel declares Python >= 3.12 but runs on 3.11, and its dependencies
would pull another torch, so it goes in with --no-deps next to the
torchvision release that pairs with the installed torch.

import_heat() returns (module, note) or (None, why it is skipped).
"""

from __future__ import annotations

import importlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAT_SITE = os.path.join(REPO, ".venv-heat")

# torchvision's import registers fake kernels for these two operators without
# first asking whether its C library loaded (the other operators are guarded).
_UNGUARDED_TORCHVISION_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_keep_alive = []


def forget_package(name: str) -> None:
    """Drop `name` and its submodules from sys.modules, so that the next
    import runs the package's code again."""
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def _import_torchvision():
    """Heat imports torchvision for its dataset helpers (the benchmarks use
    none). Where only a torchvision built against another torch build can be
    installed (PyPI has CUDA builds only; the CPU ones live on
    download.pytorch.org), its C operators do not load and, from release 0.21
    on, its import then fails. Declaring the two unguarded operators lets the
    Python part import; calling them would still raise. Called once that
    failure was seen; returns a note for the report."""
    import torch

    forget_package("torchvision")
    lib = torch.library.Library("torchvision", "DEF")
    for schema in _UNGUARDED_TORCHVISION_OPS:
        lib.define(schema)
    _keep_alive.append(lib)
    importlib.import_module("torchvision")
    return " (torchvision without its C operators: it was built for another torch build)"


def import_heat():
    if os.path.isdir(HEAT_SITE) and HEAT_SITE not in sys.path:
        sys.path.append(HEAT_SITE)
    note = ""
    try:
        try:
            heat = importlib.import_module("heat")
        except RuntimeError as exc:
            if "torchvision::" not in str(exc):
                raise
            note = _import_torchvision()   # then Heat again, from scratch
            forget_package("heat")
            heat = importlib.import_module("heat")
    except ModuleNotFoundError as exc:
        if exc.name == "heat":
            return None, "Heat is not installed (scripts/install_heat.sh installs it into .venv-heat)"
        return None, f"Heat does not import: {exc}"
    except Exception as exc:  # any failure of a third-party import: report it, bench the rest
        return None, f"Heat does not import: {type(exc).__name__}: {exc}"
    return heat, f"Heat {heat.__version__}{note}"
