#!/usr/bin/env bash
# Stops the one-node Slurm of slurm_up.sh: cancels its jobs, stops slurmd and
# slurmctld (by their pid files), stops munged if slurm_up.sh started it, and
# removes /run/mpidp-slurm. Safe to run any number of times.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=slurm_lib.sh
. "$HERE/slurm_lib.sh"

[ "$(id -u)" = 0 ] || cannot_run "needs root to stop the daemons; you are uid $(id -u)"

if daemon_running slurmctld; then
    SLURM_CONF=$SLURM_CONF scancel --full --quiet --user=root 2>/dev/null || true
fi
stop_daemon slurmd
stop_daemon slurmctld
if [ -f "$SLURM_DIR/munged-ours" ]; then
    pid=$(cat /run/munge/munged.pid 2>/dev/null || true)
    if [ -n "$pid" ] && [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = munged ]; then
        say "stopping munged (pid $pid)"
        kill -TERM "$pid"
    fi
    rm -f "$SLURM_DIR/munged-ours"
fi
rm -rf "$SLURM_DIR"
say "down"
