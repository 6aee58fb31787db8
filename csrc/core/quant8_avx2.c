/* The 8-bit block quantizer with AVX2 (compiled with -mavx2 -mfma -mf16c;
 * used only after CPUID said so). Eight lanes run the reference's statements
 * (quant8_elem.h) in the same order; clamps are compare-and-blend, not
 * min/max, so that a signed zero meets the same rule as in the scalar code.
 * The block bounds use vector min/max, which is exact: bounds are canonical
 * (+0.0f) afterwards, and a block with a NaN or an infinity ignores them. */
#include <immintrin.h>

#include "mpidp/quant8.h"
#include "quant8_elem.h"
#include "quant8_internal.h"

#if defined(__AVX2__)

static inline __m256 scaled8(const float *src, float s)
{
    __m256 t = _mm256_loadu_ps(src);
    return s != 1.0f ? _mm256_mul_ps(t, _mm256_set1_ps(s)) : t;
}

static float hmin8(__m256 v)
{
    float x[8], m = 0.0f;
    _mm256_storeu_ps(x, v);
    for (int i = 0; i < 8; i++) m = (i == 0 || x[i] < m) ? x[i] : m;
    return m;
}

static float hmax8(__m256 v)
{
    float x[8], m = 0.0f;
    _mm256_storeu_ps(x, v);
    for (int i = 0; i < 8; i++) m = (i == 0 || x[i] > m) ? x[i] : m;
    return m;
}

static void block_bounds(const float *src, float s, size_t n, float *lo, float *hi)
{
    float t0 = mpidp__q8_scaled(src[0], s), mn = t0, mx = t0;
    int finite = 1;
    size_t i = 0;
    if (n >= 8) {
        __m256 vmn = _mm256_set1_ps(t0), vmx = vmn, bad = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m256 t = scaled8(src + i, s);
            __m256 z = _mm256_sub_ps(t, t);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(z, z, _CMP_UNORD_Q));
            vmn = _mm256_min_ps(vmn, t);
            vmx = _mm256_max_ps(vmx, t);
        }
        finite = _mm256_movemask_ps(bad) == 0;
        mn = hmin8(vmn);
        mx = hmax8(vmx);
    }
    for (; i < n; i++) {
        float t = mpidp__q8_scaled(src[i], s);
        finite &= mpidp__q8_is_finite(t);
        mn = t < mn ? t : mn;
        mx = t > mx ? t : mx;
    }
    mpidp__q8_finish_bounds(mn, mx, finite, lo, hi);
}

/* Eight codes of t, as the low 8 bytes. */
static inline __m128i codes8(__m256 t, const mpidp_q8_block_t *b)
{
    __m256 a = _mm256_mul_ps(t, _mm256_set1_ps(b->p));
    __m256 d = _mm256_sub_ps(a, _mm256_set1_ps(b->lop));
    __m256 u = _mm256_mul_ps(d, _mm256_set1_ps(b->inv));
    __m256 r = _mm256_round_ps(u, _MM_FROUND_CUR_DIRECTION);
    __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(255.0f);
    r = _mm256_blendv_ps(r, zero, _mm256_cmp_ps(r, zero, _CMP_LT_OQ));
    r = _mm256_blendv_ps(r, top, _mm256_cmp_ps(r, top, _CMP_GT_OQ));
    __m256i q = _mm256_cvtps_epi32(r);
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    return _mm_packus_epi16(w, w);
}

static void encode_avx2(uint8_t *dst, const float *src, float s, size_t n)
{
    for (size_t at = 0; at < n; at += MPIDP_Q8_BLOCK, dst += MPIDP_Q8_RECORD) {
        size_t len = n - at < MPIDP_Q8_BLOCK ? n - at : MPIDP_Q8_BLOCK;
        const float *x = src + at;
        float lo, hi;
        block_bounds(x, s, len, &lo, &hi);
        mpidp__q8_put_header(dst, lo, hi);
        mpidp_q8_block_t b = mpidp__q8_block_params(lo, hi);
        uint8_t *codes = dst + MPIDP_Q8_HEADER;
        size_t i = 0;
        if (!b.finite) {
            memset(codes, 0, MPIDP_Q8_BLOCK);
            continue;
        }
        for (; i + 8 <= len; i += 8)
            _mm_storel_epi64((__m128i *)(codes + i), codes8(scaled8(x + i, s), &b));
        for (; i < len; i++) codes[i] = mpidp__q8_code(mpidp__q8_scaled(x[i], s), &b);
        memset(codes + len, 0, MPIDP_Q8_BLOCK - len);
    }
}

static void decode_avx2(float *dst, const uint8_t *src, int accumulate, size_t n)
{
    const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32((int)MPIDP_Q8_CANON_NAN));
    for (size_t at = 0; at < n; at += MPIDP_Q8_BLOCK, src += MPIDP_Q8_RECORD) {
        size_t len = n - at < MPIDP_Q8_BLOCK ? n - at : MPIDP_Q8_BLOCK, i = 0;
        mpidp_q8_block_t b = mpidp__q8_get_header(src);
        const uint8_t *codes = src + MPIDP_Q8_HEADER;
        float *y = dst + at;
        const __m256 step = _mm256_set1_ps(b.step), lop = _mm256_set1_ps(b.lop),
                     unp = _mm256_set1_ps(b.unp), lo = _mm256_set1_ps(b.lo),
                     hi = _mm256_set1_ps(b.hi);
        for (; i + 8 <= len; i += 8) {
            __m256 x = nan;
            if (b.finite) {
                __m128i q = _mm_loadl_epi64((const __m128i *)(codes + i));
                x = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), step);
                x = _mm256_add_ps(x, lop);
                x = _mm256_mul_ps(x, unp);
                x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
                x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
            }
            if (accumulate) x = _mm256_add_ps(_mm256_loadu_ps(y + i), x);
            x = _mm256_blendv_ps(x, nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            _mm256_storeu_ps(y + i, x);
        }
        mpidp__q8_decode_tail(y, codes, &b, accumulate, i, len);
    }
}

static const mpidp_q8_kernels_t q8_avx2 = {"avx2", encode_avx2, decode_avx2};
const mpidp_q8_kernels_t *mpidp__q8_avx2_table(void) { return &q8_avx2; }

#else /* built without the AVX2 flags (not x86-64): the path does not exist */

const mpidp_q8_kernels_t *mpidp__q8_avx2_table(void) { return NULL; }

#endif
