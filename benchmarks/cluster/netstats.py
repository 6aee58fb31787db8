"""Bytes that crossed the emulated cluster's links (see README.md here).

Every frame a node sends to another node leaves through the node's veth and
enters the switch through that node's port n<i>, once. The switch ports'
counters therefore give, per node, the bytes the node sent (rx of n<i>) and
received (tx of n<i>); their sum over nodes is the inter-node traffic. Ranks
of one node share memory and never show up here.

Counters are read with ``ip -s -j link`` in the switch namespace, which needs
root (the same as the cluster itself). Counts are Ethernet frame bytes (IP and
TCP headers included, 14-byte Ethernet header included) and include Open MPI's
own out-of-band traffic (launch, wire-up, forwarded stdout), usually some kB.

    from netstats import snapshot, delta, measure
    before = snapshot()
    ...                                  # run a job: run.sh ...
    d = delta(before, snapshot())        # d["total_bytes"], d["nodes"]["mpidp-n0"]["sent_bytes"], ...

    with measure() as m:                 # the same as a context manager
        ...
    print(m.result["total_bytes"])

Command line: ``python3 netstats.py`` prints a snapshot as JSON;
``python3 netstats.py --since FILE`` prints the delta from a snapshot saved
in FILE; ``--save FILE`` saves the current snapshot there.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import time

__all__ = ["snapshot", "delta", "measure", "cluster_name", "NetstatsError"]


class NetstatsError(RuntimeError):
    """The counters cannot be read (cluster not up, not root, no ip)."""


def cluster_name(name=None):
    """The cluster's name: the argument, else $MPIDP_CLUSTER_NAME, else "mpidp"."""
    return name or os.environ.get("MPIDP_CLUSTER_NAME") or "mpidp"


def snapshot(name=None):
    """Current link counters of cluster `name`.

    Returns {"time": monotonic seconds, "cluster": name, "nodes": {node:
    {"sent_bytes", "received_bytes", "sent_packets", "received_packets"}}}.
    "sent" means from the node onto its link, "received" from its link into
    the node.
    """
    name = cluster_name(name)
    ip = shutil.which("ip") or "/usr/sbin/ip"
    if not os.path.exists(ip):
        raise NetstatsError("'ip' (iproute2) not found")
    proc = subprocess.run(
        [ip, "-n", f"{name}-sw", "-s", "-j", "link", "show"],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise NetstatsError(
            f"cannot read the counters of cluster '{name}' (is it up? are you root?): "
            + proc.stderr.strip()
        )
    nodes = {}
    for link in json.loads(proc.stdout):
        m = re.fullmatch(r"n(\d+)", link.get("ifname", ""))
        if not m:
            continue  # lo, br0
        stats = link["stats64"]
        # The switch port's rx is what the node sent, its tx what the node got.
        nodes[f"{name}-n{m.group(1)}"] = {
            "sent_bytes": stats["rx"]["bytes"],
            "received_bytes": stats["tx"]["bytes"],
            "sent_packets": stats["rx"]["packets"],
            "received_packets": stats["tx"]["packets"],
        }
    nodes = dict(sorted(nodes.items(), key=lambda kv: int(kv[0].rsplit("-n", 1)[1])))
    return {"time": time.monotonic(), "cluster": name, "nodes": nodes}


def delta(before, after):
    """Traffic between two snapshots.

    Returns {"seconds", "total_bytes", "total_packets", "nodes": {node:
    {"sent_bytes", "received_bytes", "sent_packets", "received_packets"}}}.
    total_bytes is the sum of what all nodes sent, i.e. every byte that
    crossed from one node to another counted once. A node that appeared in
    between counts from zero.
    """
    nodes = {}
    for node, a in after["nodes"].items():
        b = before["nodes"].get(node, {})
        nodes[node] = {k: v - b.get(k, 0) for k, v in a.items()}
    return {
        "seconds": after["time"] - before["time"],
        "total_bytes": sum(n["sent_bytes"] for n in nodes.values()),
        "total_packets": sum(n["sent_packets"] for n in nodes.values()),
        "nodes": nodes,
    }


class measure:
    """Context manager: ``with measure() as m: ...`` then ``m.result`` is the delta."""

    def __init__(self, name=None):
        self.name = name
        self.result = None

    def __enter__(self):
        self._before = snapshot(self.name)
        return self

    def __exit__(self, *exc):
        self.result = delta(self._before, snapshot(self.name))
        return False


def _main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", help="cluster name (default $MPIDP_CLUSTER_NAME or mpidp)")
    ap.add_argument("--save", metavar="FILE", help="write the current snapshot to FILE")
    ap.add_argument("--since", metavar="FILE", help="print the delta from the snapshot in FILE")
    args = ap.parse_args()
    now = snapshot(args.name)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(now, f)
    if args.since:
        with open(args.since) as f:
            print(json.dumps(delta(json.load(f), now), indent=2))
    elif not args.save:
        print(json.dumps(now, indent=2))


if __name__ == "__main__":
    try:
        _main()
    except NetstatsError as e:
        raise SystemExit(f"netstats: {e}")
