#!/usr/bin/env bash
# Tears the emulated cluster down: ends any process still inside its
# namespaces (orteds or ranks of a crashed job), deletes the node and switch
# namespaces (their veth pairs and the bridge vanish with them), and removes
# /etc/netns/<ns>/ and the state in /run. Safe to run any number of times,
# also after a crash half-way through up.sh. The root namespace is never
# touched, so there is nothing to restore there.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

[ "$(id -u)" = 0 ] || cannot_run "needs root to delete network namespaces; you are uid $(id -u)"
command -v ip >/dev/null 2>&1 || cannot_run "'ip' not found (Debian: apt-get install iproute2)"

# Every namespace named after this cluster: nodes, switch, and probes left by
# an interrupted preflight.
mapfile -t spaces < <(ip netns list 2>/dev/null | awk '{print $1}' \
    | grep -E "^$CLUSTER_NAME-(n[0-9]+|sw|probe[0-9]+)$" || true)
for ns in "${spaces[@]}"; do
    say "deleting namespace $ns"
    delete_ns "$ns"
done
# /etc/netns entries whose namespace is already gone
for d in /etc/netns/"$CLUSTER_NAME"-*; do
    [ -e "$d" ] && rm -rf "$d"
done
rmdir /etc/netns 2>/dev/null || true     # only if empty, i.e. we made it
rm -rf "$STATE_DIR"
say "down: no $CLUSTER_NAME cluster namespaces left"
