/* Core-private: the 8-bit kernels' tables, a block's decoding constants
 * (shared with the CUDA kernels, so both decode alike) and the self-check. */
#ifndef MPIDP_CORE_QUANT8_INTERNAL_H
#define MPIDP_CORE_QUANT8_INTERNAL_H

#include "mpidp/quant8.h"

#ifdef __cplusplus
extern "C" {
#endif

extern const mpidp_q8_kernels_t mpidp__q8_ref;
/* The SIMD tables, or NULL where the build had no flags for them. */
const mpidp_q8_kernels_t *mpidp__q8_avx2_table(void);
const mpidp_q8_kernels_t *mpidp__q8_avx512_table(void);

/* A block's decoding constants, from its header only (see above). */
typedef struct {
    float lo, hi, p, unp, lop, step, inv;
    int finite; /* 0: the block decodes to NaN */
} mpidp_q8_block_t;

MPIDP_Q8_INLINE mpidp_q8_block_t mpidp__q8_block_params(float lo, float hi)
{
    mpidp_q8_block_t b = {lo, hi, 1.0f, 1.0f, lo, 0.0f, 0.0f, lo == lo && hi == hi};
    if (!b.finite) return b;
    double range = (double)hi - (double)lo;
    if (range > 0.0 && range < 0x1p-60) b.p = 0x1p100f, b.unp = 0x1p-100f;
    if (range > 0x1p124) b.p = 0x1p-4f, b.unp = 0x1p4f;
    b.lop = lo * b.p;
    if (range > 0.0) {
        range *= b.p;
        b.step = (float)(range / 255.0);
        b.inv = (float)(255.0 / range);
    }
    return b;
}

/* Compares a path with the reference on special and pseudo-random blocks;
 * 0 when identical, else 1 with a description in why. */
int mpidp__q8_selfcheck(const mpidp_q8_kernels_t *k, char *why, size_t why_len);

#ifdef __cplusplus
}
#endif

#endif /* MPIDP_CORE_QUANT8_INTERNAL_H */
