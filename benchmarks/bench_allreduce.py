"""Allreduce throughput: fp32 MPI_SUM against bf16 with mpidp's native op and a Python op.

    ./scripts/mpirun.sh 2 .venv/bin/python benchmarks/bench_allreduce.py [--json] [--n N] [--reps R]

Every method sums the same --n elements (default 16 Mi) over all ranks, in
place. Per repetition the input is restored (untimed), the ranks meet at a
barrier, and the time is the slowest rank's; reported is the median (and best)
over --reps repetitions after one warm-up, as elements per second, and ratios.
The methods take turns (round-robin), so other load affects them alike.

Which MPI call runs matters as much as the op, so methods are grouped by call:
  [Allreduce]   mpi4py comm.Allreduce(IN_PLACE, ...): blocking MPI_Allreduce,
                Open MPI's coll/tuned algorithms
  [Iallreduce]  mpi4py comm.Iallreduce(IN_PLACE, ...).Wait(): coll/libnbc
  [mpidp]       mpidp.allreduce(tensor): MPI_Iallreduce + wait, coll/libnbc
and ratios are taken within a group. Ops:
  fp32 MPI_SUM             the baseline (MPI.FLOAT)
  bf16 native op           mpidp's C sum op on its bf16 datatype (half the bytes);
                           through mpi4py via mpidp._C.mpi_half_handles()
  fp16 native op           the same on fp16
  fp32 -> bf16 wire        mpidp.allreduce(fp32, wire_dtype=bf16): pack, reduce
                           with the native op, unpack; 2^22-element chunks, 2 in flight
  fp32 -> uint8 wire       mpidp.allreduce(fp32, wire_dtype=uint8): the 8-bit
                           quantized allreduce (quantize, MPI_Ialltoall, decode
                           and sum, requantize, MPI_Iallgather, decode)
  bf16 python op           an op from MPI.Op.Create whose Python function views
                           both buffers as torch bf16 tensors (torch.frombuffer)
                           and adds in place: the idea of Heat's mpi_sum_bfloat
                           (torch adds bf16 in fp32 and rounds once, like mpidp)
  bf16 python op (copies)  the same, copying both buffers into new tensors and
                           the sum back into the output buffer, as Heat's
                           __sum_bfloat_cb does (Storage.from_buffer copies)
Goal: bf16 native >= 1.3x fp32 and >= 10x the Python op.

"B/elem" is what each rank sends per element reduced, from the algorithms
(not measured): 2 (P - 1) / P times the wire element's bytes for the
reduce-scatter + allgather allreduces (Rabenseifner, ring) and for the
quantized one (whose element is 264/256 bytes: a record of 256 codes and an
8-byte header); on a link-bound cluster time follows it (bench_daso.py
measures the bytes on emulated links).

Open MPI 4.1's own MPI_Iallreduce algorithm for in-place calls is slow for
large messages; importing mpidp sets coll_libnbc_iallreduce_algorithm to 3
(Rabenseifner) unless OMPI_MCA_coll_libnbc_iallreduce_algorithm is set (1
ring, 2 binomial, 3 rabenseifner, 4 recursive doubling, 0 Open MPI's choice).
Set it in mpirun's environment to compare: mpirun forwards OMPI_MCA_*
variables to every rank, and the table header shows the value in force on
rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import mpidp
from mpi4py import MPI

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()

BF16 = MPI.BYTE.Create_contiguous(2).Commit()


def _sum_bf16_view(inbuf, outbuf, datatype):
    """out += in, elementwise, on bf16 buffers viewed (not copied) as tensors."""
    a = torch.frombuffer(inbuf, dtype=torch.bfloat16)
    b = torch.frombuffer(outbuf, dtype=torch.bfloat16)
    b.add_(a)


def _sum_bf16_copies(inbuf, outbuf, datatype):
    """Heat's way: copy both buffers into new tensors, add, copy the sum back."""
    a = torch.frombuffer(bytearray(inbuf), dtype=torch.bfloat16)
    b = torch.frombuffer(bytearray(outbuf), dtype=torch.bfloat16)
    b += a
    memoryview(outbuf).cast("B")[:] = memoryview(b.view(torch.uint8).numpy())


