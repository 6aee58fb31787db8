#!/usr/bin/env bash
# Brings the emulated cluster up, or reconfigures the one that is up.
#
#   up.sh [--nodes N] [--rate RATE] [--delay DELAY]
#
#   --nodes N      number of emulated nodes (1..250)
#   --rate RATE    per-node link rate, each direction, in tc units: 1gbit,
#                  100mbit, 10gbit, ...; "none" leaves the links unshaped
#   --delay DELAY  one-way latency between two nodes (netem on the sending
#                  node's uplink), e.g. 0ms, 1ms, 250us; needs sch_netem
#
# An option left out keeps the setting of the cluster that is up, or takes
# the default (2 nodes, 1gbit, 0ms) when none is. Running it again with the
# same settings keeps nodes and addresses (it only re-applies the qdiscs).
# See README.md in this folder for the layout.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

usage() { sed -n '2,16s/^# \{0,1\}//p' "$0"; }

want_nodes='' want_rate='' want_delay=''
while [ $# -gt 0 ]; do
    case $1 in
        --nodes) want_nodes=${2:?--nodes needs a value}; shift 2 ;;
        --rate)  want_rate=${2:?--rate needs a value}; shift 2 ;;
        --delay) want_delay=${2:?--delay needs a value}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done

preflight

# Missing options keep what is in force (only if the cluster is really up).
load_state
ns_exists "$SW_NS" || { NODES=0; RATE=1gbit; DELAY=0ms; }
[ "$NODES" -gt 0 ] || NODES=2
NODES=${want_nodes:-$NODES}
RATE=${want_rate:-$RATE}
DELAY=${want_delay:-$DELAY}

if ! [[ $NODES =~ ^[0-9]+$ ]] || [ "$NODES" -lt 1 ] || [ "$NODES" -gt $MAX_NODES ]; then
    die "--nodes must be 1..$MAX_NODES, got '$NODES'"
fi
case $RATE in none|off|0) RATE=none ;; esac
if [ "$RATE" != none ]; then
    RATE_BITS=$(rate_bits "$RATE") || die "--rate '$RATE' is not a tc rate like 1gbit, 100mbit, 500kbit"
fi
[[ $DELAY =~ ^[0-9]+(\.[0-9]+)?(s|ms|us)$ ]] || die "--delay '$DELAY' is not a time like 0ms, 1ms, 250us"
delay_zero=no
[[ $DELAY =~ ^0+(\.0+)?(s|ms|us)$ ]] && delay_zero=yes

NETEM=$(netem_support | tr -d "'\\\\")     # quotes dropped: it is written to a sourced file
if [ "$delay_zero" = no ] && [ "$NETEM" != yes ]; then
    warn "--delay $DELAY asked for, but this kernel has no netem qdisc (tc says: \"$NETEM\"; kernel option CONFIG_NET_SCH_NETEM)."
    warn "going on WITHOUT added latency: links are shaped by rate only."
fi

# --- switch: a namespace with one bridge, so the root namespace stays as it is
if ! ns_exists "$SW_NS"; then
    say "creating switch namespace $SW_NS"
    ip netns add "$SW_NS"
fi
# IPv6 off in our namespaces: no router solicitations or DAD packets on the
# links, so the byte counters show MPI traffic and little else.
ip netns exec "$SW_NS" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
ip -n "$SW_NS" link set lo up
if ! ip -n "$SW_NS" link show br0 >/dev/null 2>&1; then
    ip -n "$SW_NS" link add br0 type bridge stp_state 0 forward_delay 0
fi
ip -n "$SW_NS" link set br0 up

