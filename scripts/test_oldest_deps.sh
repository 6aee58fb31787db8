#!/usr/bin/env bash
# test_oldest_deps.sh: the 2-rank pytest suite against the oldest mpi4py that
# pyproject.toml claims (its `mpi4py>=X` dependency), so the floor we publish
# is a floor we test. `make test` runs it after the main suites.
#
# The old mpi4py and an mpidp built against its headers live in .venv-oldest/
# (gitignored), put first on PYTHONPATH for the run; .venv's torch, numpy and
# pytest are used as they are. The wheel of the old mpi4py is kept, so only a
# clean clone pays for building it (about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DIR=$PWD/.venv-oldest
say() { printf '[oldest-deps] %s\n' "$*"; }

floor=$("$PY" - <<'PYEOF'
import pathlib, re
text = pathlib.Path("pyproject.toml").read_text()
deps = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
print(re.search(r'"mpi4py>=([0-9.]+)"', deps).group(1))
PYEOF
)

# 1. A wheel of mpi4py $floor, built from source with this machine's mpicc.
#    mpi4py 3.1's build passes distutils' old dry_run argument, which recent
#    setuptools no longer takes: it builds in a venv of its own with an older one.
wheel=$(ls "$DIR"/wheels/mpi4py-"$floor"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    say "building mpi4py $floor from source (once)"
    [ -x "$DIR/build-venv/bin/python" ] || python3 -m venv "$DIR/build-venv"
    "$DIR/build-venv/bin/python" -m pip install -q "setuptools<70" wheel 2>&1 | { grep -v '^WARNING: Location' || true; }
    MPICC="${MPICC:-mpicc}" "$DIR/build-venv/bin/python" -m pip wheel -q --no-build-isolation \
        --no-deps --no-binary=mpi4py -w "$DIR/wheels" "mpi4py==$floor" 2>&1 | { grep -v '^WARNING: Location' || true; }
    wheel=$(ls "$DIR"/wheels/mpi4py-"$floor"-*.whl | head -n 1)
fi
if [ ! -d "$DIR/site/mpi4py" ] || ! grep -qx "$floor" "$DIR/site/.version" 2>/dev/null; then
    rm -rf "$DIR/site"
    "$PY" -m pip install -q --no-deps --target "$DIR/site" "$wheel" 2>&1 | { grep -v '^WARNING: Location' || true; }
    echo "$floor" >"$DIR/site/.version"
fi

# 2. mpidp built against that mpi4py's headers, outside the source tree. The
#    C++ gradient hook uses no MPI: the main build's is copied, not compiled again.
say "building mpidp against mpi4py $floor"
PYTHONPATH="$DIR/site" MPIDP_TORCH_HOOK=0 "$PY" setup.py -q build --build-base "$DIR/build" \
    --build-lib "$DIR/lib" >/dev/null
hook=$(ls python/mpidp/_grad_hook*.so 2>/dev/null | head -n 1 || true)
[ -n "$hook" ] && cp "$hook" "$DIR/lib/mpidp/"

# 3. The suite, with both first on the path (checked before it runs).
export PYTHONPATH="$DIR/lib:$DIR/site"
"$PY" - "$floor" "$DIR/lib" <<'PYEOF'
import sys
import mpi4py, mpidp
floor, lib = sys.argv[1:]
assert mpi4py.__version__ == floor, f"mpi4py {mpi4py.__version__} imported, not {floor}"
assert mpidp.__file__.startswith(lib), f"mpidp imported from {mpidp.__file__}, not {lib}"
print(f"[oldest-deps] mpi4py {mpi4py.__version__} from {mpi4py.__file__}; mpidp from {lib}")
PYEOF
./scripts/run_pytest.sh 2 "$@"
