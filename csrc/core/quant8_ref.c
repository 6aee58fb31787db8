/* The scalar reference of the 8-bit block quantizer (see mpidp/quant8.h):
 * the definition every SIMD path matches bit for bit. One fp32 operation per
 * statement, so no compiler can fuse a multiply and an add. The SIMD paths
 * call the per-element functions of quant8_elem.h for their tails. */
#include <string.h>

#include "mpidp/quant8.h"
#include "quant8_elem.h"
#include "quant8_internal.h"

/* The header {lo, hi} of the block src[0..n) (n >= 1) scaled by s. */
static void block_bounds(const float *src, float s, size_t n, float *lo, float *hi)
{
    float mn = mpidp__q8_scaled(src[0], s), mx = mn;
    int finite = 1;
    for (size_t i = 0; i < n; i++) {
        float t = mpidp__q8_scaled(src[i], s);
        finite &= mpidp__q8_is_finite(t);
        mn = t < mn ? t : mn;
        mx = t > mx ? t : mx;
    }
    mpidp__q8_finish_bounds(mn, mx, finite, lo, hi);
}

static void encode_ref(uint8_t *dst, const float *src, float s, size_t n)
{
    for (size_t at = 0; at < n; at += MPIDP_Q8_BLOCK, dst += MPIDP_Q8_RECORD) {
        size_t len = n - at < MPIDP_Q8_BLOCK ? n - at : MPIDP_Q8_BLOCK;
        float lo, hi;
        block_bounds(src + at, s, len, &lo, &hi);
        mpidp__q8_put_header(dst, lo, hi);
        mpidp_q8_block_t b = mpidp__q8_block_params(lo, hi);
        uint8_t *codes = dst + MPIDP_Q8_HEADER;
        for (size_t i = 0; i < len; i++)
            codes[i] = b.finite ? mpidp__q8_code(mpidp__q8_scaled(src[at + i], s), &b) : 0;
        memset(codes + len, 0, MPIDP_Q8_BLOCK - len);
    }
}

static void decode_ref(float *dst, const uint8_t *src, int accumulate, size_t n)
{
    for (size_t at = 0; at < n; at += MPIDP_Q8_BLOCK, src += MPIDP_Q8_RECORD) {
        size_t len = n - at < MPIDP_Q8_BLOCK ? n - at : MPIDP_Q8_BLOCK;
        mpidp_q8_block_t b = mpidp__q8_get_header(src);
        mpidp__q8_decode_tail(dst + at, src + MPIDP_Q8_HEADER, &b, accumulate, 0, len);
    }
}

const mpidp_q8_kernels_t mpidp__q8_ref = {"ref", encode_ref, decode_ref};
