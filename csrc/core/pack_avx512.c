/* AVX-512 kernels, compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq
 * -mavx512bf16 -mfma -mf16c by file name. Two tables live here:
 *
 *   "avx512"       needs AVX512F/BW/VL/DQ and rounds fp32 to bf16 with integer
 *                  operations, exactly like the reference;
 *   "avx512_bf16"  also needs AVX512_BF16 and rounds with VCVTNEPS2BF16.
 *
 * VCVTNEPS2BF16 rounds to nearest even like the reference for normal numbers,
 * zeros and infinities, but it treats subnormal inputs as zero and keeps NaN
 * payloads. So each 16-lane conversion also classifies its inputs with two
 * integer compares; when any lane is a NaN or an fp32 subnormal (rare in real
 * data), the integer rounding is computed too and blended into exactly those
 * lanes. Only the two bf16-producing kernels (pack_bf16, sum_bf16) differ
 * between the tables; the compiler never emits AVX512_BF16 instructions on its
 * own, so the "avx512" table runs on CPUs without that extension.
 *
 * Everything else mirrors pack_avx2.c with 16-lane vectors and opmask blends:
 * separate multiplies and adds in the reference's order, canonical NaNs, and
 * the reference kernel for the last partial vector.
 *
 * This file cannot run on a CPU without AVX-512; mpidp_pack_init self-checks
 * whichever table it picks against the reference before using it. */
#include "mpidp/pack.h"
#include "pack_internal.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)

#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

/* 16 floats to 16 bf16 with integer rounding (see mpidp_bf16_from_f32). */
INLINE __m256i bf16_round16_int(__m512 x)
{
    const __m512i bias = _mm512_set1_epi32(0x7fff);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i qnan = _mm512_set1_epi32(0x7fc0);
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i t = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), 16);
    t = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), t, qnan);
    return _mm512_cvtepi32_epi16(t);
}

#if defined(__AVX512BF16__)
/* 16 floats to 16 bf16 with VCVTNEPS2BF16, patching NaN and subnormal lanes. */
INLINE __m256i bf16_round16_native(__m512 x)
{
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf = _mm512_set1_epi32(0x7f800000);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i below_normal = _mm512_set1_epi32(0x007fffff);
    __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
    __m512i a = _mm512_and_si512(_mm512_castps_si512(x), abs_mask);
    /* NaN: |x| > inf as integers. Subnormal: 1 <= |x| <= 0x7FFFFF, i.e. |x| - 1
     * below 0x7FFFFF unsigned (zero wraps around to the top and is excluded). */
    __mmask16 nan = _mm512_cmpgt_epi32_mask(a, inf);
    __mmask16 sub = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, one), below_normal);
    __mmask16 fix = _kor_mask16(nan, sub);
    if (fix) r = _mm256_mask_blend_epi16(fix, r, bf16_round16_int(x));
    return r;
}
#endif

INLINE __m256i bf16_round16(__m512 x, int native)
{
#if defined(__AVX512BF16__)
    if (native) return bf16_round16_native(x);
#else
    (void)native;
#endif
    return bf16_round16_int(x);
}

INLINE __m512 canon_nan(__m512 x)
{
    const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x, qnan);
}

INLINE __m256i fp16_round16(__m512 x)
{
    return _mm512_cvtps_ph(canon_nan(x), _MM_FROUND_TO_NEAREST_INT);
}

INLINE __m512 widen_bf16(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE __m512 load_bf16(const uint16_t *p)
{
    return widen_bf16(_mm256_loadu_si256((const __m256i *)p));
}

INLINE __m512 load_fp16(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

INLINE __m512 pack_pre(const float *src, const float *ref, __m512 s, int has_ref,
                       int scale, size_t i)
{
    __m512 t = _mm512_loadu_ps(src + i);
    if (has_ref) t = _mm512_sub_ps(t, _mm512_loadu_ps(ref + i));
    if (scale) t = _mm512_mul_ps(t, s);
    return t;
}

enum { SRC_F32, SRC_BF16, SRC_FP16 };

/* 16 floats to the 16-bit format fmt (native: bf16 with VCVTNEPS2BF16). */
INLINE __m256i round16(__m512 x, int fmt, int native)
{
    return fmt == SRC_BF16 ? bf16_round16(x, native) : fp16_round16(x);
}

/* The pack loop of format fmt, specialised for (has_ref, scale); returns the
 * number of elements done. */
INLINE size_t pack_loop(uint16_t *dst, const float *src, const float *ref, float s, size_t n,
                        int fmt, int native, int has_ref, int scale)
{
    __m512 vs = _mm512_set1_ps(s);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i r0 = round16(pack_pre(src, ref, vs, has_ref, scale, i), fmt, native);
        __m256i r1 = round16(pack_pre(src, ref, vs, has_ref, scale, i + 16), fmt, native);
        _mm256_storeu_si256((__m256i *)(dst + i), r0);
        _mm256_storeu_si256((__m256i *)(dst + i + 16), r1);
    }
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            round16(pack_pre(src, ref, vs, has_ref, scale, i), fmt, native));
    return i;
}

