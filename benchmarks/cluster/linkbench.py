"""Point-to-point throughput and an allreduce check, for the emulated cluster.

    benchmarks/cluster/run.sh --nodes 2 --ranks-per-node 1 -- python3 benchmarks/cluster/linkbench.py

Rank 0 sends --bytes to a peer --reps times (the peer acknowledges each with
one byte) and reports the time per transfer. The peer is the first rank on
another node (by MPI processor name), or, with --same-node, the first other
rank on rank 0's node. Before that, every rank checks an allreduce of
rank+1 against n(n+1)/2; --allreduce-bytes also times an allreduce. Rank 0 prints one JSON line (prefix "LINKBENCH ").
Needs mpi4py and numpy.
"""

import argparse
import json
import time

import numpy as np
from mpi4py import MPI


def round_trip(comm, rank, peer, message, reply, tags):
    """Rank 0 sends `message` to `peer`, which answers with `reply`; tags =
    (message's, reply's). Ranks other than these two do nothing."""
    if rank == 0:
        comm.Send(message, dest=peer, tag=tags[0])
        comm.Recv(reply, source=peer, tag=tags[1])
    elif rank == peer:
        comm.Recv(message, source=0, tag=tags[0])
        comm.Send(reply, dest=0, tag=tags[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=float, default=20e6, help="bytes per transfer (default 20e6)")
    ap.add_argument("--reps", type=int, default=3, help="transfers to time (default 3)")
    ap.add_argument("--same-node", action="store_true", help="peer on rank 0's node instead of another node")
    ap.add_argument("--allreduce-bytes", type=float, default=0,
                    help="also time an allreduce of this many bytes of float32 (default: off)")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(MPI.Get_processor_name())

    # allreduce check: sum over ranks of (rank + 1), on a vector of float64
    x = np.full(1 << 16, rank + 1.0)
    y = np.empty_like(x)
    comm.Allreduce(x, y, op=MPI.SUM)
    expect = size * (size + 1) / 2
    ok = bool(np.all(y == expect))
    all_ok = comm.allreduce(ok, op=MPI.LAND)

    if args.same_node:
        peers = [r for r in range(1, size) if hosts[r] == hosts[0]]
    else:
        peers = [r for r in range(1, size) if hosts[r] != hosts[0]]
    peer = peers[0] if peers else None

    n = int(args.bytes)
    times = []
    if peer is not None:
        buf = np.ones(n, dtype=np.uint8) if rank == 0 else np.empty(n, dtype=np.uint8)
        ack = np.zeros(1, dtype=np.uint8)
        # Open MPI connects lazily: a one-byte exchange first, so that the
        # timed transfers do not include the TCP connection setup.
        round_trip(comm, rank, peer, ack, ack, tags=(0, 0))
        for _ in range(args.reps):
            comm.Barrier()
            t0 = time.perf_counter()
            round_trip(comm, rank, peer, buf, ack, tags=(1, 2))
            times.append(time.perf_counter() - t0)
    comm.Barrier()

    # allreduce timing: algbw = bytes / time; busbw = algbw * 2(n-1)/n, the
    # traffic per rank of a bandwidth-optimal allreduce (as nccl-tests report it)
    ar_times = []
    if args.allreduce_bytes > 0:
        a = np.ones(int(args.allreduce_bytes) // 4, dtype=np.float32)
        b = np.empty_like(a)
        comm.Allreduce(a, b)  # warm-up
        for _ in range(args.reps):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(a, b)
            ar_times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    ar = None
    if ar_times:
        algbw = a.nbytes / min(ar_times) / 1e6
        ar = {"bytes": a.nbytes, "seconds": ar_times, "algbw_MBps": algbw,
              "busbw_MBps": algbw * 2 * (size - 1) / size}

    if rank == 0:
        best = min(times) if times else None
        print("LINKBENCH " + json.dumps({
            "size": size,
            "hosts": hosts,
            "allreduce_ok": all_ok,
            "allreduce_value": float(y[0]),
            "allreduce_expected": expect,
            "peer": peer,
            "same_node": args.same_node,
            "bytes": n,
            "seconds": times,
            "best_MBps": (n / best / 1e6) if best else None,
            "allreduce_timing": ar,
        }), flush=True)


if __name__ == "__main__":
    main()
