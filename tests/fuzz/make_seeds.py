#!/usr/bin/env python3
"""Writes the committed seed corpora, corpus/tensor, corpus/schedule, corpus/avgsched
and corpus/efpayload.

Each seed is a hand-written input in the harnesses' encoding (fuzz_common.h,
fuzz_tensor.c, fuzz_schedule.c): small, readable here, and aimed at one corner
of the contract, so the fuzzer starts from meaningful tensors and schedules
instead of from zeros. seed-regress_* are the inputs that found the bugs
listed in README.md. The script rewrites every seed-* file; other files in
corpus/ (say, a crash input copied from build/artifacts/ as regress-<name>)
are left alone."""

from __future__ import annotations

import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

# Indices into FZ_SPECIAL (fz_int selector 0xC0 + i).
SPECIAL = {"0": 0, "1": 1, "-1": 2, "2": 3, "-2": 4, "INT64_MAX": 5, "INT64_MIN": 6,
           "INT64_MAX-1": 7, "INT32_MAX": 9, "INT32_MIN": 10, "2^31": 12, "2^32": 13,
           "2^62": 14, "INT64_MAX/2+1": 17, "sqrt": 20, "65536": 24}
# Indices into fz_double's specials (selector 0xA0 + i).
DSPECIAL = {"nan": 0, "-nan": 1, "inf": 2, "-inf": 3, "0": 4, "-0": 5, "max": 6, "-max": 7,
            "min": 8, "tiny": 10, "1e300": 11, "-1e300": 12, "1": 14, "-1": 15}


def sp(name: str) -> bytes:
    return bytes([0xC0 + SPECIAL[name]])


def raw64(v: int) -> bytes:
    return b"\xE0" + struct.pack("<Q", v & (2**64 - 1))


def small(v: int, lo: int, hi: int) -> bytes:
    """fz_int(lo, hi) giving v (lo <= v <= hi)."""
    assert lo <= v <= hi
    return bytes([v - lo])


def dsmall(x: float) -> bytes:
    """fz_double() giving x, a multiple of 1/8 in [-3.875, 15.875]."""
    if x >= 0:
        k = round(x * 8)
        assert k < 0x80 and k / 8 == x
        return bytes([k])
    k = round(-x * 8)
    assert k < 0x20 and -k / 8 == x
    return bytes([0x80 + k])


def dsp(name: str) -> bytes:
    return bytes([0xA0 + DSPECIAL[name]])


# ---- tensor -------------------------------------------------------------------

F32, F64, F16, BF16 = (2, 32), (2, 64), (2, 16), (4, 16)
BITS = {16: 0, 32: 1, 64: 2, 8: 3, 1: 4, 128: 5}
CPU, CUDA, CUDA_HOST, ROCM, MANAGED = 1, 2, 3, 10, 13


def tensor(*, dl_null=0, out_null=0, strides=None, shape_null=0, data_null=0, ndim=None,
           shape=(), dtype=F32, lanes=1, device=CPU, device_id=0, data=0, offset=0,
           read_only=0, req=0, extra_dtype=0) -> bytes:
    """strides: None (NULL), or per dimension "c" (compact) or an int."""
    flags = dl_null | out_null << 1 | (strides is not None) << 2 | shape_null << 3 | data_null << 4
    b = bytes([flags])
    n = len(shape) if ndim is None else ndim
    b += small(n, 0, 6) if isinstance(n, int) and 0 <= n <= 6 else (sp(n) if isinstance(n, str) else raw64(n))
    b += small(dtype[0], 0, 6) if dtype[0] <= 6 else raw64(dtype[0])
    b += bytes([BITS[dtype[1]]]) if dtype[1] in BITS else b"\xff" + bytes([dtype[1]])
    b += b"\x00" if lanes == 1 else b"\xff" + struct.pack("<H", lanes)
    b += small(device, 0, 15) if 0 <= device <= 15 else raw64(device)
    b += small(device_id, -1, 3)
    b += bytes([data]) if isinstance(data, int) and data < 0xC0 else b"\xff" + struct.pack("<Q", data[0])
    b += small(offset, 0, 63) if isinstance(offset, int) and offset < 64 else raw64(offset[0])
    b += small(read_only, 0, 1)
    b += small(req, 0, 3)
    for x in shape:
        b += small(x, 0, 5) if isinstance(x, int) and 0 <= x <= 5 else (sp(x) if isinstance(x, str) else raw64(x))
    if strides is not None:
        for s in reversed(strides):  # the harness reads them from the last dimension
            b += b"\x00" if s == "c" else b"\xff" + (small(s, -2, 8) if -2 <= s <= 8 else raw64(s))
    b += small(extra_dtype, -2, 5)
    return b


