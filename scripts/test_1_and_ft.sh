#!/usr/bin/env bash
# test_1_and_ft.sh: the fault-tolerance pass (scripts/test_fault_tolerance.sh)
# side by side with the 1-rank pass (scripts/run_pytest.sh 1), then the
# 3-rank pass and DataParallel's with the Python gradient hook, as `make test`
# runs them. The fault-tolerance pass is the longest and waits most (its jobs'
# start-up, each replacement's spawn, the deadlines its tests provoke); the
# others fill that time, one after another. The fault-tolerance pass writes
# to tests/logs/ft-pass.log (its own pytest temporary directory), shown when
# all have ended; the exit status is nonzero when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_ft_env.sh || exit 1     # its build before the tests, not beside them
mkdir -p tests/logs
./scripts/test_fault_tolerance.sh --basetemp "${TMPDIR:-/tmp}/mpidp-ft-pass" \
    >tests/logs/ft-pass.log 2>&1 &
ft=$!
./scripts/run_pytest.sh 1
one=$?
./scripts/run_pytest.sh 3 -m "ranks3 and not serial" || one=1
MPIDP_GRAD_HOOK=python ./scripts/run_pytest.sh 2 tests/algorithms/data_parallel || one=1
wait "$ft"
two=$?
cat tests/logs/ft-pass.log
[ "$two" = 0 ] || echo "== fault-tolerance tests FAILED (exit $two)"
exit $(( one != 0 || two != 0 ))
