"""The source distribution holds every tracked file that the build and the
test suite need: a wheel built from it is the wheel built from the tree
(CUDA sources included), and the tests it ships can run."""

import shutil
import subprocess
import sys
import tarfile

import pytest

from mpi_jobs import ROOT

pytestmark = pytest.mark.serial

NEEDED = ("csrc/", "python/", "tests/", "examples/")
BUILD_FILES = {"setup.py", "pyproject.toml", "MANIFEST.in", "Makefile", "LICENSE", "README.md",
               "CHANGELOG.md"}


def tracked() -> list:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout (an unpacked sdist has no `git ls-files`)")
    return [f for f in out.stdout.split() if (ROOT / f).is_file()]


def test_the_sdist_holds_every_tracked_source_test_and_build_file(tmp_path):
    files = tracked()
    want = {f for f in files if f.startswith(NEEDED) or f in BUILD_FILES}
    # From a clean copy of the tracked files: setuptools would otherwise also
    # take whatever an earlier build's egg-info lists.
    src = tmp_path / "src"
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    # setuptools' PEP 517 hook, as pip and `python -m build` call it.
    subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                    "build_meta.build_sdist(sys.argv[1])", str(tmp_path)],
                   cwd=src, check=True, capture_output=True)
    (sdist,) = tmp_path.glob("mpidp-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = sorted(want - names)
    assert not missing, f"tracked but not in the sdist: {missing}"
    assert "python/mpidp/py.typed" in names and "python/mpidp/_C.pyi" in names
    assert not [n for n in names if n.endswith((".o", ".so", ".pyc"))]