# --- nodes
node_ok() {   # a node is complete when both veth ends exist and are attached
    local i=$1 ns
    ns=$(node_ns "$i")
    ns_exists "$ns" \
        && ip -n "$ns" -br addr show dev "$IFNAME" 2>/dev/null | grep -q "$(node_addr "$i")/24" \
        && ip -n "$SW_NS" link show "n$i" 2>/dev/null | grep -q "master br0"
}
make_node() {
    local i=$1 ns
    ns=$(node_ns "$i")
    delete_ns "$ns"                       # half-made after a crash: start over
    ip -n "$SW_NS" link del "n$i" 2>/dev/null || true
    say "creating node $ns ($(node_addr "$i"))"
    ip netns add "$ns"
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
    ip -n "$ns" link set lo up            # node-local TCP (gloo store, ...) needs loopback
    ip -n "$SW_NS" link add "n$i" type veth peer name "$IFNAME" netns "$ns"
    ip -n "$SW_NS" link set "n$i" master br0 up
    ip -n "$ns" addr add "$(node_addr "$i")/24" dev "$IFNAME"
    ip -n "$ns" link set "$IFNAME" up
}
for ((i = 0; i < NODES; i++)); do
    node_ok "$i" || make_node "$i"
done
# nodes beyond --nodes go away
for ns in $(existing_nodes); do
    i=${ns##*-n}
    if [ "$i" -ge "$NODES" ]; then
        say "removing node $ns"
        delete_ns "$ns"
    fi
done

# --- shaping
# tbf burst: at least 64 KiB (one TSO/GSO packet on a veth) and 2 ms at the
# rate, so the bucket never throttles below RATE; queue up to 50 ms of data.
shape() {   # shape NS DEV WITH_DELAY
    local ns=$1 dev=$2 with_delay=$3 burst
    tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
    local netem=no
    [ "$with_delay" = yes ] && [ "$delay_zero" = no ] && [ "$NETEM" = yes ] && netem=yes
    if [ "$RATE" != none ]; then
        burst=$(( RATE_BITS / 8 / 500 ))
        [ "$burst" -ge 65536 ] || burst=65536
    fi
    if [ "$netem" = yes ] && [ "$RATE" != none ]; then
        # netem as root, tbf as its child: the layout tc-netem(8) documents
        tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$DELAY" limit 100000
        tc -n "$ns" qdisc add dev "$dev" parent 1:1 handle 10: tbf rate "$RATE" burst "$burst" latency 50ms
    elif [ "$netem" = yes ]; then
        tc -n "$ns" qdisc add dev "$dev" root netem delay "$DELAY" limit 100000
    elif [ "$RATE" != none ]; then
        tc -n "$ns" qdisc add dev "$dev" root tbf rate "$RATE" burst "$burst" latency 50ms
    fi
}
for ((i = 0; i < NODES; i++)); do
    shape "$(node_ns "$i")" "$IFNAME" yes   # uplink: node -> switch (carries the delay)
    shape "$SW_NS" "n$i" no                 # downlink: switch -> node
done

# --- names: /etc/netns/<ns>/hosts is bind-mounted over /etc/hosts by
# "ip netns exec", so inside the cluster every node name resolves to its
# 198.18 address without DNS and without touching the real /etc/hosts. The
# ::ffff: (IPv4-mapped) lines answer reverse lookups of peers accepted on
# dual-stack sockets (torch's TCPStore warns "hostname of the client socket
# cannot be retrieved" otherwise); forward lookups still give IPv4 only.
hosts=$(
    printf '127.0.0.1\tlocalhost\n::ffff:127.0.0.1\tlocalhost\n'
    for ((i = 0; i < NODES; i++)); do
        printf '%s\t%s\n::ffff:%s\t%s\n' "$(node_addr "$i")" "$(node_ns "$i")" "$(node_addr "$i")" "$(node_ns "$i")"
    done
)
for ns in "$SW_NS" $(existing_nodes); do
    mkdir -p "/etc/netns/$ns"
    printf '%s\n' "$hosts" > "/etc/netns/$ns/hosts"
done

# --- record the settings for run.sh, status.sh and the next up.sh
mkdir -p "$STATE_DIR"
cat > "$STATE_DIR/config" <<CONF
NODES=$NODES
RATE=$RATE
DELAY=$DELAY
NETEM='$NETEM'
CONF

if [ "$delay_zero" = no ] && [ "$NETEM" != yes ]; then
    shown_delay="none (asked for $DELAY; no netem in this kernel)"
else
    shown_delay=$DELAY
fi
say "up: $NODES nodes ($(node_ns 0) .. $(node_ns $((NODES - 1)))), subnet $SUBNET, rate ${RATE} per link and direction, added latency $shown_delay"
