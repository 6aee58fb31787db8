/* Conversion kernels between fp32 and the 16-bit wire formats, and their dispatch.
 *
 * mpidp sends gradients and parameters as bf16 or fp16 to halve the bytes on the
 * wire. These kernels cast a fp32 buffer to the wire format (optionally fused
 * with a subtraction and a scale), merge a received wire buffer back into fp32,
 * and sum two wire buffers for the MPI reduction op (mpidp/mpiops.h).
 *
 * Every kernel exists once per instruction set ("path"): a portable scalar
 * reference ("ref", pack_ref.c), AVX2 (pack_avx2.c) and AVX-512 (pack_avx512.c,
 * in two variants: "avx512" rounds to bf16 with integer operations, and
 * "avx512_bf16" uses the AVX512_BF16 conversion instruction). All paths give
 * BIT-IDENTICAL results for every input: the reference defines each result,
 * and the SIMD paths follow its exact fp32 operation order. Ranks may run
 * different paths, and the DASO merge must give every rank the same bits.
 *
 * Rules shared by every kernel (the reference is the definition):
 *   - Rounding to bf16 and fp16 is round-to-nearest, ties-to-even. fp32
 *     subnormal inputs are rounded by the same rule, never flushed to zero;
 *     results too large for fp16 become +-inf; +-inf and +-0 keep their sign.
 *   - Every NaN a kernel writes is the canonical quiet NaN: 0x7FC0 (bf16),
 *     0x7E00 (fp16), 0x7FC00000 (fp32), 0x7FF8000000000000 (fp64). A NaN never
 *     becomes an infinity (a plain bf16 rounding would turn 0x7F800001 into
 *     +inf). Canonical NaNs make the paths bit-identical even where two NaNs
 *     meet in one operation, whose payload x86 takes from the first operand
 *     and compilers may commute; they also match torch's scalar fp32->bf16 cast.
 *   - fp32 arithmetic is IEEE single precision, one rounding per operation,
 *     never fused (the build uses -std=c11, hence -ffp-contract=off; the SIMD
 *     code uses separate multiply and add instructions).
 *   - The conversions do not depend on MXCSR; arithmetic follows it (flush-to-
 *     zero and denormals-are-zero affect every path the same way, because each
 *     path decides which operations to run with the same tests on its scalar
 *     arguments).
 *   - Any n (0 included) and any alignment. The destination may be the very
 *     same array as one source (in-place), but arrays must not otherwise
 *     overlap.
 *
 * Every kernel is a plain function pointer in mpidp_pack_kernels_t; callers
 * fetch the table chosen at start-up with mpidp_pack_kernels(). */
#ifndef MPIDP_PACK_H
#define MPIDP_PACK_H

#include <stddef.h>
#include <stdint.h>

typedef struct mpidp_pack_kernels {
    /* The path's name: "ref", "avx2", "avx512" or "avx512_bf16". */
    const char *name;
    /* The instruction sets the path needs, for logs ("AVX2+FMA+F16C"). */
    const char *isa;

    /* dst[i] = bf16(t) where t = src[i]; t = t - ref[i] when ref != NULL;
     * t = t * s when s != 1.0f. */
    void (*pack_bf16)(uint16_t *dst, const float *src, const float *ref, float s,
                      size_t n);
    /* The same into IEEE binary16. */
    void (*pack_fp16)(uint16_t *dst, const float *src, const float *ref, float s,
                      size_t n);

    /* dst[i] = t, with w = widen(src[i]) (exact) and, in this order:
     *   t = b * w;
     *   t = (a * dst[i]) + t      only when a != 0.0f (else dst is not read,
     *                             and may hold garbage or NaN);
     *   t = t + (c * ref[i])      only when ref != NULL. */
    void (*unpack_bf16)(float *dst, const uint16_t *src, const float *ref, float a,
                        float b, float c, size_t n);
    void (*unpack_fp16)(float *dst, const uint16_t *src, const float *ref, float a,
                        float b, float c, size_t n);

    /* inout[i] = half(widen(in[i]) + widen(inout[i])): one fp32 addition, then
     * one rounding. This equals the correctly rounded sum of the two 16-bit
     * numbers: fp32 keeps at least 2p+2 bits of a p-bit format (24 >= 2*11+2)
     * and a wider exponent range, so the double rounding is innocuous. */
    void (*sum_bf16)(uint16_t *inout, const uint16_t *in, size_t n);
    void (*sum_fp16)(uint16_t *inout, const uint16_t *in, size_t n);

    /* x[i] = x[i] * s (always multiplied, also for s == 1). */
    void (*scale_f32)(float *x, float s, size_t n);
    void (*scale_f64)(double *x, double s, size_t n);
    /* unpack's formula and order with an fp32 source (w = src[i]). */
    void (*merge_f32)(float *dst, const float *src, const float *ref, float a,
                      float b, float c, size_t n);
} mpidp_pack_kernels_t;