/* Runs the vector loop specialised for (ref != NULL, s != 1), then the
 * reference kernel on the last partial vector. */
INLINE void pack_any(uint16_t *dst, const float *src, const float *ref, float s, size_t n,
                     int fmt, int native)
{
    int scale = s != 1.0f;
    size_t i;
    if (ref) i = scale ? pack_loop(dst, src, ref, s, n, fmt, native, 1, 1)
                       : pack_loop(dst, src, ref, s, n, fmt, native, 1, 0);
    else i = scale ? pack_loop(dst, src, NULL, s, n, fmt, native, 0, 1)
                   : pack_loop(dst, src, NULL, s, n, fmt, native, 0, 0);
    (fmt == SRC_BF16 ? mpidp__pack_ref.pack_bf16 : mpidp__pack_ref.pack_fp16)(
        dst + i, src + i, ref ? ref + i : NULL, s, n - i);
}

static void pack_bf16_avx512(uint16_t *dst, const float *src, const float *ref, float s,
                             size_t n)
{
    pack_any(dst, src, ref, s, n, SRC_BF16, 0);
}

static void pack_fp16_avx512(uint16_t *dst, const float *src, const float *ref, float s,
                             size_t n)
{
    pack_any(dst, src, ref, s, n, SRC_FP16, 0);
}


INLINE __m512 load_src(const void *src, int fmt, size_t i)
{
    if (fmt == SRC_BF16) return load_bf16((const uint16_t *)src + i);
    if (fmt == SRC_FP16) return load_fp16((const uint16_t *)src + i);
    return _mm512_loadu_ps((const float *)src + i);
}

INLINE void merge16(float *dst, const void *src, const float *ref, __m512 va, __m512 vb,
                    __m512 vc, int fmt, int use_dst, int has_ref, size_t i)
{
    __m512 t = _mm512_mul_ps(vb, load_src(src, fmt, i));
    if (use_dst) t = _mm512_add_ps(_mm512_mul_ps(va, _mm512_loadu_ps(dst + i)), t);
    if (has_ref) t = _mm512_add_ps(t, _mm512_mul_ps(vc, _mm512_loadu_ps(ref + i)));
    _mm512_storeu_ps(dst + i, canon_nan(t));
}

INLINE size_t merge_loop(float *dst, const void *src, const float *ref, float a, float b,
                         float c, size_t n, int fmt, int use_dst, int has_ref)
{
    __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b), vc = _mm512_set1_ps(c);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        merge16(dst, src, ref, va, vb, vc, fmt, use_dst, has_ref, i);
        merge16(dst, src, ref, va, vb, vc, fmt, use_dst, has_ref, i + 16);
    }
    for (; i + 16 <= n; i += 16) merge16(dst, src, ref, va, vb, vc, fmt, use_dst, has_ref, i);
    return i;
}

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

static void unpack_bf16_avx512(float *dst, const uint16_t *src, const float *ref, float a,
                               float b, float c, size_t n)
{
    size_t i = merge_dispatch(dst, src, ref, a, b, c, n, SRC_BF16);
    mpidp__pack_ref.unpack_bf16(dst + i, src + i, ref ? ref + i : NULL, a, b, c, n - i);
}

static void unpack_fp16_avx512(float *dst, const uint16_t *src, const float *ref, float a,
                               float b, float c, size_t n)
{
    size_t i = merge_dispatch(dst, src, ref, a, b, c, n, SRC_FP16);
    mpidp__pack_ref.unpack_fp16(dst + i, src + i, ref ? ref + i : NULL, a, b, c, n - i);
}

static void merge_f32_avx512(float *dst, const float *src, const float *ref, float a,
                             float b, float c, size_t n)
{
    size_t i = merge_dispatch(dst, src, ref, a, b, c, n, SRC_F32);
    mpidp__pack_ref.merge_f32(dst + i, src + i, ref ? ref + i : NULL, a, b, c, n - i);
}

