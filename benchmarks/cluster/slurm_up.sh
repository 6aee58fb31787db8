#!/usr/bin/env bash
# Starts a one-node Slurm on this machine (slurmctld + slurmd on localhost,
# munge for authentication) so jobs can be launched the way a cluster does:
# srun -n 4 --mpi=pmix ..., salloc, sbatch.
#
#   slurm_up.sh [--cpus N]      (N: CPUs the node declares, default max(4, cores))
#
# Everything of ours lives in /run/mpidp-slurm (config, state, spool, logs,
# pid files); the daemons listen on ports 16817/16818, not Slurm's 6817/6818,
# so a real Slurm on the machine is not disturbed. Clients find the config
# through SLURM_CONF:
#
#   export SLURM_CONF=/run/mpidp-slurm/slurm.conf
#
# Installs the Debian packages (slurmctld slurmd slurm-client munge) when
# they are missing. Idempotent: daemons already running with the same
# configuration are left alone. Exit 77 when it cannot run here.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=slurm_lib.sh
. "$HERE/slurm_lib.sh"

cpus=''
while [ $# -gt 0 ]; do
    case $1 in
        --cpus) cpus=${2:?--cpus needs a value}; shift 2 ;;
        -h|--help) sed -n '2,18s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done
[ -n "$cpus" ] || { cpus=$(nproc); [ "$cpus" -ge 4 ] || cpus=4; }
[[ $cpus =~ ^[1-9][0-9]*$ ]] || die "--cpus must be a positive number"

[ "$(id -u)" = 0 ] || cannot_run "needs root (daemons, /run, package installation); you are uid $(id -u)"

# --- packages
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v srun >/dev/null || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || cannot_run "Slurm is not installed and there is no apt-get to install it"
    say "installing slurmctld slurmd slurm-client munge (Debian packages)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi

mkdir -p "$SLURM_DIR"/{state,spool,log,tmp}

# --- munge: the only authentication Slurm 22.05 has. Reuse a running munged
# (e.g. the machine's own service); otherwise start one as user munge.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    [ -s /etc/munge/munge.key ] || { say "creating /etc/munge/munge.key"; mungekey --create; chown munge:munge /etc/munge/munge.key; }
    install -d -o munge -g munge -m 0755 /run/munge
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged
    echo yes > "$SLURM_DIR/munged-ours"     # slurm_down.sh stops only a munged we started
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || die "munged does not answer (see /var/log/munge/munged.log)"
fi

# --- configuration: one node, this machine, under its own hostname
host=$(hostname -s)
new_conf=$(cat <<CONF
# Written by benchmarks/cluster/slurm_up.sh: a one-node Slurm on localhost.
ClusterName=mpidp
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
# Job ids start at 1 again with each fresh state: steps' PMIx directories
# (spmix_appdir_<uid>_<job>.<step>) go here, not to /tmp, where one left by
# an earlier Slurm's job 1 would make this one's fail to launch.
TmpFS=$SLURM_DIR/tmp
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd.log
# No cgroups: track processes through /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Believe the CPU count below, not the hardware (more tasks than cores).
SlurmdParameters=config_overrides
MpiDefault=pmix
ReturnToService=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
)
if [ "$(cat "$SLURM_CONF" 2>/dev/null)" != "$new_conf" ]; then
    if daemon_running slurmctld || daemon_running slurmd; then
        say "configuration changed: restarting the daemons"
        stop_daemon slurmd; stop_daemon slurmctld
    fi
    printf '%s\n' "$new_conf" > "$SLURM_CONF"
fi
export SLURM_CONF

# --- daemons (they daemonize themselves and write their pid files)
if ! daemon_running slurmctld; then
    say "starting slurmctld"
    slurmctld -f "$SLURM_CONF"
fi
if ! daemon_running slurmd; then
    say "starting slurmd (node $host, $cpus CPUs)"
    slurmd -f "$SLURM_CONF"
fi

# --- wait until the node takes jobs
state=''
for _ in $(seq 100); do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
    case $state in idle|mixed|allocated) break ;; esac
    case $state in drain*|down*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;; esac
    sleep 0.2
done
case $state in
    idle|mixed|allocated) ;;
    *) die "node $host is '${state:-not registered}' after 20 s; see $SLURM_DIR/log/slurmd.log and slurmctld.log" ;;
esac
say "up: node $host ($cpus CPUs, state $state), partition debug"
say "use: export SLURM_CONF=$SLURM_CONF; srun -n 4 --mpi=pmix <program>"
