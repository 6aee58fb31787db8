# shellcheck shell=bash disable=SC2034  # (variables are used by the scripts that source this)
# Shared settings for slurm_up.sh, slurm_down.sh and slurm_hello.sh; sourced, not run.

SLURM_DIR=/run/mpidp-slurm
SLURM_CONF=$SLURM_DIR/slurm.conf
CTLD_PORT=16817      # not Slurm's default 6817/6818: leaves a real Slurm alone
SLURMD_PORT=16818
EXIT_CANNOT_RUN=77

say()  { printf '[slurm] %s\n' "$*"; }
die()  { printf '[slurm] ERROR: %s\n' "$*" >&2; exit 1; }
cannot_run() { printf '[slurm] cannot run here: %s\n' "$*" >&2; exit "$EXIT_CANNOT_RUN"; }

# True when the daemon ($1: slurmctld or slurmd) whose pid file is ours runs.
daemon_running() {
    local pid
    pid=$(cat "$SLURM_DIR/$1.pid" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = "$1" ]
}

# Stops the daemon $1 through its pid file (only the process we started).
stop_daemon() {
    local pid
    daemon_running "$1" || { rm -f "$SLURM_DIR/$1.pid"; return 0; }
    pid=$(cat "$SLURM_DIR/$1.pid")
    say "stopping $1 (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do daemon_running "$1" || break; sleep 0.1; done
    if daemon_running "$1"; then kill -KILL "$pid" 2>/dev/null || true; fi
    rm -f "$SLURM_DIR/$1.pid"
}
