/* The 8-bit quantizer's per-element and per-block rules (mpidp/quant8.h),
 * shared by every path: the reference uses them throughout, the SIMD paths
 * for the elements that do not fill a vector. One fp32 operation per
 * statement (no fusing). */
#ifndef MPIDP_QUANT8_ELEM_H
#define MPIDP_QUANT8_ELEM_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "mpidp/quant8.h"
#include "quant8_internal.h"

#define MPIDP_Q8_CANON_NAN 0x7fc00000u

static inline float mpidp__q8_nan(void)
{
    float x;
    uint32_t u = MPIDP_Q8_CANON_NAN;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline float mpidp__q8_scaled(float x, float s) { return s != 1.0f ? x * s : x; }

/* 0 for a NaN or an infinity (t - t is NaN for both). */
static inline int mpidp__q8_is_finite(float t)
{
    float z = t - t;
    return z == 0.0f;
}

/* The header from a block's minimum and maximum and whether all was finite. */
static inline void mpidp__q8_finish_bounds(float mn, float mx, int finite, float *lo, float *hi)
{
    if (!finite) {
        *lo = *hi = mpidp__q8_nan();
        return;
    }
    *lo = mn + 0.0f; /* -0 becomes +0 */
    *hi = mx + 0.0f;
}

static inline void mpidp__q8_put_header(uint8_t *record, float lo, float hi)
{
    memcpy(record, &lo, sizeof lo);
    memcpy(record + sizeof lo, &hi, sizeof hi);
}

static inline mpidp_q8_block_t mpidp__q8_get_header(const uint8_t *record)
{
    float lo, hi;
    memcpy(&lo, record, sizeof lo);
    memcpy(&hi, record + sizeof lo, sizeof hi);
    return mpidp__q8_block_params(lo, hi);
}

static inline uint8_t mpidp__q8_code(float t, const mpidp_q8_block_t *b)
{
    float a = t * b->p;
    float d = a - b->lop;
    float u = d * b->inv;
    float r = rintf(u);
    r = r < 0.0f ? 0.0f : r;
    r = r > 255.0f ? 255.0f : r;
    return (uint8_t)r;
}

static inline float mpidp__q8_value(uint8_t q, const mpidp_q8_block_t *b)
{
    float x = (float)q * b->step;
    x = x + b->lop;
    x = x * b->unp;
    x = x < b->lo ? b->lo : x;
    return x > b->hi ? b->hi : x;
}

/* Decodes codes[from..len) of one block into dst[from..len). */
static inline void mpidp__q8_decode_tail(float *dst, const uint8_t *codes,
                                        const mpidp_q8_block_t *b, int accumulate, size_t from,
                                        size_t len)
{
    for (size_t i = from; i < len; i++) {
        float x = b->finite ? mpidp__q8_value(codes[i], b) : mpidp__q8_nan();
        if (accumulate) x = dst[i] + x;
        dst[i] = x != x ? mpidp__q8_nan() : x;
    }
}

#endif /* MPIDP_QUANT8_ELEM_H */
