#!/usr/bin/env bash
# run_pytest.sh N [pytest args...]: the pytest suite at N MPI ranks.
#
# N = 1 runs pytest as one process (an MPI singleton) with every test,
# including those marked `serial` (tests that start their own mpirun jobs or
# only make sense once). N > 1 runs the same suite under mpirun on N ranks,
# without the serial tests; rank 0 prints to the terminal and every other
# rank writes tests/logs/rank-K.log, shown when the run fails. A failing test
# aborts the whole job (tests/conftest.py) and the run has a wall-clock limit,
# so nothing can hang. MPIDP_TIMEOUT turns a stuck collective into an abort.
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: run_pytest.sh N [pytest args]}
shift
PY=${MPIDP_PYTHON:-.venv/bin/python}   # another Python: scripts/gpu_check.sh
export MPIDP_TIMEOUT=${MPIDP_TIMEOUT:-120}
# Bytecode is cached outside the tree (every test job imports mpidp afresh).
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$PWD/build/pycache}
unset PYTHONDONTWRITEBYTECODE
# A pass's wall-clock limit: every mpirun job a test starts has its own, so
# this only ends a pass gone wrong, with room for a slow, shared machine
# (the 1-rank pass took 30 min on the 2 busy cores of 2026-12-07).
limit=${MPIDP_TEST_LIMIT:-3600}
mkdir -p tests/logs
rm -f tests/logs/rank-*.log

echo "== pytest at $n rank(s)"
if [ "$n" = 1 ]; then
    timeout -k 10 "$limit" "$PY" -m pytest -q "${@:-tests}"
    rc=$?
else
    # -m "not serial" comes first: a later -m from the caller replaces it.
    timeout -k 10 "$limit" ./scripts/mpirun.sh "$n" ./scripts/pytest_rank.sh "$PY" -q --color=no -m "not serial" "${@:-tests}"
    rc=$?
fi
if [ $rc = 5 ]; then
    # pytest's "no tests collected": nothing failed, but say so plainly.
    echo "== pytest at $n rank(s): no tests were collected"
    rc=0
fi
if [ $rc != 0 ]; then
    [ $rc = 124 ] && echo "== pytest at $n rank(s) passed its ${limit}s limit and was killed"
    for f in tests/logs/rank-*.log; do
        [ -f "$f" ] || continue
        echo "---- $f (last 40 lines)"
        tail -n 40 "$f"
    done
    echo "== pytest at $n rank(s) FAILED (exit $rc)"
fi
exit $rc