TENSOR_SEEDS = {
    "f32_2x3": tensor(shape=(2, 3)),
    "f32_scalar": tensor(shape=()),
    "bf16_compact_strides": tensor(shape=(3, 1, 4), dtype=BF16, strides=("c", 7, "c")),
    "f16_cuda_cpu_only": tensor(shape=(5,), dtype=F16, device=CUDA, req=2),
    "f64_managed": tensor(shape=(2, 2), dtype=F64, device=MANAGED, device_id=3),
    "pinned_host": tensor(shape=(4,), device=CUDA_HOST, strides=("c",)),
    "read_only_writable": tensor(shape=(4,), read_only=1, req=1),
    "read_only_ok": tensor(shape=(4,), read_only=1, req=2),
    "transposed": tensor(shape=(2, 3), strides=(1, 2)),
    "negative_stride": tensor(shape=(3,), strides=(-1,)),
    "negative_extent": tensor(shape=(2, "-1")),
    "overflow_product": tensor(shape=("2^62", 5, 2)),
    "overflow_then_zero": tensor(shape=("2^62", "2^62", 0)),
    "zero_then_huge": tensor(shape=(0, "INT64_MAX", "INT64_MAX")),
    "empty_null_data": tensor(shape=(0, 3), data_null=1, strides=(9, "c")),
    "null_data": tensor(shape=(1,), data_null=1),
    "misaligned": tensor(shape=(2,), dtype=F64, data=4),
    "offset_aligns": tensor(shape=(2,), dtype=F64, data=4, offset=4),
    "offset_wraps": tensor(shape=(2,), data=(2**64 - 8,), offset=16),
    "ndim_negative": tensor(ndim="-1"),
    "ndim_huge": tensor(ndim="INT32_MAX", shape=(1, 1, 1)),
    "shape_null": tensor(ndim=2, shape_null=1),
    "int32": tensor(shape=(2,), dtype=(0, 32)),
    "lanes2": tensor(shape=(2,), lanes=2),
    "rocm": tensor(shape=(2,), device=ROCM),
    "bool": tensor(shape=(2,), dtype=(6, 8)),
    "dl_null": tensor(dl_null=1),
    "out_null": tensor(out_null=1, shape=(1,)),
    "six_dims": tensor(shape=(1, 2, 1, 3, 1, 2), strides=("c", 5, "c", "c", -2, "c"), dtype=BF16),
}

# ---- schedule -----------------------------------------------------------------

OP_STEP, OP_EPOCH, OP_EPOCH_END, OP_RAW, OP_RESET, OP_CORRUPT, OP_JUMP, OP_CKPT, OP_INIT, OP_NULLS = (
    0, 4, 6, 7, 8, 9, 10, 11, 12, 13)
OP_AUTO, OP_RECONF = 14, 15
FIELDS = ["cfg.total_epochs", "cfg.warmup_epochs", "cfg.cooldown_epochs", "cfg.max_global_skips",
          "cfg.skip_reduction_factor", "cfg.local_skip_factor", "cfg.n_groups",
          "cfg.stability_level", "phase", "global_skip", "local_skip", "batches_to_wait", "epoch",
          "logic_epoch", "has_best", "bad_epochs", "best_loss", "next_batch", "last_batch",
          "send_mod", "local_sync", "pending", "pending_group", "pending_btw", "pending_sent_at"]


