"""The source distribution holds every tracked file that the build and the
test suite need: a wheel built from it is the wheel built from the tree
(CUDA sources included), and the tests it ships can run."""

import os
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


def copy_tree(files, dest, skip=()):
    for f in files:
        if not f.startswith(tuple(skip)):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)


def test_the_sdist_holds_every_tracked_source_test_and_build_file(tmp_path):
    files = tracked()
    want = {f for f in files if f.startswith(NEEDED) or f in BUILD_FILES}
    # From a clean copy of the tracked files: setuptools would otherwise also
    # take whatever an earlier build's egg-info lists.
    src = tmp_path / "src"
    copy_tree(files, src)
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


def test_asking_for_cuda_without_its_sources_fails_clearly(tmp_path):
    """A tree (or an old sdist) without csrc/cuda used to build without the
    CUDA kernels under MPIDP_CUDA=1, silently."""
    src = tmp_path / "src"
    copy_tree(tracked(), src, skip=("csrc/cuda/",))
    env = dict(os.environ, MPIDP_CUDA="1", NVCC=sys.executable)   # any file: nvcc "found"
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "-b", str(tmp_path / "b"),
                        "-t", str(tmp_path / "t")], cwd=src, env=env, capture_output=True,
                       text=True)
    assert r.returncode != 0
    assert "MPIDP_CUDA=1 but csrc/cuda/*.cu are missing" in r.stderr, r.stderr[-2000:]
