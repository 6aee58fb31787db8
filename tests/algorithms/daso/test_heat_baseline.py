"""benchmarks/heat_baseline.py: Heat is an optional baseline of bench_step,
skipped with the reason when it is missing or does not import."""

import importlib
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture
def loader(monkeypatch, tmp_path):
    """heat_baseline with its Heat directory moved to `tmp_path` and no Heat
    imported or importable from elsewhere."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("heat_baseline")
    monkeypatch.setattr(module, "HEAT_SITE", str(tmp_path / "site"))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not p.endswith(".venv-heat")])
    for name in [m for m in sys.modules if m == "heat" or m.startswith("heat.")]:
        monkeypatch.delitem(sys.modules, name)   # a real Heat comes back afterwards
    yield module
    module.forget_package("heat")   # the stand-ins these tests import


def test_missing_heat_is_skipped_with_the_install_command(loader):
    heat, why = loader.import_heat()
    assert heat is None
    assert "not installed" in why and "scripts/install_heat.sh" in why


def test_a_heat_that_fails_to_import_is_skipped_with_its_error(loader, tmp_path):
    package = tmp_path / "site" / "heat"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import a_dependency_heat_lacks_here\n")
    heat, why = loader.import_heat()
    assert heat is None
    assert why.startswith("Heat does not import") and "a_dependency_heat_lacks_here" in why


def test_an_installed_heat_is_returned_with_its_version(loader, tmp_path):
    package = tmp_path / "site" / "heat"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '9.9.9'\n")
    heat, why = loader.import_heat()
    assert heat is not None and heat.__version__ == "9.9.9"
    assert why == "Heat 9.9.9"