def config(total=12, warmup=4, cooldown=4, max_gs=8, srf=2, lsf=4, groups=1, level=0.05) -> bytes:
    def f(v, lo, hi):
        return small(v, lo, hi) if isinstance(v, int) and lo <= v <= hi else (sp(v) if isinstance(v, str) else raw64(v))
    levels = [0.0, 0.01, 0.05, 0.2, 0.5, 0.99]
    lv = bytes([levels.index(level)]) if level in levels else b"\xff" + level
    return (f(total, 1, 40) + f(warmup, 0, 5) + f(cooldown, 0, 5) + f(max_gs, 1, 16) + f(srf, 2, 5)
            + f(lsf, 1, 6) + f(groups, 1, 4) + lv)


def epoch(last: int, loss: bytes) -> bytes:
    return bytes([OP_EPOCH]) + small(last, 0, 12) + loss


def corrupt(field: str, value: bytes) -> bytes:
    return bytes([OP_CORRUPT, FIELDS.index(field), 0]) + value


def jump(n, last, epoch=None) -> bytes:
    def f(v):
        return small(v, 0, 12) if isinstance(v, int) else sp(v)
    return bytes([OP_JUMP]) + f(n) + f(last) + (b"\x00" if epoch is None else b"\x01" + f(epoch))


def reconfigure(**kw) -> bytes:
    return bytes([OP_RECONF]) + config(**kw) + b"\x00"  # same n_groups


SCHEDULE_SEEDS = {
    # Inputs that found bugs (see README.md), kept as regression seeds.
    "regress_send_mod_overflow": config(total=12, warmup=1, cooldown=1, groups="INT64_MAX")
    + epoch(3, dsmall(1)) + bytes([OP_STEP, 12, OP_STEP, OP_STEP]),
    "regress_epoch_counter_overflow": config(total=12) + jump(0, 0, "INT64_MAX-1") + bytes([OP_STEP, 0]),
    "regress_batch_index_overflow": config(total=12) + jump("INT64_MAX", "INT64_MAX") + bytes([OP_STEP]),
    "regress_reconfigure_skipped_epoch_end": config(total=30, warmup=0, cooldown=0, max_gs=2, lsf=1)
    + bytes([OP_STEP, 0]) + reconfigure(total=5, warmup=1, cooldown=2, max_gs=5, srf=3, lsf=2),
    "regress_reconfigure_back_to_warmup": config(total=6, warmup=2, cooldown=2)
    + epoch(0, dsmall(1)) + epoch(0, dsmall(1)) + reconfigure(total=33, warmup=3, cooldown=0, max_gs=1),
    "heat_defaults_plateaus": config(total=20) + bytes([OP_AUTO, 255, 0x00]) * 3,
    "improving_losses": config(total=20, warmup=1, cooldown=1) + bytes([OP_AUTO, 255, 0xFF]) * 3,
    "no_warmup_cycling": config(total=30, warmup=0, cooldown=0, max_gs=16, lsf=1, groups=3)
    + b"".join(epoch(l, dsmall(x)) for l, x in [(12, 4), (7, 4), (9, 4), (12, 4), (3, 2), (12, 2),
                                                 (12, 2), (12, 2), (1, 1), (0, 1), (12, 1)]),
    "bad_losses": config(total=16, warmup=1, cooldown=1, max_gs=4, srf=3, lsf=2, groups=2)
    + b"".join(epoch(11, dsp(n)) for n in ["1", "nan", "inf", "-inf", "-1", "1e300", "-0", "tiny", "max",
                                         "-nan", "nan", "nan"]),
    "steps_and_misuse": config(total=8, warmup=1, cooldown=1)
    + epoch(5, dsmall(3)) + bytes([OP_STEP, 9, OP_STEP, OP_RAW, 0x00, OP_RAW, 0x06, OP_RAW, 0x01, 0x05,
                                   OP_EPOCH_END, 0x08, OP_STEP, OP_STEP, OP_STEP, OP_RAW, 0x02, 0x0D,
                                   OP_STEP, OP_STEP, OP_STEP, OP_STEP, OP_EPOCH_END, 0x10, OP_EPOCH_END,
                                   0x10]),
    "checkpoint_mid_epoch": config(total=10, warmup=1, cooldown=0, groups=3)
    + epoch(12, dsmall(4)) + bytes([OP_STEP, 12] + [OP_STEP] * 8 + [OP_CKPT] + [OP_STEP] * 4 + [OP_CKPT]),
    "corrupt_fields": config(total=10, warmup=1, cooldown=0, groups=2)
    + epoch(12, dsmall(4)) + bytes([OP_STEP, 12, OP_STEP])
    + corrupt("pending", small(0, -2, 16)) + corrupt("pending", small(1, -2, 16))
    + corrupt("global_skip", small(2, -2, 16)) + corrupt("send_mod", small(5, -2, 16))
    + corrupt("best_loss", dsp("nan")) + corrupt("phase", small(2, -2, 16)) + bytes([OP_STEP, OP_STEP]),
    "reset_init_nulls": config(total=6, warmup=2, cooldown=2)
    + epoch(3, dsmall(1)) + bytes([OP_RESET, OP_NULLS, 0x02, OP_INIT]) + config(total=5, warmup=0)
    + b"\x01" + epoch(4, dsmall(2)) + bytes([OP_INIT]) + config(total="0") + b"\x00"
    + bytes([OP_INIT]) + config(level=dsp("nan")) + b"\x00",
    "invalid_config": config(total="-1") + bytes([OP_AUTO, 40, 0x55]),
    "huge_config": config(total="INT64_MAX", warmup="INT64_MAX-1", cooldown="INT64_MAX", max_gs="INT64_MAX",
                          srf="INT64_MAX", lsf="INT64_MAX", groups="INT64_MAX")
    + bytes([OP_AUTO, 60, 0x0F]),
    "overlapping_phases": config(total=3, warmup=5, cooldown=5) + bytes([OP_AUTO, 100, 0xAA]),
    "jumps_and_reconfigure": config(total=20, warmup=1, cooldown=1, groups=3) + epoch(12, dsmall(2))
    + jump(7, 12) + bytes([OP_STEP] * 3) + jump(0, 0, 9) + epoch(12, dsmall(1)) + reconfigure(total=40, groups=3)
    + bytes([OP_AUTO, 80, 0x33]),
    "max_gs_1": config(total=25, warmup=0, cooldown=0, max_gs=1, lsf=6) + bytes([OP_AUTO, 255, 0x00]),
}

