/* AVX2 kernels (with F16C for the binary16 conversions), compiled with
 * -mavx2 -mfma -mf16c by file name.
 *
 * Each kernel mirrors the reference in pack_ref.c operation for operation:
 * separate multiply and add instructions in the same order (never FMA; -std=c11
 * keeps GCC from contracting the intrinsics), the same integer rounding to bf16,
 * and NaN lanes replaced by the canonical NaN. vcvtps2ph with immediate rounding
 * 0 rounds to nearest even, keeps subnormal results and ignores MXCSR's FTZ and
 * DAZ bits, exactly like the reference's integer conversion; vcvtph2ps is exact.
 *
 * Loads and stores are unaligned. The vector loops stop before the last partial
 * vector, whose elements go through the reference kernel itself, so any n and
 * any alignment work and the tail can never disagree with the definition. The
 * scalar arguments are tested once per call (a != 0, ref != NULL, s != 1) with
 * the same tests as the reference, selecting a loop specialised by the
 * always-inlined helpers. */
#include "mpidp/pack.h"
#include "pack_internal.h"

#if defined(__AVX2__) && defined(__F16C__)

#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

/* 8 floats to 8 bf16 in the low halves of 32-bit lanes (see mpidp_bf16_from_f32). */
INLINE __m256i bf16_round8(__m256 x)
{
    const __m256i bias = _mm256_set1_epi32(0x7fff);
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i qnan = _mm256_set1_epi32(0x7fc0);
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i t = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), lsb), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(t, qnan, nan);
}

/* 16 floats (two vectors) to 16 bf16 in order. packus interleaves the 128-bit
 * halves of its operands; the 64-bit permute puts them back in order. No lane
 * saturates: every value is at most 0xFFFF after the shift. */
INLINE __m256i bf16_round16(__m256 lo, __m256 hi)
{
    __m256i p = _mm256_packus_epi32(bf16_round8(lo), bf16_round8(hi));
    return _mm256_permute4x64_epi64(p, 0xd8);
}

INLINE __m256 canon_nan(__m256 x)
{
    const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
    return _mm256_blendv_ps(x, qnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

INLINE __m128i fp16_round8(__m256 x)
{
    return _mm256_cvtps_ph(canon_nan(x), _MM_FROUND_TO_NEAREST_INT);
}

INLINE __m256 widen_bf16(__m128i h)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INLINE __m256 load_bf16(const uint16_t *p)
{
    return widen_bf16(_mm_loadu_si128((const __m128i *)p));
}

INLINE __m256 load_fp16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* pack's pre-step on 8 floats at src + i: minus ref, times s. */
INLINE __m256 pack_pre(const float *src, const float *ref, __m256 s, int has_ref,
                       int scale, size_t i)
{
    __m256 t = _mm256_loadu_ps(src + i);
    if (has_ref) t = _mm256_sub_ps(t, _mm256_loadu_ps(ref + i));
    if (scale) t = _mm256_mul_ps(t, s);
    return t;
}

/* The source formats of the merge kernels, and the destination formats of
 * the pack kernels (SRC_BF16, SRC_FP16). */
enum { SRC_F32, SRC_BF16, SRC_FP16 };

/* The bf16 pack loop; returns the number of elements done. */
INLINE size_t pack_bf16_loop(uint16_t *dst, const float *src, const float *ref, __m256 vs,
                             size_t n, int has_ref, int scale)
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i r0 = bf16_round16(pack_pre(src, ref, vs, has_ref, scale, i),
                                  pack_pre(src, ref, vs, has_ref, scale, i + 8));
        __m256i r1 = bf16_round16(pack_pre(src, ref, vs, has_ref, scale, i + 16),
                                  pack_pre(src, ref, vs, has_ref, scale, i + 24));
        _mm256_storeu_si256((__m256i *)(dst + i), r0);
        _mm256_storeu_si256((__m256i *)(dst + i + 16), r1);
    }
    for (; i + 16 <= n; i += 16) {
        __m256i r = bf16_round16(pack_pre(src, ref, vs, has_ref, scale, i),
                                 pack_pre(src, ref, vs, has_ref, scale, i + 8));
        _mm256_storeu_si256((__m256i *)(dst + i), r);
    }
    return i;
}

/* The fp16 pack loop; returns the number of elements done. */
INLINE size_t pack_fp16_loop(uint16_t *dst, const float *src, const float *ref, __m256 vs,
                             size_t n, int has_ref, int scale)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m128i r0 = fp16_round8(pack_pre(src, ref, vs, has_ref, scale, i));
        __m128i r1 = fp16_round8(pack_pre(src, ref, vs, has_ref, scale, i + 8));
        _mm_storeu_si128((__m128i *)(dst + i), r0);
        _mm_storeu_si128((__m128i *)(dst + i + 8), r1);
    }
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         fp16_round8(pack_pre(src, ref, vs, has_ref, scale, i)));
    return i;
}