INLINE void sum_bf16_any(uint16_t *inout, const uint16_t *in, size_t n, int native)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 t = _mm512_add_ps(load_bf16(in + i), load_bf16(inout + i));
        _mm256_storeu_si256((__m256i *)(inout + i), bf16_round16(t, native));
    }
    mpidp__pack_ref.sum_bf16(inout + i, in + i, n - i);
}

static void sum_bf16_avx512(uint16_t *inout, const uint16_t *in, size_t n)
{
    sum_bf16_any(inout, in, n, 0);
}

static void sum_fp16_avx512(uint16_t *inout, const uint16_t *in, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 t = _mm512_add_ps(load_fp16(in + i), load_fp16(inout + i));
        _mm256_storeu_si256((__m256i *)(inout + i), fp16_round16(t));
    }
    mpidp__pack_ref.sum_fp16(inout + i, in + i, n - i);
}

static void scale_f32_avx512(float *x, float s, size_t n)
{
    __m512 vs = _mm512_set1_ps(s);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(x + i), vs);
        __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(x + i + 16), vs);
        _mm512_storeu_ps(x + i, canon_nan(a0));
        _mm512_storeu_ps(x + i + 16, canon_nan(a1));
    }
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(x + i, canon_nan(_mm512_mul_ps(_mm512_loadu_ps(x + i), vs)));
    mpidp__pack_ref.scale_f32(x + i, s, n - i);
}

static void scale_f64_avx512(double *x, double s, size_t n)
{
    const __m512d qnan = _mm512_castsi512_pd(_mm512_set1_epi64(0x7ff8000000000000ll));
    __m512d vs = _mm512_set1_pd(s);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512d t = _mm512_mul_pd(_mm512_loadu_pd(x + i), vs);
        t = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(t, t, _CMP_UNORD_Q), t, qnan);
        _mm512_storeu_pd(x + i, t);
    }
    mpidp__pack_ref.scale_f64(x + i, s, n - i);
}

static const mpidp_pack_kernels_t pack_avx512 = {
    .name = "avx512",
    .isa = "AVX512F/BW/VL/DQ",
    .pack_bf16 = pack_bf16_avx512,
    .pack_fp16 = pack_fp16_avx512,
    .unpack_bf16 = unpack_bf16_avx512,
    .unpack_fp16 = unpack_fp16_avx512,
    .sum_bf16 = sum_bf16_avx512,
    .sum_fp16 = sum_fp16_avx512,
    .scale_f32 = scale_f32_avx512,
    .scale_f64 = scale_f64_avx512,
    .merge_f32 = merge_f32_avx512,
};

const mpidp_pack_kernels_t *mpidp__pack_avx512_table(void) { return &pack_avx512; }

#if defined(__AVX512BF16__)
static void pack_bf16_avx512_bf16(uint16_t *dst, const float *src, const float *ref,
                                  float s, size_t n)
{
    pack_any(dst, src, ref, s, n, SRC_BF16, 1);
}

static void sum_bf16_avx512_bf16(uint16_t *inout, const uint16_t *in, size_t n)
{
    sum_bf16_any(inout, in, n, 1);
}

static const mpidp_pack_kernels_t pack_avx512_bf16 = {
    .name = "avx512_bf16",
    .isa = "AVX512F/BW/VL/DQ+AVX512_BF16",
    .pack_bf16 = pack_bf16_avx512_bf16,
    .pack_fp16 = pack_fp16_avx512,
    .unpack_bf16 = unpack_bf16_avx512,
    .unpack_fp16 = unpack_fp16_avx512,
    .sum_bf16 = sum_bf16_avx512_bf16,
    .sum_fp16 = sum_fp16_avx512,
    .scale_f32 = scale_f32_avx512,
    .scale_f64 = scale_f64_avx512,
    .merge_f32 = merge_f32_avx512,
};

const mpidp_pack_kernels_t *mpidp__pack_avx512_bf16_table(void) { return &pack_avx512_bf16; }
#else
const mpidp_pack_kernels_t *mpidp__pack_avx512_bf16_table(void) { return NULL; }
#endif

#else /* built without the AVX-512 flags: neither path exists */

const mpidp_pack_kernels_t *mpidp__pack_avx512_table(void) { return NULL; }
const mpidp_pack_kernels_t *mpidp__pack_avx512_bf16_table(void) { return NULL; }

#endif