# ---- averaging schedule ------------------------------------------------------
# fuzz_avgsched.c: warmup, n_levels, periods, three flags (u8: bit 0 the value,
# bit 1 set: the raw byte, invalid), slow_every, n_fragments, fragment_every,
# fragment_delay, then the steps asked about.


def avg_config(warmup=0, periods=(), from_warmup=0, after=0, replace=0, slow=0, fragments=0,
               every=1, delay=0) -> bytes:
    def f(v, lo, hi):
        return sp(v) if isinstance(v, str) else small(v, lo, hi)
    out = f(warmup, 0, 20) + f(len(periods), 0, 3) + b"".join(f(p, 1, 12) for p in periods)
    out += bytes([from_warmup, after, replace])
    return out + f(slow, 0, 12) + f(fragments, 0, 4) + f(every, 1, 8) + f(delay, 0, 7)


def steps(*ts) -> bytes:
    return b"".join(sp(t) if isinstance(t, str) else small(t, 0, 64) for t in ts)


AVGSCHED_SEEDS = {
    "periodic_warmup": avg_config(warmup=10, periods=(4,), from_warmup=1) + steps(*range(0, 30)),
    "hierarchical": avg_config(warmup=10, periods=(2, 4, 8)) + steps(*range(8, 26)),
    "slowmo": avg_config(periods=(3,), after=1, slow=6, replace=1) + steps(*range(0, 14)),
    "streaming_diloco": avg_config(fragments=3, every=2, delay=1) + steps(*range(0, 12)),
    "huge_steps": avg_config(warmup="INT64_MAX-1", periods=(1, 5), after=1, slow="INT64_MAX",
                             fragments="INT64_MAX", every="INT64_MAX", delay="INT64_MAX-1")
    + steps("INT64_MAX", "INT64_MAX-1", "0", "2^62"),
    "invalid": avg_config(periods=(5, 2), from_warmup=2) + steps(0, 1, "-1"),
    "delay_too_long": avg_config(fragments=2, every=3, delay=3) + steps(0, 2),
}


