/* The 8-bit block quantizer with AVX-512 (F, BW, VL, DQ; compiled with those
 * flags, used only after CPUID said so): the AVX2 path's statements on
 * sixteen lanes, clamps as compare-and-blend under masks (see quant8_avx2.c). */
#include <immintrin.h>

#include "mpidp/quant8.h"
#include "quant8_elem.h"
#include "quant8_internal.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)

static inline __m512 scaled16(const float *src, float s)
{
    __m512 t = _mm512_loadu_ps(src);
    return s != 1.0f ? _mm512_mul_ps(t, _mm512_set1_ps(s)) : t;
}

static void block_bounds(const float *src, float s, size_t n, float *lo, float *hi)
{
    float t0 = mpidp__q8_scaled(src[0], s), mn = t0, mx = t0;
    int finite = 1;
    size_t i = 0;
    if (n >= 16) {
        __m512 vmn = _mm512_set1_ps(t0), vmx = vmn;
        __mmask16 bad = 0;
        for (; i + 16 <= n; i += 16) {
            __m512 t = scaled16(src + i, s);
            __m512 z = _mm512_sub_ps(t, t);
            bad |= _mm512_cmp_ps_mask(z, z, _CMP_UNORD_Q);
            vmn = _mm512_min_ps(vmn, t);
            vmx = _mm512_max_ps(vmx, t);
        }
        finite = bad == 0;
        /* Exact whatever the order: the bounds are canonicalised below. */
        mn = _mm512_reduce_min_ps(vmn);
        mx = _mm512_reduce_max_ps(vmx);
    }
    for (; i < n; i++) {
        float t = mpidp__q8_scaled(src[i], s);
        finite &= mpidp__q8_is_finite(t);
        mn = t < mn ? t : mn;
        mx = t > mx ? t : mx;
    }
    mpidp__q8_finish_bounds(mn, mx, finite, lo, hi);
}

static inline __m128i codes16(__m512 t, const mpidp_q8_block_t *b)
{
    __m512 a = _mm512_mul_ps(t, _mm512_set1_ps(b->p));
    __m512 d = _mm512_sub_ps(a, _mm512_set1_ps(b->lop));
    __m512 u = _mm512_mul_ps(d, _mm512_set1_ps(b->inv));
    __m512 r = _mm512_roundscale_ps(u, _MM_FROUND_CUR_DIRECTION);
    __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(255.0f);
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, zero, _CMP_LT_OQ), r, zero);
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, top, _CMP_GT_OQ), r, top);
    return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r));
}

static void encode_avx512(uint8_t *dst, const float *src, float s, size_t n)
{
    for (size_t at = 0; at < n; at += MPIDP_Q8_BLOCK, dst += MPIDP_Q8_RECORD) {
        size_t len = n - at < MPIDP_Q8_BLOCK ? n - at : MPIDP_Q8_BLOCK, i = 0;
        const float *x = src + at;
        float lo, hi;
        block_bounds(x, s, len, &lo, &hi);
        mpidp__q8_put_header(dst, lo, hi);
        mpidp_q8_block_t b = mpidp__q8_block_params(lo, hi);
        uint8_t *codes = dst + MPIDP_Q8_HEADER;
        if (!b.finite) {
            memset(codes, 0, MPIDP_Q8_BLOCK);
            continue;
        }
        for (; i + 16 <= len; i += 16)
            _mm_storeu_si128((__m128i *)(codes + i), codes16(scaled16(x + i, s), &b));
        for (; i < len; i++) codes[i] = mpidp__q8_code(mpidp__q8_scaled(x[i], s), &b);
        memset(codes + len, 0, MPIDP_Q8_BLOCK - len);
    }
}

static void decode_avx512(float *dst, const uint8_t *src, int accumulate, size_t n)
{
    const __m512 nan = _mm512_castsi512_ps(_mm512_set1_epi32((int)MPIDP_Q8_CANON_NAN));
    for (size_t at = 0; at < n; at += MPIDP_Q8_BLOCK, src += MPIDP_Q8_RECORD) {
        size_t len = n - at < MPIDP_Q8_BLOCK ? n - at : MPIDP_Q8_BLOCK, i = 0;
        mpidp_q8_block_t b = mpidp__q8_get_header(src);
        const uint8_t *codes = src + MPIDP_Q8_HEADER;
        float *y = dst + at;
        const __m512 step = _mm512_set1_ps(b.step), lop = _mm512_set1_ps(b.lop),
                     unp = _mm512_set1_ps(b.unp), lo = _mm512_set1_ps(b.lo),
                     hi = _mm512_set1_ps(b.hi);
        for (; i + 16 <= len; i += 16) {
            __m512 x = nan;
            if (b.finite) {
                __m128i q = _mm_loadu_si128((const __m128i *)(codes + i));
                x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), step);
                x = _mm512_add_ps(x, lop);
                x = _mm512_mul_ps(x, unp);
                x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), x, lo);
                x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), x, hi);
            }
            if (accumulate) x = _mm512_add_ps(_mm512_loadu_ps(y + i), x);
            x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x, nan);
            _mm512_storeu_ps(y + i, x);
        }
        mpidp__q8_decode_tail(y, codes, &b, accumulate, i, len);
    }
}

static const mpidp_q8_kernels_t q8_avx512 = {"avx512", encode_avx512, decode_avx512};
const mpidp_q8_kernels_t *mpidp__q8_avx512_table(void) { return &q8_avx512; }

#else /* built without the AVX-512 flags: the path does not exist */

const mpidp_q8_kernels_t *mpidp__q8_avx512_table(void) { return NULL; }

#endif
