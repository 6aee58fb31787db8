#!/usr/bin/env bash
# Shows the emulated cluster: the settings up.sh recorded, each node's
# address and link state, the qdiscs actually in force on both ends of each
# link, the byte counters, and any process still running inside a node.
# Exit status: 0 when the cluster is up, 3 when it is not, 77 when it cannot
# be inspected here (not root, no ip).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

[ "$(id -u)" = 0 ] || cannot_run "needs root to look into network namespaces; you are uid $(id -u)"
command -v ip >/dev/null 2>&1 || cannot_run "'ip' not found (Debian: apt-get install iproute2)"

if ! ns_exists "$SW_NS"; then
    say "cluster '$CLUSTER_NAME' is down (no namespace $SW_NS)"
    leftovers=$(existing_nodes | tr '\n' ' ')
    [ -z "$leftovers" ] || warn "node namespaces without a switch: $leftovers(benchmarks/cluster/down.sh removes them)"
    exit 3
fi

load_state
say "cluster '$CLUSTER_NAME': $(node_count) nodes, subnet $SUBNET, switch namespace $SW_NS (bridge br0)"
say "settings from up.sh: rate=$RATE delay=$DELAY"
[ "$NETEM" = yes ] || say "netem: not available (tc: \"$NETEM\"), so no added latency"

for ns in $(existing_nodes); do
    i=${ns##*-n}
    echo
    echo "== $ns  $(ip -n "$ns" -br -4 addr show dev "$IFNAME" 2>/dev/null | awk '{print $2, $3}')"
    echo "   uplink   ($ns:$IFNAME egress):   $(tc -n "$ns" qdisc show dev "$IFNAME" 2>/dev/null | paste -sd ';' -)"
    echo "   downlink ($SW_NS:n$i egress): $(tc -n "$SW_NS" qdisc show dev "n$i" 2>/dev/null | paste -sd ';' -)"
    ip -n "$SW_NS" -s link show "n$i" 2>/dev/null \
        | awk '/RX:/{getline; rx=$1} /TX:/{getline; tx=$1} END{printf "   bytes: sent by node %s, received by node %s\n", rx, tx}'
    pids=$(ip netns pids "$ns" 2>/dev/null | paste -sd , -)
    [ -z "$pids" ] || echo "   processes: $(ps -o pid=,comm= -p "$pids" 2>/dev/null | awk '{printf "%s(%s) ", $2, $1}')"
done
exit 0
