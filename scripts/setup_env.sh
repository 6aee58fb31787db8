#!/usr/bin/env bash
# Installs whatever is missing for building and testing mpidp, then builds it.
# Idempotent: each step checks first, so a second run takes a few seconds.
#   1. Open MPI (Debian libopenmpi-dev openmpi-bin) when mpicc is absent.
#   2. A virtual environment .venv at the repository root.
#   3. torch==2.13.0, numpy, pytest, scikit-learn, tqdm, Pillow, matplotlib (the
#      benchmark plots), sphinx and myst-parser (make docs) and mpi4py in it.
#   4. mpidp itself, built with mpicc into .venv (editable install).
# mpi4py: the binary wheel is tried first (it carries an Open MPI build that
# loads the system libmpi.so.40); if mpidp's import check finds that mpi4py and
# mpidp's extension run on different MPI libraries, mpi4py is rebuilt from
# source with this machine's mpicc.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=$VENV/bin/python
TORCH_VERSION=2.13.0
# Lightning: tests/c10d/test_c10d_lightning.py (its DDPStrategy on the "mpidp" backend); it
# accepts the torch above and leaves it in place. expecttest: torch's own distributed
# test suite imports it (tests/c10d/test_torch_distributed_suite.py).
LIGHTNING_VERSION=2.6.6

say() { printf '[setup] %s\n' "$*"; }
# Runs pip quietly, hiding this machine's harmless local-index warnings but
# keeping pip's exit status (pipefail).
pip_q() { "$PY" -m pip "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }

# 1. MPI
if ! command -v mpicc >/dev/null 2>&1 && [ -z "${MPICC:-}" ]; then
    ./scripts/apt_install.sh libopenmpi-dev openmpi-bin || {
        echo "mpicc not found: install an MPI or load your site's MPI module, then run this again." >&2
        exit 1
    }
fi

# 2. virtual environment
if [ ! -x "$PY" ]; then
    say "creating $VENV"
    python3 -m venv "$VENV"
fi

# 3. Python packages (only when an import or the torch version is missing)
if ! "$PY" - <<PYEOF 2>/dev/null
import importlib, sys
import torch
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
for m in ("numpy", "pytest", "sklearn", "tqdm", "PIL", "matplotlib", "mpi4py", "setuptools", "wheel",
          "sphinx", "myst_parser", "lightning", "expecttest"):
    importlib.import_module(m)
import setuptools   # pyproject.toml's license-files needs 77
assert int(setuptools.__version__.split(".")[0]) >= 77, setuptools.__version__
PYEOF
then
    say "installing Python packages into .venv"
    pip_q install -q --upgrade "pip>=23" "setuptools>=77" wheel
    pip_q install -q "torch==$TORCH_VERSION" numpy pytest scikit-learn tqdm Pillow matplotlib \
        sphinx myst-parser "lightning==$LIGHTNING_VERSION" expecttest
    pip_q install -q --only-binary=mpi4py "mpi4py>=4" || MPICC="${MPICC:-mpicc}" pip_q install -q --no-binary=mpi4py mpi4py
fi

# 4. mpidp: rebuild when any C, CUDA or Python source is newer than the stamp.
STAMP=$VENV/.mpidp-built
if [ ! -f "$STAMP" ] || [ -n "$(find csrc python setup.py pyproject.toml -newer "$STAMP" -type f \
        \( -name '*.c' -o -name '*.h' -o -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.py' -o -name '*.toml' \) -print -quit)" ]; then
    say "building mpidp (mpicc: $(command -v "${MPICC:-mpicc}"))"
    pip_q install -q --no-build-isolation --no-deps -e .
    touch "$STAMP"
fi

# The import runs mpidp's check that mpi4py and the extension share one MPI library.
if ! out=$("$PY" -c "import mpidp" 2>&1); then
    if grep -q "different MPI" <<<"$out"; then
        say "mpi4py runs on another MPI than mpicc's; rebuilding mpi4py from source with $(command -v "${MPICC:-mpicc}")"
        MPICC="${MPICC:-mpicc}" pip_q install -q --force-reinstall --no-deps --no-cache-dir --no-binary=mpi4py mpi4py
        "$PY" -c "import mpidp"
    else
        echo "$out" >&2
        exit 1
    fi
fi
say "ready: $("$PY" -c 'import mpidp, torch, mpi4py; print("mpidp", mpidp.__version__, "| torch", torch.__version__, "| mpi4py", mpi4py.__version__, "|", mpidp.mpi_library_version().splitlines()[0][:40])')"