/* The pack loop of format fmt, specialised for (has_ref, scale). */
INLINE size_t pack_loop(uint16_t *dst, const float *src, const float *ref, float s, size_t n,
                        int fmt, int has_ref, int scale)
{
    __m256 vs = _mm256_set1_ps(s);
    if (fmt == SRC_BF16) return pack_bf16_loop(dst, src, ref, vs, n, has_ref, scale);
    return pack_fp16_loop(dst, src, ref, vs, n, has_ref, scale);
}

/* Runs the vector loop specialised for (ref != NULL, s != 1) and returns the
 * number of elements done; the caller hands the rest to the reference. */
INLINE size_t pack_dispatch(uint16_t *dst, const float *src, const float *ref, float s,
                            size_t n, int fmt)
{
    int scale = s != 1.0f;
    if (ref) {
        if (scale) return pack_loop(dst, src, ref, s, n, fmt, 1, 1);
        return pack_loop(dst, src, ref, s, n, fmt, 1, 0);
    }
    if (scale) return pack_loop(dst, src, NULL, s, n, fmt, 0, 1);
    return pack_loop(dst, src, NULL, s, n, fmt, 0, 0);
}

static void pack_bf16_avx2(uint16_t *dst, const float *src, const float *ref, float s,
                           size_t n)
{
    size_t i = pack_dispatch(dst, src, ref, s, n, SRC_BF16);
    mpidp__pack_ref.pack_bf16(dst + i, src + i, ref ? ref + i : NULL, s, n - i);
}

static void pack_fp16_avx2(uint16_t *dst, const float *src, const float *ref, float s,
                           size_t n)
{
    size_t i = pack_dispatch(dst, src, ref, s, n, SRC_FP16);
    mpidp__pack_ref.pack_fp16(dst + i, src + i, ref ? ref + i : NULL, s, n - i);
}

INLINE __m256 load_src(const void *src, int fmt, size_t i)
{
    if (fmt == SRC_BF16) return load_bf16((const uint16_t *)src + i);
    if (fmt == SRC_FP16) return load_fp16((const uint16_t *)src + i);
    return _mm256_loadu_ps((const float *)src + i);
}

/* One vector of the merge formula, in the reference's order. */
INLINE void merge8(float *dst, const void *src, const float *ref, __m256 va, __m256 vb,
                   __m256 vc, int fmt, int use_dst, int has_ref, size_t i)
{
    __m256 t = _mm256_mul_ps(vb, load_src(src, fmt, i));
    if (use_dst) t = _mm256_add_ps(_mm256_mul_ps(va, _mm256_loadu_ps(dst + i)), t);
    if (has_ref) t = _mm256_add_ps(t, _mm256_mul_ps(vc, _mm256_loadu_ps(ref + i)));
    _mm256_storeu_ps(dst + i, canon_nan(t));
}

INLINE size_t merge_loop(float *dst, const void *src, const float *ref, float a, float b,
                         float c, size_t n, int fmt, int use_dst, int has_ref)
{
    __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b), vc = _mm256_set1_ps(c);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        merge8(dst, src, ref, va, vb, vc, fmt, use_dst, has_ref, i);
        merge8(dst, src, ref, va, vb, vc, fmt, use_dst, has_ref, i + 8);
    }
    for (; i + 8 <= n; i += 8) merge8(dst, src, ref, va, vb, vc, fmt, use_dst, has_ref, i);
    return i;
}

/* Runs the vector loop specialised for (a != 0, ref != NULL) and returns the
 * number of elements done; the caller hands the rest to the reference. */
INLINE size_t merge_dispatch(float *dst, const void *src, const float *ref, float a,
                             float b, float c, size_t n, int fmt)
{
    int use_dst = a != 0.0f;
    if (ref) {
        if (use_dst) return merge_loop(dst, src, ref, a, b, c, n, fmt, 1, 1);
        return merge_loop(dst, src, ref, a, b, c, n, fmt, 0, 1);
    }
    if (use_dst) return merge_loop(dst, src, NULL, a, b, c, n, fmt, 1, 0);
    return merge_loop(dst, src, NULL, a, b, c, n, fmt, 0, 0);
}

static void unpack_bf16_avx2(float *dst, const uint16_t *src, const float *ref, float a,
                             float b, float c, size_t n)
{
    size_t i = merge_dispatch(dst, src, ref, a, b, c, n, SRC_BF16);
    mpidp__pack_ref.unpack_bf16(dst + i, src + i, ref ? ref + i : NULL, a, b, c, n - i);
}

