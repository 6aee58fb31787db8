#!/usr/bin/env bash
# test_1_and_ft.sh: the 1-rank pass (scripts/run_pytest.sh 1) and the
# fault-tolerance pass (scripts/test_fault_tolerance.sh) side by side, as
# `make test` runs them. The 1-rank pass alone leaves part of the machine idle
# (it waits on its jobs' start-up and on deadlines its tests provoke); the
# fault-tolerance pass fills some of that. The fault-tolerance pass writes to
# tests/logs/ft-pass.log (its own pytest temporary directory), shown when both
# have ended; the exit status is nonzero when either failed.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_ft_env.sh || exit 1     # its build before the tests, not beside them
mkdir -p tests/logs
./scripts/test_fault_tolerance.sh --basetemp "${TMPDIR:-/tmp}/mpidp-ft-pass" \
    >tests/logs/ft-pass.log 2>&1 &
ft=$!
./scripts/run_pytest.sh 1
one=$?
wait "$ft"
two=$?
cat tests/logs/ft-pass.log
[ "$two" = 0 ] || echo "== fault-tolerance tests FAILED (exit $two)"
exit $(( one != 0 || two != 0 ))