# ---- error-feedback payloads ---------------------------------------------------
# fuzz_efpayload.c: rows-1, cols-1, chunk-1, k selector, bins selector, R-1,
# flags, then the ranks' payloads. These use 8 x 12 tensors in tiles of 4 x 6
# (4 tiles of 24 slots).


def ef_head(k=2, bins_sel=0, ranks=3, flags=0) -> bytes:
    return bytes([7, 11, 5, k - 1, bins_sel, ranks - 1, flags])


def plain_payload(slots_per_tile, value=1.5) -> bytes:
    slots = b"".join(struct.pack("<H", s) for tile in slots_per_tile for s in tile)
    n = sum(len(t) for t in slots_per_tile)
    return slots + b"".join(struct.pack("<f", value + i) for i in range(n))


def quant_payload(slots_per_tile, codes, bins=4, bits=2) -> bytes:
    head = struct.pack("<f", 0.25) + b"".join(struct.pack("<f", b - 1.5) for b in range(bins))
    slots = b"".join(struct.pack("<H", s) for tile in slots_per_tile for s in tile)
    packed = bytearray((len(codes) * bits + 7) // 8)
    for i, c in enumerate(codes):
        packed[i * bits // 8] |= c << (i * bits % 8)
    return head + slots + bytes(packed)


GOOD = [[0, 5], [1, 23], [2, 3], [10, 11]]
EFPAYLOAD_SEEDS = {
    "plain_three_ranks": ef_head() + plain_payload(GOOD) + plain_payload([[0, 6]] * 4)
    + plain_payload(GOOD, -2.0),
    "plain_all_tile_major": ef_head(flags=3) + plain_payload(GOOD) * 3,
    "quantized": ef_head(bins_sel=2, ranks=2) + quant_payload(GOOD, [0, 1, 2, 3] * 2) * 2,
    "slot_outside_tile": ef_head(ranks=1) + plain_payload([[0, 24]] + GOOD[1:]),
    "slot_repeated": ef_head(ranks=1) + plain_payload([[7, 7]] + GOOD[1:]),
    "code_outside_three_bins": ef_head(bins_sel=1, ranks=1) + quant_payload(GOOD, [3] * 8, bins=3),
    "demo": ef_head(k=3, flags=4, ranks=2) + plain_payload([[0, 1, 7]] * 4) * 2,
    # Found by the fuzzer (README.md): NaNs of two payloads summed in DeMo's decode.
    "regress_nan_payloads": bytes.fromhex(
        "070b050200010400000100070000000100070000000100070000000100070000"
        "00c03f00002040feffffffffffffff0000b0400000d0400000f0400000084100"
        "0018410000284100003841000048410000010007000000010007000000010007"
        "00000001000700d0400000f0400000ffffffffffffffff0041"),
}


def write(kind: str, seeds: dict) -> None:
    d = os.path.join(HERE, "corpus", kind)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        if f.startswith("seed-"):
            os.remove(os.path.join(d, f))
    for name, data in seeds.items():
        with open(os.path.join(d, f"seed-{name}"), "wb") as fh:
            fh.write(data)


if __name__ == "__main__":
    write("tensor", TENSOR_SEEDS)
    write("schedule", SCHEDULE_SEEDS)
    write("avgsched", AVGSCHED_SEEDS)
    write("efpayload", EFPAYLOAD_SEEDS)
    print(f"wrote {len(TENSOR_SEEDS)} tensor, {len(SCHEDULE_SEEDS)} schedule, "
          f"{len(AVGSCHED_SEEDS)} averaging schedule and {len(EFPAYLOAD_SEEDS)} payload seeds")
