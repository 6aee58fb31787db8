"""The source distribution holds every tracked file that the build and the
test suite need: a wheel built from it is the wheel built from the tree
(CUDA sources included), and the tests it ships can run."""

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

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


def pep517(hook: str, src, out, build_dir, wait=True):
    """setuptools' PEP 517 hook `hook` (build_sdist, build_wheel), as pip and
    `python -m build` call it, run in `src`; build_dir: MPIDP_BUILD_DIR.
    Without the C++ gradient hook, three quarters of the compile time: its
    two source files are tracked (the first test finds them in the sdist)
    and `make setup` builds it from them."""
    env = dict(os.environ, MPIDP_BUILD_DIR=str(build_dir), MPIDP_CUDA="0", MPIDP_TORCH_HOOK="0")
    cmd = [sys.executable, "-c", f"import sys; from setuptools import build_meta; "
           f"build_meta.{hook}(sys.argv[1])", str(out)]
    proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    return finish(proc) if wait else proc


def finish(proc):
    out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]


def untracked(tree) -> list:
    """Files in `tree` that `git add -A` did not stage (ignored ones included)."""
    out = subprocess.run(["git", "status", "--short", "--ignored"], cwd=tree, check=True,
                         capture_output=True, text=True).stdout.split("\n")
    return [line for line in out if line.startswith(("??", "!!"))]


def test_the_sdist_holds_every_tracked_source_test_and_build_file(tmp_path):
    files = tracked()
    want = {f for f in files if f.startswith(NEEDED) or f in BUILD_FILES}
    # From a clean copy of the tracked files: setuptools would otherwise also
    # take whatever an earlier build's egg-info lists.
    src = tmp_path / "src"
    copy_tree(files, src)
    pep517("build_sdist", src, tmp_path, tmp_path / "b")
    (sdist,) = tmp_path.glob("mpidp-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = sorted(want - names)
    assert not missing, f"tracked but not in the sdist: {missing}"
    assert "python/mpidp/py.typed" in names and "python/mpidp/_C.pyi" in names
    assert {"csrc/torch/grad_hook.cpp", "csrc/py/grad_hook_api.h"} <= names   # the C++ hook's
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


def test_a_wheel_from_the_sdist_is_the_wheel_from_the_tree_and_builds_leave_the_tree_clean(tmp_path):
    """Same files, same bytes (the compiled extension aside, whose bytes hold
    build paths): nothing the wheel needs is missing from the sdist. Neither
    build writes into its source tree (build/ and egg-info go to MPIDP_BUILD_DIR)."""
    src = tmp_path / "src"
    copy_tree(tracked(), src)
    subprocess.run(["git", "init", "-q"], cwd=src, check=True)
    subprocess.run(["git", "add", "-A"], cwd=src, check=True)
    pep517("build_sdist", src, tmp_path / "sdist", tmp_path / "b0")
    (sdist,) = (tmp_path / "sdist").glob("mpidp-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    # Both at once: each compiles on one core.
    jobs = [pep517("build_wheel", tree, tmp_path / out, tmp_path / f"b-{out}", wait=False)
            for tree, out in ((src, "from-tree"), (unpacked, "from-sdist"))]
    for job in jobs:
        finish(job)
    contents = []
    for out in ("from-tree", "from-sdist"):
        (wheel,) = (tmp_path / out).glob("mpidp-*.whl")
        with zipfile.ZipFile(wheel) as z:
            contents.append({n: z.read(n) for n in z.namelist()
                             if not n.endswith((".so", "/RECORD"))} | {n: b"" for n in z.namelist() if n.endswith(".so")})
    tree_files, sdist_files = contents
    assert sorted(tree_files) == sorted(sdist_files)
    assert [n for n in tree_files if n.startswith("mpidp/_C.") and n.endswith(".so")]
    assert {"mpidp/py.typed", "mpidp/_C.pyi", "mpidp/__init__.py"} <= set(tree_files)
    differ = [n for n in tree_files if tree_files[n] != sdist_files[n]]
    assert not differ, f"differ between the two wheels: {differ}"
    assert untracked(src) == [], "building wrote into the source tree"
