"""Throughput of mpidp's bf16/fp16 conversion kernels, one thread, against memcpy and torch.

    .venv/bin/python benchmarks/bench_pack.py [--json] [--mib 64] [--reps 15]
    python benchmarks/bench_pack.py --device cuda [--json]     # the CUDA kernels

For every SIMD path this CPU runs (mpidp._C.simd_paths()) and every direction
(fp32->bf16, fp32->fp16, bf16->fp32, fp16->fp32, and the bf16/fp16 sums of the
native MPI op), the kernel runs over --mib MiB of fp32 (64 MiB: 16 Mi elements,
twice the last-level cache of the machines this was written on, so the data
streams from memory and caches do not help). Reported: GB/s of bytes read plus
bytes written (10^9 bytes per second), the median of --reps timed calls after
two warm-up calls; the cases take turns (round-robin), so load from elsewhere
on the machine affects them alike. Cases:
  - the kernels (pack: 4 B read + 2 B written per element; unpack with a = 0,
    which does not read dst: 2 + 4; sum16: 2 + 2 read, 2 written);
  - memcpy of the same 64 MiB buffer (ctypes.memmove, i.e. libc memcpy, and
    numpy.copyto), counted as 64 MiB read + 64 MiB written;
  - torch with torch.set_num_threads(1): `src.to(torch.bfloat16)` (allocates
    its result on every call, as user code usually does), `dst.copy_(src)`
    into a preallocated tensor (the fair comparison), and `inout.add_(src)` for
    the sums (torch adds 16-bit tensors in fp32 and rounds once, as mpidp does).
Ratios are against memcpy (libc) and against torch's copy_/add_ of the same
direction (and .to() for fp32->bf16). The goal for fp32->bf16 on the best path:
>= 0.8x memcpy and >= 1.5x torch. --json prints one line with, among others,
fp32_to_bf16_GBps, memcpy_GBps and torch_to_bf16_GBps.

--device cuda times the CUDA kernels instead (mpidp built with nvcc, on the
current GPU, torch's current stream): the same directions against a
device-to-device copy of the same bytes (`dst.copy_(src)` on uint8 tensors,
read + written) and torch's `.to(bfloat16)`, `copy_` and `add_` on the GPU.
Each timed sample is a CUDA-event-timed batch of --batch calls (one call of
64 MiB takes tens of microseconds there); --mib defaults to 256 so that the
buffers are far larger than the GPU's L2 cache. The goal there: every kernel
>= 0.8x the device-to-device copy.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

import mpidp
from mpidp import _C, kernels


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def run_interleaved(cases, reps: int) -> list:
    """Times every case `reps` times, round-robin (case 1, case 2, ..., then again),
    so that other load on the machine hits every case alike; two untimed warm-up
    calls each first. cases: (fn, before) pairs, before() runs untimed ahead of
    each call (or is None). Returns the median seconds of each case."""
    for fn, before in cases:
        for _ in range(2):
            if before is not None:
                before()
            fn()
    times = [[] for _ in cases]
    for _ in range(reps):
        for k, (fn, before) in enumerate(cases):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def run_interleaved_cuda(cases, reps: int, batch: int) -> list:
    """run_interleaved for GPU work: each sample is `batch` calls between two
    CUDA events on the current stream (before() runs untimed before each
    batch); returns the median seconds per call of each case."""
    for fn, before in cases:
        if before is not None:
            before()
        fn()
    torch.cuda.synchronize()
    times = [[] for _ in cases]
    for _ in range(reps):
        for k, (fn, before) in enumerate(cases):
            if before is not None:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(batch):
                fn()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) / 1e3 / batch)
    return [statistics.median(t) for t in times]


def main_cuda(args) -> int:
    if not torch.cuda.is_available():
        print("bench_pack --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    if not _C.cuda_available():
        print("bench_pack --device cuda: mpidp's CUDA kernels cannot run here (built without "
              "nvcc, or the driver is older than the CUDA runtime mpidp was built with)",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    n = args.mib * (1 << 20) // 4
    g = torch.Generator().manual_seed(0)
    src32 = (torch.randn(n, generator=g) * 3).to(dev)
    out32 = torch.empty(n, device=dev)
    halves = {"bf16": torch.bfloat16, "fp16": torch.float16}
    h = {d: src32.to(dt) for d, dt in halves.items()}
    other = {d: torch.randn(n, generator=g).to(dev, dt) for d, dt in halves.items()}
    dst16 = {d: torch.empty(n, dtype=dt, device=dev) for d, dt in halves.items()}
    copy_src = src32.view(torch.uint8)
    copy_dst = torch.empty_like(copy_src)
    cases = [("copy", "device-to-device copy_", lambda: copy_dst.copy_(copy_src), 8 * n, None)]
    for d, dt in halves.items():
        # The sums accumulate into `inout` batch after batch; their bandwidth
        # does not depend on the values (no refill needed, unlike the CPU's
        # denormal-sensitive paths, and inf/NaN cost the same on the GPU).
        inout = torch.randn(n, generator=g).to(dev, dt)
        cases += [
            (f"fp32->{d}", f"torch .to({d})", lambda dt=dt: src32.to(dt), 6 * n, None),
            (f"fp32->{d}", "torch copy_", lambda d=d: dst16[d].copy_(src32), 6 * n, None),
            (f"fp32->{d}", "mpidp cuda", lambda d=d: kernels.pack(dst16[d], src32), 6 * n, None),
            (f"{d}->fp32", "torch copy_", lambda d=d: out32.copy_(h[d]), 6 * n, None),
            (f"{d}->fp32", "mpidp cuda", lambda d=d: kernels.unpack(out32, h[d]), 6 * n, None),
            (f"sum {d}", "torch add_", lambda io=inout, d=d: io.add_(other[d]), 6 * n, None),
            (f"sum {d}", "mpidp cuda", lambda io=inout, d=d: kernels.sum16(io, other[d]), 6 * n, None),
        ]
    medians = run_interleaved_cuda([(fn, before) for *_, fn, _, before in cases], args.reps,
                                   args.batch)
    rows = [(op, impl, nbytes / t / 1e9) for (op, impl, _, nbytes, _), t in zip(cases, medians)]
    gbps = {(op, impl): v for op, impl, v in rows}
    copy = gbps[("copy", "device-to-device copy_")]

    def torch_ref(op):
        return gbps[(op, "torch add_" if op.startswith("sum") else "torch copy_")]

    mpidp_rows = [(op, v) for op, impl, v in rows if impl == "mpidp cuda"]
    if args.json:
        out = {"device": torch.cuda.get_device_name(dev), "mib": args.mib, "reps": args.reps,
               "batch": args.batch, "d2d_copy_GBps": copy,
               "torch_to_bf16_GBps": gbps[("fp32->bf16", "torch .to(bf16)")],
               "kernels_GBps": {op: v for op, v in mpidp_rows},
               "kernels_x_d2d_copy": {op: v / copy for op, v in mpidp_rows},
               "kernels_x_torch": {op: v / torch_ref(op) for op, v in mpidp_rows},
               "all": {f"{op} | {impl}": v for op, impl, v in rows}}
        print(json.dumps(out))
        return 0
    print(f"bench_pack on {torch.cuda.get_device_name(dev)}: {args.mib} MiB of fp32 ({n} "
          f"elements) per call, median of {args.reps} batches of {args.batch} calls; "
          f"GB/s = (bytes read + written) / s")
    print(f"{'operation':<11} {'implementation':<24} {'GB/s':>8} {'x d2d copy':>11} {'x torch':>8}")
    for op, impl, v in rows:
        vs_torch = "" if op == "copy" else f"{v / torch_ref(op):8.2f}"
        print(f"{op:<11} {impl:<24} {v:8.1f} {v / copy:11.2f} {vs_torch:>8}")
    worst = min(mpidp_rows, key=lambda kv: kv[1])
    print(f"\nslowest kernel: {worst[0]} at {worst[1] / copy:.2f}x the device-to-device copy "
          f"(goal >= 0.8); fp32->bf16 {gbps[('fp32->bf16', 'mpidp cuda')] / copy:.2f}x copy, "
          f"{gbps[('fp32->bf16', 'mpidp cuda')] / gbps[('fp32->bf16', 'torch .to(bf16)')]:.2f}x "
          "torch .to(bfloat16)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="time the CPU SIMD paths (default) or the CUDA kernels")
    ap.add_argument("--mib", type=int, default=None,
                    help="MiB of fp32 per call (default 64 on the CPU, 256 on the GPU)")
    ap.add_argument("--reps", type=int, default=15, help="timed samples per measurement (median)")
    ap.add_argument("--batch", type=int, default=20, help="calls per timed sample on the GPU")
    args = ap.parse_args()
    if args.mib is None:
        args.mib = 256 if args.device == "cuda" else 64
    if args.mib <= 0 or args.reps <= 0 or args.batch <= 0:
        ap.error("--mib, --reps and --batch must be positive")
    if args.device == "cuda":
        return main_cuda(args)

    torch.set_num_threads(1)
    n = args.mib * (1 << 20) // 4
    g = torch.Generator().manual_seed(0)
    src32 = torch.randn(n, generator=g) * 3
    out32 = torch.empty(n)
    h = {torch.bfloat16: src32.to(torch.bfloat16), torch.float16: src32.to(torch.float16)}
    other = {dt: (torch.randn(n, generator=g)).to(dt) for dt in h}
    pristine = {dt: (torch.randn(n, generator=g)).to(dt) for dt in h}
    inout = {dt: pristine[dt].clone() for dt in h}
    dst16 = {dt: torch.empty(n, dtype=dt) for dt in h}
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}

    cases = []  # (operation, implementation, fn, bytes read + written, before)

    def measure(op, impl, fn, nbytes, before=None):
        cases.append((op, impl, fn, nbytes, before))

    # memcpy over the same 64 MiB (read 64 MiB, write 64 MiB).
    a = np.frombuffer(src32.numpy().tobytes(), dtype=np.uint8).copy()
    b = np.empty_like(a)
    nb = a.nbytes
    measure("memcpy", "libc memcpy (ctypes.memmove)",
            lambda: ctypes.memmove(b.ctypes.data, a.ctypes.data, nb), 2 * nb)
    measure("memcpy", "numpy.copyto", lambda: np.copyto(b, a), 2 * nb)

    for dt in h:
        d = name[dt]
        # torch, one thread.
        measure(f"fp32->{d}", f"torch .to({d})", lambda dt=dt: src32.to(dt), 6 * n)
        measure(f"fp32->{d}", "torch copy_", lambda dt=dt: dst16[dt].copy_(src32), 6 * n)
        measure(f"{d}->fp32", "torch copy_", lambda dt=dt: out32.copy_(h[dt]), 6 * n)
        measure(f"sum {d}", "torch add_", lambda dt=dt: inout[dt].add_(other[dt]), 6 * n,
                before=lambda dt=dt: inout[dt].copy_(pristine[dt]))
        for path in _C.simd_paths():
            measure(f"fp32->{d}", f"mpidp {path}",
                    lambda dt=dt, p=path: kernels.pack(dst16[dt], src32, path=p), 6 * n)
            measure(f"{d}->fp32", f"mpidp {path}",
                    lambda dt=dt, p=path: kernels.unpack(out32, h[dt], path=p), 6 * n)
            measure(f"sum {d}", f"mpidp {path}",
                    lambda dt=dt, p=path: kernels.sum16(inout[dt], other[dt], path=p), 6 * n,
                    before=lambda dt=dt: inout[dt].copy_(pristine[dt]))

    medians = run_interleaved([(fn, before) for _, _, fn, _, before in cases], args.reps)
    rows = [(op, impl, nbytes / t / 1e9) for (op, impl, _, nbytes, _), t in zip(cases, medians)]
    gbps = {(op, impl): v for op, impl, v in rows}
    memcpy = gbps[("memcpy", "libc memcpy (ctypes.memmove)")]
    best = mpidp.simd_path()

    def torch_ref(op):
        impl = "torch add_" if op.startswith("sum") else "torch copy_"
        return gbps[(op, impl)]

    if args.json:
        out = {
            "mib": args.mib, "reps": args.reps, "simd_path": best, "loadavg": load_average(),
            "memcpy_GBps": memcpy,
            "numpy_copyto_GBps": gbps[("memcpy", "numpy.copyto")],
            "fp32_to_bf16_GBps": gbps[("fp32->bf16", f"mpidp {best}")],
            "fp32_to_fp16_GBps": gbps[("fp32->fp16", f"mpidp {best}")],
            "bf16_to_fp32_GBps": gbps[("bf16->fp32", f"mpidp {best}")],
            "fp16_to_fp32_GBps": gbps[("fp16->fp32", f"mpidp {best}")],
            "sum_bf16_GBps": gbps[("sum bf16", f"mpidp {best}")],
            "sum_fp16_GBps": gbps[("sum fp16", f"mpidp {best}")],
            "torch_to_bf16_GBps": gbps[("fp32->bf16", "torch .to(bf16)")],
            "torch_copy_to_bf16_GBps": gbps[("fp32->bf16", "torch copy_")],
            "all": {f"{op} | {impl}": v for op, impl, v in rows},
        }
        print(json.dumps(out))
        return 0

    print(f"bench_pack: {args.mib} MiB of fp32 ({n} elements) per call, one thread, median of "
          f"{args.reps}; GB/s = (bytes read + written) / s; load average {load_average()}")
    print(f"SIMD paths: {', '.join(_C.simd_paths())} (in use: {best}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread")
    print(f"{'operation':<11} {'implementation':<30} {'GB/s':>7} {'x memcpy':>9} {'x torch':>8}")
    for op, impl, v in rows:
        vs_torch = "" if op == "memcpy" else f"{v / torch_ref(op):8.2f}"
        print(f"{op:<11} {impl:<30} {v:7.2f} {v / memcpy:9.2f} {vs_torch:>8}")
    to = gbps[("fp32->bf16", f"mpidp {best}")]
    print(f"\nfp32->bf16 ({best}): {to / memcpy:.2f}x memcpy (goal >= 0.8), "
          f"{to / gbps[('fp32->bf16', 'torch .to(bf16)')]:.2f}x torch .to() and "
          f"{to / gbps[('fp32->bf16', 'torch copy_')]:.2f}x torch copy_ (goal >= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
