#!/usr/bin/env bash
# Runs an MPI job across the emulated nodes.
#
#   run.sh --nodes N --ranks-per-node K [--rate RATE] [--delay DELAY]
#          [MPIRUN-OPTION...] -- COMMAND [ARG...]
#
# Ranks 0..K-1 run on node 0, K..2K-1 on node 1, and so on. Ranks of one node
# talk through shared memory (vader), ranks of different nodes through TCP over
# the shaped links (btl tcp and Open MPI's own out-of-band traffic restricted
# to the cluster subnet). Brings the cluster up, or grows it, when it has fewer
# than N nodes; --rate/--delay reconfigure it first (see up.sh). Options before
# "--" that are not run.sh's own go to mpirun unchanged (-x VAR, --tag-output,
# --mca ...). The exit status is mpirun's.
#
# mpirun itself runs on node 0 (in its namespace, hostname <name>-n0) and
# starts every other node's orted through ./nsexec, the rsh agent; an orted
# starts its node's ranks, which therefore live in that node's namespace. The
# whole environment of run.sh reaches every rank (the agent runs locally and
# passes it on), so -x is only needed for values that differ from it.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

usage() { sed -n '2,13s/^# \{0,1\}//p' "$0"; }

nodes='' per_node='' up_args=() mpirun_args=()
while [ $# -gt 0 ]; do
    case $1 in
        --nodes) nodes=${2:?--nodes needs a value}; shift 2 ;;
        --ranks-per-node) per_node=${2:?--ranks-per-node needs a value}; shift 2 ;;
        --rate|--delay) up_args+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) mpirun_args+=("$1"); shift ;;
    esac
done
[ $# -gt 0 ] || { usage >&2; die "no command given after --"; }
[[ $nodes =~ ^[1-9][0-9]*$ ]] || die "--nodes N is required (N >= 1)"
[[ $per_node =~ ^[1-9][0-9]*$ ]] || die "--ranks-per-node K is required (K >= 1)"

[ "$(id -u)" = 0 ] || cannot_run "needs root (network namespaces); you are uid $(id -u)"
command -v mpirun >/dev/null 2>&1 || cannot_run "mpirun not found (Debian: apt-get install openmpi-bin)"
mpirun --version 2>/dev/null | grep -q "Open MPI" \
    || cannot_run "mpirun is not Open MPI's ($(command -v mpirun)); the rsh-agent launch used here is Open MPI's"

# Bring up or grow the cluster; never shrink it under someone else's job.
load_state
if ! ns_exists "$SW_NS" || [ "$(node_count)" -lt "$nodes" ] || [ ${#up_args[@]} -gt 0 ]; then
    have=$(node_count)
    [ "$have" -gt "$nodes" ] || have=$nodes
    "$HERE/up.sh" --nodes "$have" ${up_args[@]+"${up_args[@]}"}
fi

# Hostfile for this job: the first N nodes, K slots each. Node names resolve
# inside the cluster through /etc/netns/<ns>/hosts (see up.sh).
job_dir=$(mktemp -d "/tmp/$CLUSTER_NAME-job.XXXXXX")
trap 'rm -rf "$job_dir"' EXIT
for ((i = 0; i < nodes; i++)); do
    echo "$(node_ns "$i") slots=$per_node"
done > "$job_dir/hostfile"

np=$((nodes * per_node))
# The emulated nodes share this machine's cores: each orted believes it has
# them all, so no binding (it would pin every node's rank 0 to core 0), and
# when ranks outnumber cores, ranks yield instead of spinning while they wait.
yield=()
[ "$np" -le "$(nproc)" ] || yield=(--mca mpi_yield_when_idle 1)

# Started from inside an MPI job (a rank, or an mpi4py singleton)? Its
# OMPI_*/PMIX_*/OPAL_* variables would make this mpirun think it is part of
# that job; drop them all.
if env | grep -qE '^(OMPI_COMM_WORLD_SIZE|PMIX_RANK|PMIX_SERVER_URI[0-9]*|OMPI_MCA_ess_base_jobid)='; then
    while read -r var; do unset "$var"; done < <(env | sed -n 's/^\(\(OMPI\|PMIX\|OPAL\)_[A-Za-z0-9_]*\)=.*/\1/p')
fi
# Root is the usual case here (namespaces need it); Open MPI refuses it unless told.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# torch.distributed gloo: use the node's cluster interface (its address also
# works for node-local groups, which then stay on the node's loopback path).
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$IFNAME}
# For programs that want to know they run on the emulated cluster.
export MPIDP_CLUSTER=$CLUSTER_NAME MPIDP_CLUSTER_NODES=$nodes MPIDP_CLUSTER_RANKS_PER_NODE=$per_node \
       MPIDP_CLUSTER_IFNAME=$IFNAME MPIDP_CLUSTER_SUBNET=$SUBNET

head=$(node_ns 0)
# shellcheck disable=SC2054  # (the commas in "self,vader,tcp" are meant)
cmd=(mpirun -np "$np" --hostfile "$job_dir/hostfile" --bind-to none
     --mca plm_rsh_agent "$HERE/nsexec" --mca plm_rsh_no_tree_spawn 1
     --mca pml ob1 --mca osc ^ucx --mca btl self,vader,tcp
     --mca btl_tcp_if_include "$SUBNET" --mca oob_tcp_if_include "$SUBNET"
     ${yield[@]+"${yield[@]}"} ${mpirun_args[@]+"${mpirun_args[@]}"} "$@")
# Not exec: the EXIT trap removes the hostfile afterwards.
set +e
# shellcheck disable=SC2016  # ($1 and $@ belong to the inner shell)
ip netns exec "$head" unshare --uts /bin/sh -c 'hostname "$1" && shift && exec "$@"' run.sh "$head" "${cmd[@]}"
rc=$?
set -e
exit $rc