static void unpack_fp16_avx2(float *dst, const uint16_t *src, const float *ref, float a,
                             float b, float c, size_t n)
{
    size_t i = merge_dispatch(dst, src, ref, a, b, c, n, SRC_FP16);
    mpidp__pack_ref.unpack_fp16(dst + i, src + i, ref ? ref + i : NULL, a, b, c, n - i);
}

static void merge_f32_avx2(float *dst, const float *src, const float *ref, float a,
                           float b, float c, size_t n)
{
    size_t i = merge_dispatch(dst, src, ref, a, b, c, n, SRC_F32);
    mpidp__pack_ref.merge_f32(dst + i, src + i, ref ? ref + i : NULL, a, b, c, n - i);
}

/* The reference adds widen(in) + widen(inout); the order only matters for NaN
 * payloads, which are canonicalised anyway.
 *
 * Interleaving with zero widens bf16 in one in-lane instruction (the 16 bits
 * land in the top half of each 32-bit lane), at the price of element order:
 * "lo" holds elements 0-3 and 8-11, "hi" 4-7 and 12-15. packus works per
 * 128-bit lane too and restores the order, so no lane-crossing permute is
 * needed; this doubles the in-cache speed over bf16_round16. */
static void sum_bf16_avx2(uint16_t *inout, const uint16_t *in, size_t n)
{
    const __m256i zero = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(in + i));
        __m256i y = _mm256_loadu_si256((const __m256i *)(inout + i));
        __m256 lo = _mm256_add_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)),
                                  _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, y)));
        __m256 hi = _mm256_add_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)),
                                  _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, y)));
        _mm256_storeu_si256((__m256i *)(inout + i),
                            _mm256_packus_epi32(bf16_round8(lo), bf16_round8(hi)));
    }
    mpidp__pack_ref.sum_bf16(inout + i, in + i, n - i);
}

static void sum_fp16_avx2(uint16_t *inout, const uint16_t *in, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a0 = _mm256_add_ps(load_fp16(in + i), load_fp16(inout + i));
        __m256 a1 = _mm256_add_ps(load_fp16(in + i + 8), load_fp16(inout + i + 8));
        _mm_storeu_si128((__m128i *)(inout + i), fp16_round8(a0));
        _mm_storeu_si128((__m128i *)(inout + i + 8), fp16_round8(a1));
    }
    for (; i + 8 <= n; i += 8) {
        __m256 a0 = _mm256_add_ps(load_fp16(in + i), load_fp16(inout + i));
        _mm_storeu_si128((__m128i *)(inout + i), fp16_round8(a0));
    }
    mpidp__pack_ref.sum_fp16(inout + i, in + i, n - i);
}

static void scale_f32_avx2(float *x, float s, size_t n)
{
    __m256 vs = _mm256_set1_ps(s);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(x + i), vs);
        __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vs);
        _mm256_storeu_ps(x + i, canon_nan(a0));
        _mm256_storeu_ps(x + i + 8, canon_nan(a1));
    }
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, canon_nan(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs)));
    mpidp__pack_ref.scale_f32(x + i, s, n - i);
}

static void scale_f64_avx2(double *x, double s, size_t n)
{
    const __m256d qnan = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7ff8000000000000ll));
    __m256d vs = _mm256_set1_pd(s);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d t = _mm256_mul_pd(_mm256_loadu_pd(x + i), vs);
        t = _mm256_blendv_pd(t, qnan, _mm256_cmp_pd(t, t, _CMP_UNORD_Q));
        _mm256_storeu_pd(x + i, t);
    }
    mpidp__pack_ref.scale_f64(x + i, s, n - i);
}

static const mpidp_pack_kernels_t pack_avx2 = {
    .name = "avx2",
    .isa = "AVX2+FMA+F16C",
    .pack_bf16 = pack_bf16_avx2,
    .pack_fp16 = pack_fp16_avx2,
    .unpack_bf16 = unpack_bf16_avx2,
    .unpack_fp16 = unpack_fp16_avx2,
    .sum_bf16 = sum_bf16_avx2,
    .sum_fp16 = sum_fp16_avx2,
    .scale_f32 = scale_f32_avx2,
    .scale_f64 = scale_f64_avx2,
    .merge_f32 = merge_f32_avx2,
};

const mpidp_pack_kernels_t *mpidp__pack_avx2_table(void) { return &pack_avx2; }

#else /* built without the AVX2 flags (not x86-64): the path does not exist */

const mpidp_pack_kernels_t *mpidp__pack_avx2_table(void) { return NULL; }

#endif
