#!/usr/bin/env bash
# test_side_by_side.sh [--ctest]: every pytest pass of `make test` in two
# lanes. One lane is the fault-tolerance pass (scripts/test_fault_tolerance.sh),
# the longest, which waits much of its time (its jobs' start-up, each
# replacement's spawn, the deadlines its tests provoke); the other runs, one
# after another, the C tests (--ctest), the passes at 1, 3 (the ranks3
# tests), 2 and 4 ranks, DataParallel's with the Python gradient hook, and the
# one against the oldest mpi4py, filling that time. The fault-tolerance pass
# writes to tests/logs/ft-pass.log (its own pytest temporary directory),
# shown when both lanes have ended; the exit status is nonzero when any pass
# failed (each runs even when an earlier one failed).
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_ft_env.sh || exit 1     # its build before the tests, not beside them
mkdir -p tests/logs
./scripts/test_fault_tolerance.sh --basetemp "${TMPDIR:-/tmp}/mpidp-ft-pass" \
    >tests/logs/ft-pass.log 2>&1 &
ft=$!
failed=()
run() { "$@" || failed+=("$*"); }
if [ "${1:-}" = --ctest ]; then
    run make --no-print-directory ctest
fi
run ./scripts/run_pytest.sh 1
run ./scripts/run_pytest.sh 3 -m "ranks3 and not serial"
run env MPIDP_GRAD_HOOK=python ./scripts/run_pytest.sh 2 tests/algorithms/data_parallel
run ./scripts/run_pytest.sh 2
run ./scripts/run_pytest.sh 4
run ./scripts/test_oldest_deps.sh
wait "$ft" || failed+=("the fault-tolerance pass")
cat tests/logs/ft-pass.log
for f in "${failed[@]}"; do echo "== FAILED: $f"; done
[ ${#failed[@]} = 0 ]