/* Chooses the kernel path once for the process and runs its self-check.
 *
 * forced: NULL or "" picks the best path this CPU supports (CPUID and XGETBV:
 * AVX-512 needs AVX512F/BW/VL/DQ and the OS saving ZMM and opmask state; AVX2
 * needs AVX2, FMA, F16C and the OS saving YMM state). "ref", "avx2" or
 * "avx512" force a path (the value of MPIDP_SIMD, passed in by the glue);
 * "avx512" takes the AVX512_BF16 variant when the CPU has that extension.
 *
 * After choosing, every kernel of the path is compared bit for bit with the
 * reference on special and pseudo-random values, odd lengths and unaligned
 * pointers (tens of microseconds). A path that disagrees is never used: init
 * falls back to the next lower path and records why (mpidp_pack_fallback_reason),
 * and still returns MPIDP_OK.
 *
 * Fails with MPIDP_EINVAL for an unknown name and MPIDP_ENOTSUP when the CPU
 * lacks the forced path ("MPIDP_SIMD=avx512 but this CPU lacks AVX-512F"); on
 * failure the previous choice stays in force. Calling it again re-chooses
 * (tests do). Tables are static and never freed, so a pointer returned by an
 * earlier mpidp_pack_kernels() stays valid, also while another thread
 * re-chooses. */
int mpidp_pack_init(const char *forced);

/* The chosen table. Never NULL: when mpidp_pack_init was not called yet, it
 * chooses automatically (as mpidp_pack_init(NULL)) first. Thread-safe. */
const mpidp_pack_kernels_t *mpidp_pack_kernels(void);

/* The chosen path's name ("ref", "avx2", "avx512", "avx512_bf16"). */
const char *mpidp_pack_path(void);

/* Why the last mpidp_pack_init fell back from the path it chose to a lower one
 * (for a Python warning), or "" when it did not. The string lives in a static
 * buffer that the next mpidp_pack_init rewrites; copy it if you keep it. */
const char *mpidp_pack_fallback_reason(void);

/* The name of known path i (0 "ref", 1 "avx2", 2 "avx512", 3 "avx512_bf16"),
 * whether or not this CPU runs it, or NULL for i past the last: the list to
 * try with mpidp_pack_kernels_for. */
const char *mpidp_pack_path_name(size_t i);

/* The table of the named path ("ref", "avx2", "avx512", "avx512_bf16") without
 * making it the current one and without self-checking it, for tests and
 * benchmarks that compare paths. Fails with MPIDP_EINVAL for an unknown name and
 * MPIDP_ENOTSUP when this CPU (or this build) lacks the path; *out is then NULL. */
int mpidp_pack_kernels_for(const char *name, const mpidp_pack_kernels_t **out);

/* Scalar conversions, exactly the reference kernels' per-element rules. */
uint16_t mpidp_bf16_from_f32(float x);
uint16_t mpidp_fp16_from_f32(float x);
/* Exact widening; NaN payloads are kept (arithmetic kernels canonicalise later). */
float mpidp_f32_from_bf16(uint16_t h);
float mpidp_f32_from_fp16(uint16_t h);

#endif /* MPIDP_PACK_H */
