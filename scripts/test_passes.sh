#!/usr/bin/env bash
# test_passes.sh: every pass of `make test` after the set-up: two lines, then three passes.
#   1. the fault-tolerance pass (scripts/test_fault_tolerance.sh): the longest,
#      and the one that waits most (its jobs' start-up, each replacement's
#      spawn, the deadlines its tests provoke);
#   2. beside it, one after another: the C tests (ASan/UBSan), pytest at 1
#      rank, at 3 (the ranks3 tests) and DataParallel's tests with the
#      Python gradient hook, which fill the time the first line waits;
# then pytest at 2 and 4 ranks, and at 2 against the oldest mpi4py we claim.
# The fault-tolerance pass writes to tests/logs/ft-pass.log (its own pytest
# temporary directory), shown when all have ended; the exit status is
# nonzero when any pass failed, and every pass runs whatever failed before it.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_ft_env.sh || exit 1     # its build before the tests, not beside them
mkdir -p tests/logs
./scripts/test_fault_tolerance.sh --basetemp "${TMPDIR:-/tmp}/mpidp-ft-pass" \
    >tests/logs/ft-pass.log 2>&1 &
ft=$!
failed=()
run() { "$@" || failed+=("$*"); }
run make --no-print-directory ctest
run ./scripts/run_pytest.sh 1
run ./scripts/run_pytest.sh 3 -m "ranks3 and not serial"
run env MPIDP_GRAD_HOOK=python ./scripts/run_pytest.sh 2 tests/algorithms/data_parallel
wait "$ft" || failed+=("the fault-tolerance pass (tests/logs/ft-pass.log)")
# After it, not beside it: beside it, gloo's TCP mesh set-up at 4 ranks
# failed once ("Connection closed by peer") on the loaded 2 cores.
run ./scripts/run_pytest.sh 2
run ./scripts/run_pytest.sh 4
run ./scripts/test_oldest_deps.sh
cat tests/logs/ft-pass.log
for f in "${failed[@]}"; do echo "== FAILED: $f"; done
exit $(( ${#failed[@]} != 0 ))
