/* Core-private helpers shared by the error-feedback compression files. */
#ifndef MPIDP_EFCOMP_INTERNAL_H
#define MPIDP_EFCOMP_INTERNAL_H

#include <stdint.h>

#include "mpidp/efcomp.h"

/* Copies tile `tile` of `tensor` into buf (tile-major slots), or back. */
void mpidp__ef_tile_load(const mpidp_ef_tiling_t *t, const float *tensor, int64_t tile,
                         float *buf);
void mpidp__ef_tile_store(const mpidp_ef_tiling_t *t, float *tensor, int64_t tile,
                          const float *buf);
/* One tile's transform in place; work holds tile_rows * tile_cols floats,
 * cols_t is basis_cols transposed (used by the inverse only). */
void mpidp__ef_dct_tile(float *tile, int64_t tile_rows, int64_t tile_cols, const float *basis_rows,
                        const float *basis_cols, const float *cols_t, int inverse, float *work);

#endif /* MPIDP_EFCOMP_INTERNAL_H */
