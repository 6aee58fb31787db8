#!/usr/bin/env bash
# mpirun.sh N command...: run `command` on N MPI ranks of this machine.
# More ranks than cores are allowed (--oversubscribe) and idle ranks yield the
# core (mpi_yield_when_idle) so busy-polling ranks do not starve each other.
# Variables named MPIDP_* are passed to every rank.
set -euo pipefail
n=$1
shift
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exports=()
for v in $(compgen -e | grep -E '^(MPIDP_|PYTHON)' || true); do exports+=(-x "$v"); done
exec mpirun -np "$n" --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none \
    "${exports[@]}" "$@"
