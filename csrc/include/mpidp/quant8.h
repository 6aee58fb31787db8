/* 8-bit min-max block quantization of fp32 data, for the quantized allreduce.
 *
 * A buffer of n fp32 values is cut into blocks of MPIDP_Q8_BLOCK elements;
 * each block travels as one record of MPIDP_Q8_RECORD bytes: a header of two
 * fp32 numbers {lo, hi} (the block's minimum and maximum) followed by one
 * code byte per element. With step = (hi - lo) / 255 an element t becomes
 *
 *     q = clamp(rint((t - lo) / step), 0, 255)      decoded as  lo + q * step
 *
 * so the error is at most half a step, (hi - lo) / 510, plus fp32 rounding.
 * Two defects of Bagua's MinMaxUInt8 are absent by construction: codes are
 * clamped to [0, 255] before the conversion to an integer (±1e30 cannot give
 * level -1), and they count steps from the block's own minimum, not from 0 (a
 * block [5e4, 5e4 + 255 ulp] keeps one code per ulp instead of decoding to a
 * constant).
 *
 * The arithmetic, exactly (every path follows it; the scalar reference in
 * quant8_ref.c defines each result, and the SIMD paths are bit-identical):
 *   - t = src[i] * s when s != 1.0f, else src[i].
 *   - lo, hi: the block's minimum and maximum of t, each then + 0.0f (so a
 *     -0 bound is +0 whatever order a vector reduction met the zeros in).
 *   - A block holding a NaN or an infinity gets lo = hi = NaN (canonical,
 *     0x7FC00000), all codes 0, and decodes to NaN: a GradScaler that
 *     checks the reduced gradients still sees the overflow and skips the step.
 *   - From the header only, once per block (the same function on every path):
 *     range = (double)hi - (double)lo (exact, and no fp32 overflow for
 *     +-FLT_MAX); a power of two p that keeps every intermediate a normal
 *     fp32 number: 2^100 for 0 < range < 2^-60 (a block of tiny numbers,
 *     where 255 / range would overflow and step would be subnormal), 2^-4
 *     for range > 2^124 (where t - lo could overflow), else 1; then
 *     lop = lo * p, step = (float)(range * p / 255), inv = (float)(255 /
 *     (range * p)), and step = inv = 0 for range 0.
 *   - Encode: a = t * p, d = a - lop, u = d * inv, r = rint(u) (the current
 *     rounding mode: ties to even by default), clamped to [0, 255].
 *   - Decode: x = q * step, x = x + lop, x = x * (1 / p), clamped to
 *     [lo, hi]; accumulate: dst = dst + x; a NaN result is written as the
 *     canonical NaN.
 *   - fp32 operations are single IEEE operations, never fused (as in
 *     mpidp/pack.h).
 *
 * The last record of a buffer whose n is not a multiple of the block holds
 * zero codes past the end, so an encoded buffer's bytes depend only on the
 * input. A record's layout is the host's byte order: every rank of a job is
 * assumed to share it (as for the 16-bit wire formats). */
#ifndef MPIDP_QUANT8_H
#define MPIDP_QUANT8_H

#include <stddef.h>
#include <stdint.h>

/* The block parameters are computed by the same code on the host and in the
 * CUDA kernels (csrc/cuda/quant8.cu). */
#if defined(__CUDACC__)
#define MPIDP_Q8_INLINE __host__ __device__ static inline
#else
#define MPIDP_Q8_INLINE static inline
#endif

#define MPIDP_Q8_BLOCK 256
#define MPIDP_Q8_HEADER 8
#define MPIDP_Q8_RECORD (MPIDP_Q8_HEADER + MPIDP_Q8_BLOCK)

/* Bytes that n encoded elements take: ceil(n / MPIDP_Q8_BLOCK) records. */
static inline size_t mpidp_q8_bytes(size_t n)
{
    return (n + MPIDP_Q8_BLOCK - 1) / MPIDP_Q8_BLOCK * MPIDP_Q8_RECORD;
}

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mpidp_q8_kernels {
    const char *name; /* the pack path it belongs to: "ref", "avx2", "avx512" */
    /* dst (mpidp_q8_bytes(n) bytes) = the records of t = src[i] (* s). */
    void (*encode)(uint8_t *dst, const float *src, float s, size_t n);
    /* dst[i] = the decoded value of element i of `src` (n elements); with
     * accumulate, dst[i] = dst[i] + that value. */
    void (*decode)(float *dst, const uint8_t *src, int accumulate, size_t n);
} mpidp_q8_kernels_t;

/* The kernels of the pack path in use (mpidp_pack_path(); "avx512_bf16" uses
 * the "avx512" ones), self-checked bit for bit against the reference the
 * first time; a path that disagrees is never used (the reference is, and
 * mpidp_q8_fallback_reason says why). Never NULL; thread-safe. */
const mpidp_q8_kernels_t *mpidp_q8_kernels(void);
const char *mpidp_q8_fallback_reason(void);
/* The named path's kernels ("ref", "avx2", "avx512") without the self-check,
 * for tests and benchmarks. MPIDP_EINVAL for an unknown name, MPIDP_ENOTSUP
 * when this CPU lacks the path (*out is then NULL). */
int mpidp_q8_kernels_for(const char *name, const mpidp_q8_kernels_t **out);

#ifdef __cplusplus
}
#endif

#endif /* MPIDP_QUANT8_H */