PY_SUM_VIEW = MPI.Op.Create(_sum_bf16_view, commute=True)
PY_SUM_COPIES = MPI.Op.Create(_sum_bf16_copies, commute=True)


def timed_interleaved(methods, reps):
    """For each (run, restore): the median and best over `reps` of the slowest
    rank's time of run(), after one warm-up. The methods take turns
    (round-robin), so load from elsewhere on the machine affects them alike."""
    times = [[] for _ in methods]
    for i in range(reps + 1):
        for k, (run, restore) in enumerate(methods):
            restore()
            COMM.Barrier()
            t0 = time.perf_counter()
            run()
            t = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i:
                times[k].append(t)
    return [(statistics.median(t), min(t)) for t in times]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--n", type=int, default=16 * (1 << 20), help="elements (default 16 Mi)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--skip-python-op", action="store_true",
                    help="leave out the (slow) Python-callback ops")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.n

    g = torch.Generator().manual_seed(RANK)
    x32 = torch.randn(n, generator=g)
    x16 = x32.to(torch.bfloat16)
    h16 = x32.to(torch.float16)
    t32 = x32.clone()
    t16 = x16.clone()
    th = h16.clone()
    n32 = t32.numpy()
    n16 = t16.view(torch.int16).numpy()

    handles = mpidp._C.mpi_half_handles()
    NATIVE_BF16 = MPI.Datatype.f2py(handles["bfloat16"])
    NATIVE_SUM = MPI.Op.f2py(handles["sum"])

    def blocking(buf, op):
        return lambda: COMM.Allreduce(MPI.IN_PLACE, buf, op=op)

    def nonblocking(buf, op):
        return lambda: COMM.Iallreduce(MPI.IN_PLACE, buf, op=op).Wait()

    r32, r16, rh = (lambda: t32.copy_(x32)), (lambda: t16.copy_(x16)), (lambda: th.copy_(h16))
    # (name, MPI call family, run, restore)
    methods = [
        ("fp32 MPI_SUM", "Allreduce", blocking([n32, MPI.FLOAT], MPI.SUM), r32),
        ("bf16 native op", "Allreduce", blocking([n16, NATIVE_BF16], NATIVE_SUM), r16),
        ("bf16 python op", "Allreduce", blocking([n16, BF16], PY_SUM_VIEW), r16),
        ("bf16 python op (copies)", "Allreduce", blocking([n16, BF16], PY_SUM_COPIES), r16),
        ("fp32 MPI_SUM", "Iallreduce", nonblocking([n32, MPI.FLOAT], MPI.SUM), r32),
        ("bf16 python op", "Iallreduce", nonblocking([n16, BF16], PY_SUM_VIEW), r16),
        ("fp32 mpidp", "mpidp", lambda: mpidp.allreduce(t32), r32),
        ("bf16 native op", "mpidp", lambda: mpidp.allreduce(t16), r16),
        ("fp16 native op", "mpidp", lambda: mpidp.allreduce(th), rh),
        ("fp32 -> bf16 wire", "mpidp", lambda: mpidp.allreduce(t32, wire_dtype=torch.bfloat16), r32),
        ("fp32 -> uint8 wire", "mpidp", lambda: mpidp.allreduce(t32, wire_dtype=torch.uint8), r32),
    ]
    if args.skip_python_op:
        methods = [m for m in methods if "python" not in m[0]]

    # Sanity: at 2 ranks (one addition, rounded once either way) the Python op,
    # the native op through mpi4py and mpidp.allreduce give the same bits.
    if SIZE == 2:
        a = x16.clone()
        mpidp.allreduce(a)
        for buf_type, op in ((BF16, PY_SUM_VIEW), (NATIVE_BF16, NATIVE_SUM)):
            b = x16.clone()
            COMM.Allreduce(MPI.IN_PLACE, [b.view(torch.int16).numpy(), buf_type], op=op)
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "the ops disagree"

    results = {}
    timings = timed_interleaved([(run, restore) for _, _, run, restore in methods], args.reps)
    for (name, family, _, _), (med, best) in zip(methods, timings):
        results[f"{name} [{family}]"] = {"median_s": med, "best_s": best, "elems_per_s": n / med}

    def rate(name):
        return results[name]["elems_per_s"] if name in results else float("nan")

    ratios = {
        "native_vs_fp32 [Allreduce]": rate("bf16 native op [Allreduce]") / rate("fp32 MPI_SUM [Allreduce]"),
        "native_vs_python_op [Allreduce]": rate("bf16 native op [Allreduce]") / rate("bf16 python op [Allreduce]"),
        "native_vs_python_op_copies [Allreduce]":
            rate("bf16 native op [Allreduce]") / rate("bf16 python op (copies) [Allreduce]"),
        "mpidp_native_vs_fp32 [Iallreduce]": rate("bf16 native op [mpidp]") / rate("fp32 MPI_SUM [Iallreduce]"),
        "mpidp_native_vs_fp32_mpidp": rate("bf16 native op [mpidp]") / rate("fp32 mpidp [mpidp]"),
        "mpidp_native_vs_python_op [Iallreduce]":
            rate("bf16 native op [mpidp]") / rate("bf16 python op [Iallreduce]"),
        "wire_bf16_vs_fp32_mpidp": rate("fp32 -> bf16 wire [mpidp]") / rate("fp32 mpidp [mpidp]"),
        "wire_u8_vs_fp32_mpidp": rate("fp32 -> uint8 wire [mpidp]") / rate("fp32 mpidp [mpidp]"),
        "wire_u8_vs_bf16_wire_mpidp": rate("fp32 -> uint8 wire [mpidp]") / rate("fp32 -> bf16 wire [mpidp]"),
    }
    share = 2 * (SIZE - 1) / SIZE
    for key, r in results.items():
        wire = 264 / 256 if "uint8" in key else 4 if key.startswith("fp32") and "wire" not in key else 2
        r["bytes_per_elem"] = share * wire
    alg = mpidp._C.iallreduce_algorithm()
    if RANK != 0:
        return 0
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    if args.json:
        print(json.dumps({"ranks": SIZE, "n": n, "reps": args.reps, "iallreduce_algorithm": alg,
                          "loadavg": load, "simd_path": mpidp.simd_path(), "ratios": ratios,
                          "methods": results}))
        return 0
    print(f"bench_allreduce: {SIZE} ranks, {n} elements, median of {args.reps} (slowest rank); "
          f"libnbc iallreduce algorithm: {alg}; load average {load}")
    print("  [Allreduce]: mpi4py comm.Allreduce (blocking, coll/tuned); [Iallreduce]: mpi4py "
          "comm.Iallreduce + Wait (coll/libnbc);\n  [mpidp]: mpidp.allreduce (MPI_Iallreduce, libnbc)")
    base = {"Allreduce": rate("fp32 MPI_SUM [Allreduce]"), "Iallreduce": rate("fp32 MPI_SUM [Iallreduce]"),
            "mpidp": rate("fp32 mpidp [mpidp]")}
    print(f"{'method':<38} {'median ms':>10} {'best ms':>9} {'Melem/s':>9} {'x fp32 (same call)':>19}"
          f" {'B/elem':>7}")
    for key, r in results.items():
        family = key.rsplit("[", 1)[1].rstrip("]")
        e = r["elems_per_s"]
        print(f"{key:<38} {r['median_s'] * 1e3:10.1f} {r['best_s'] * 1e3:9.1f} {e / 1e6:9.1f} "
              f"{e / base[family]:19.2f} {r['bytes_per_elem']:7.2f}")
    print()
    for k, v in ratios.items():
        print(f"  {k:<42} {v:6.2f}")
    print("goals: bf16 native >= 1.3x fp32 and >= 10x the Python op")
    return 0


if __name__ == "__main__":
    sys.exit(main())
