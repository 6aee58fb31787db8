#!/usr/bin/env bash
# run.sh NAME NP RANKS_PER_NODE PART...: runs tests/valgrind/job.py PART... on NP
# MPI ranks, each rank under valgrind memcheck, then vg_report.py on the XML.
#
#   NAME            output folder: tests/valgrind/build/NAME/ (vg.<pid>.xml per rank,
#                   job.log with the job's own output)
#   RANKS_PER_NODE  MPIDP_RANKS_PER_NODE for DASO (1: every rank is a node)
#   PART            dp, daso (see job.py)
#
# Environment: VG_TIMEOUT (seconds for the whole mpirun, default 600),
# VALGRIND_FLAGS (extra flags, e.g. --track-origins=yes to find where an
# uninitialised value came from, or --gen-suppressions=all), VG_FAIL_ON_LEAKS
# (1: definite leaks from mpidp fail too; default 1), VG_STUB_DYNAMO (1: stand
# a stub in for torch._dynamo, see job.py; default 1).
#
# Python runs with PYTHONMALLOC=malloc so that valgrind sees every object
# allocation; torch and OpenMP use one thread each, which valgrind (serialising
# threads) runs faster. Suppressions: Open MPI's and Debian's Python ones when
# installed, plus mpidp.supp (start-up noise in other libraries only). Noise
# that is not suppressed does not fail the run: vg_report.py fails only on
# errors with a frame in mpidp's extension or csrc/.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
name=$1 np=$2 rpn=$3
shift 3
OUT=$HERE/build/$name
PY=$ROOT/.venv/bin/python

command -v valgrind >/dev/null || { echo "valgrind not found (Debian: apt-get install valgrind)" >&2; exit 1; }
[ -x "$PY" ] || { echo "$PY missing: run ./scripts/setup_env.sh (make setup) first" >&2; exit 1; }
rm -rf "$OUT"
mkdir -p "$OUT"

supps=(--suppressions="$HERE/mpidp.supp")
for f in /usr/share/openmpi/openmpi-valgrind.supp /usr/lib/valgrind/python3.supp; do
    [ -f "$f" ] && supps+=(--suppressions="$f")
done

vg=(valgrind --tool=memcheck --xml=yes --xml-file="$OUT/vg.%p.xml" --log-file="$OUT/vg.%p.log"
    --error-limit=no --num-callers=40 --child-silent-after-fork=yes
    --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite
    "${supps[@]}" ${VALGRIND_FLAGS:-})

export PYTHONMALLOC=malloc PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# torch._dynamo is stubbed in job.py (its import alone takes minutes under valgrind).
export VG_STUB_DYNAMO=${VG_STUB_DYNAMO:-1}
export MPIDP_RANKS_PER_NODE=$rpn
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A rank of a test process may carry an MPI singleton's variables; drop them.
for v in $(compgen -e | grep -E '^(OMPI_COMM_|OMPI_MCA_orte_|PMIX_|OPAL_)' || true); do unset "$v"; done

echo "== valgrind $name: $np ranks, MPIDP_RANKS_PER_NODE=$rpn, job.py $* (output in $OUT)"
start=$SECONDS
rc=0
timeout --kill-after=30 "${VG_TIMEOUT:-600}" \
    "$ROOT/scripts/mpirun.sh" "$np" "${vg[@]}" "$PY" "$HERE/job.py" "$@" \
    >"$OUT/job.log" 2>&1 || rc=$?
echo "   job exit status $rc after $((SECONDS - start)) s"
grep '^\[valgrind job\]' "$OUT/job.log" | sed 's/^/   /' || true
if [ "$rc" != 0 ]; then
    echo "   the job failed; last lines of $OUT/job.log:"
    tail -n 25 "$OUT/job.log" | sed 's/^/   | /'
fi

report_flags=()
[ "${VG_FAIL_ON_LEAKS:-1}" = 1 ] && report_flags+=(--fail-on-leaks)
vrc=0
"$PY" "$HERE/vg_report.py" "${report_flags[@]}" "$OUT" || vrc=$?
[ "$rc" = 0 ] || exit 3
exit "$vrc"
