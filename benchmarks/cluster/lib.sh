# shellcheck shell=bash disable=SC2034  # (variables are used by the scripts that source this)
# Shared settings and helpers for the emulated cluster scripts; sourced, not run.
#
# Layout (all of it lives in network namespaces; the root namespace, where the
# machine's real interfaces are, is never touched):
#
#   <name>-sw            "switch" namespace holding bridge br0
#   <name>-n0..n<N-1>    one namespace per emulated node; the node name, the
#                        namespace name and (under run.sh) the hostname agree
#   emu0 (in node i) <--veth--> n<i> (in the switch, enslaved to br0)
#   node i has 198.18.0.<i+1>/24 on emu0 (198.18.0.0/15 is reserved for
#   benchmarking, RFC 2544) and its own loopback; no routes, no gateway.
#
# Shaping: tbf on emu0's egress (node -> switch) and on n<i>'s egress
# (switch -> node), so every node link is limited to RATE in each direction,
# like a full-duplex NIC. netem (latency) is added only if the kernel has it.
#
# MPIDP_CLUSTER_NAME (default "mpidp") names the cluster, so a test can run its
# own cluster without disturbing one someone else brought up.

CLUSTER_NAME=${MPIDP_CLUSTER_NAME:-mpidp}
SW_NS=$CLUSTER_NAME-sw
SUBNET=198.18.0.0/24
IFNAME=emu0                       # node side of each veth, same name in every node
STATE_DIR=/run/$CLUSTER_NAME-cluster
EXIT_CANNOT_RUN=77                # "cannot run here" (also what automake uses for SKIP)
MAX_NODES=250

say()  { printf '[cluster] %s\n' "$*"; }
warn() { printf '[cluster] WARNING: %s\n' "$*" >&2; }
die()  { printf '[cluster] ERROR: %s\n' "$*" >&2; exit 1; }
cannot_run() { printf '[cluster] cannot run here: %s\n' "$*" >&2; exit "$EXIT_CANNOT_RUN"; }

node_ns()   { echo "$CLUSTER_NAME-n$1"; }
node_addr() { echo "198.18.0.$(($1 + 1))"; }

# Node namespaces of this cluster that exist now, in node order.
existing_nodes() {
    ip netns list 2>/dev/null | awk '{print $1}' \
        | sed -n "s/^$CLUSTER_NAME-n\([0-9][0-9]*\)\$/\1/p" | sort -n \
        | while read -r i; do node_ns "$i"; done
}
node_count() { existing_nodes | wc -l; }

ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx -- "$1"; }

# Checks that this process can build the cluster: root, ip/tc/unshare,
# namespaces, veth, bridge, tbf. Exits 77 naming exactly what is missing. The
# probes run in a scratch namespace that is deleted again.
preflight() {
    [ "$(id -u)" = 0 ] || cannot_run "needs root (network namespaces, veth and tc need CAP_NET_ADMIN and CAP_SYS_ADMIN); you are uid $(id -u)"
    local tool
    for tool in ip tc unshare; do
        command -v "$tool" >/dev/null 2>&1 || cannot_run "'$tool' not found (Debian: apt-get install iproute2 util-linux)"
    done
    local probe=$CLUSTER_NAME-probe$$ err
    err=$(ip netns add "$probe" 2>&1) || cannot_run "'ip netns add' failed: $err"
    probe_fail() { ip netns del "$probe" 2>/dev/null || true; cannot_run "$@"; }
    err=$(ip -n "$probe" link add pa type veth peer name pb 2>&1) \
        || probe_fail "cannot create a veth pair: $err (needs CAP_NET_ADMIN and a kernel with CONFIG_VETH)"
    err=$(ip -n "$probe" link add pbr type bridge 2>&1) \
        || probe_fail "cannot create a bridge: $err (needs a kernel with CONFIG_BRIDGE)"
    err=$(tc -n "$probe" qdisc add dev pa root tbf rate 1gbit burst 64kb latency 50ms 2>&1) \
        || probe_fail "cannot add a tc tbf qdisc: $err (needs a kernel with CONFIG_NET_SCH_TBF)"
    ip netns del "$probe"
}

# Prints "yes" when netem can be used, else the kernel's error message.
netem_support() {
    local probe=$CLUSTER_NAME-probe$$ err
    ip netns add "$probe" >/dev/null 2>&1 || { echo "netns probe failed"; return; }
    if err=$(tc -n "$probe" qdisc add dev lo root netem delay 1ms 2>&1); then
        echo yes
    else
        echo "${err:-unknown error}"
    fi
    ip netns del "$probe" 2>/dev/null || true
}

# Reads the settings recorded by up.sh (NODES RATE DELAY NETEM) if any.
load_state() {
    NODES=0 RATE=none DELAY=0ms NETEM=unknown
    # shellcheck disable=SC1091
    [ -f "$STATE_DIR/config" ] && . "$STATE_DIR/config"
    return 0
}

# Converts a tc rate ("1gbit", "100mbit", "500kbit", "2.5gbit", "10mbps") to
# bits per second; fails on anything else.
rate_bits() {
    awk -v r="$1" 'BEGIN {
        if (match(r, /^[0-9]+(\.[0-9]+)?/) == 0) exit 1
        v = substr(r, 1, RLENGTH); u = tolower(substr(r, RLENGTH + 1))
        m["bit"] = 1; m["kbit"] = 1e3; m["mbit"] = 1e6; m["gbit"] = 1e9; m["tbit"] = 1e12
        m["bps"] = 8; m["kbps"] = 8e3; m["mbps"] = 8e6; m["gbps"] = 8e9
        if (!(u in m)) exit 1
        printf "%.0f\n", v * m[u]
    }'
}

# Ends every process still inside namespace $1 (left over from a crashed job:
# an orted or a rank), first politely, then for good. Only processes in our
# own cluster namespaces are touched, by pid.
kill_ns_pids() {
    local ns=$1 pids i
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)
    [ -n "${pids// /}" ] || return 0
    say "ending processes left in $ns: $pids"
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for i in 1 2 3 4 5 6 7 8 9 10; do
        pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)
        [ -n "${pids// /}" ] || return 0
        sleep 0.2
    done
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
}

# Deletes namespace $1 with everything in it (its veth ends go with it, which
# also removes the peer in the switch).
delete_ns() {
    ns_exists "$1" || return 0
    kill_ns_pids "$1"
    ip netns del "$1"
    rm -rf "/etc/netns/$1"
}
