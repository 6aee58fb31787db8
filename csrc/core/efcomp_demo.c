/* Error-feedback compression: DeMo's compression of a tensor's momentum and
 * the aggregate of the gathered coefficients (mpidp/efcomp.h). */
#include <stdlib.h>
#include <string.h>

#include "efcomp_internal.h"
#include "fail.h"
#include "mpidp/efcomp.h"
#include "mpidp/status.h"

static int check_bases(const mpidp_ef_tiling_t *t, int64_t k, const float *fr, const float *fc,
                       const char *who)
{
    if (t == NULL || fr == NULL || fc == NULL || t->tile_rows < 1 || t->tile_cols < 1 ||
        t->tile_rows > MPIDP_EF_MAX_CHUNK || t->tile_cols > MPIDP_EF_MAX_CHUNK ||
        t->rows % t->tile_rows || t->cols % t->tile_cols)
        return mpidp__fail(MPIDP_EINVAL, "%s: not a tiling of the tensor, or no bases", who);
    if (k < 1 || k > mpidp_ef_tile_len(t))
        return mpidp__fail(MPIDP_EINVAL, "%s: k must be 1 .. %lld (the tile's length), got %lld",
                           who, (long long)mpidp_ef_tile_len(t), (long long)k);
    return MPIDP_OK;
}

int mpidp_ef_demo_compress(const mpidp_ef_tiling_t *t, float *delta, const float *grad,
                           float beta, float lr, int64_t k, const float *basis_rows,
                           const float *basis_cols, uint8_t *payload)
{
    int rc = check_bases(t, k, basis_rows, basis_cols, "DeMo compress");
    if (rc != MPIDP_OK) return rc;
    if (delta == NULL || payload == NULL)
        return mpidp__fail(MPIDP_EINVAL, "DeMo compress: NULL argument");
    int64_t r = t->tile_rows, c = t->tile_cols, len = r * c;
    int64_t ntiles = mpidp_ef_ntiles(t), n = ntiles * k;
    /* tile, its transform, the work of a transform, Fc^T */
    float *buf = malloc((size_t)(3 * len + c * c) * sizeof *buf);
    uint16_t *slots = malloc((size_t)n * sizeof *slots);
    float *values = malloc((size_t)n * sizeof *values);
    if (buf == NULL || slots == NULL || values == NULL) {
        free(buf), free(slots), free(values);
        return mpidp__fail(MPIDP_ENOMEM, "DeMo compress: no memory");
    }
    float *tile = buf, *x = buf + len, *work = buf + 2 * len, *cols_t = buf + 3 * len;
    for (int64_t i = 0; i < c; i++)
        for (int64_t j = 0; j < c; j++) cols_t[j * c + i] = basis_cols[i * c + j];
    for (int64_t tl = 0; tl < ntiles; tl++) {
        mpidp__ef_tile_load(t, delta, tl, tile);
        if (grad != NULL) {
            mpidp__ef_tile_load(t, grad, tl, x);
            for (int64_t i = 0; i < len; i++) tile[i] = beta * tile[i] + lr * x[i];
        } else {
            for (int64_t i = 0; i < len; i++) tile[i] = beta * tile[i];
        }
        memcpy(x, tile, (size_t)len * sizeof *x);
        mpidp__ef_dct_tile(x, r, c, basis_rows, basis_cols, cols_t, 0, work);
        uint16_t *s = slots + tl * k;
        float *v = values + tl * k;
        mpidp_ef_topk(x, 1, len, k, s, v);
        /* delta loses what is sent: the inverse transform of the kept
         * coefficients alone, the sum of their k basis images (k x len
         * products, not a whole transform's (r + c) x len). */
        memset(x, 0, (size_t)len * sizeof *x);
        for (int64_t i = 0; i < k; i++) {
            int64_t a = s[i] / c, b = s[i] % c;
            for (int64_t row = 0; row < r; row++) {
                float w = v[i] * basis_rows[row * r + a];
                float *out = x + row * c;
                const float *image = cols_t + b * c; /* column b of Fc */
                for (int64_t col = 0; col < c; col++) out[col] += w * image[col];
            }
        }
        for (int64_t i = 0; i < len; i++) tile[i] -= x[i];
        mpidp__ef_tile_store(t, delta, tl, tile);
    }
    size_t slot_bytes = k == len ? 0 : (size_t)n * sizeof *slots; /* dense: slots implicit */
    memcpy(payload, slots, slot_bytes);
    memcpy(payload + slot_bytes, values, (size_t)n * sizeof *values);
    free(buf), free(slots), free(values);
    return MPIDP_OK;
}

int mpidp_ef_demo_decode(const mpidp_ef_tiling_t *t, const uint8_t *gathered, size_t stride,
                         int R, int64_t k, const float *basis_rows, const float *basis_cols,
                         float *out)
{
    int rc = check_bases(t, k, basis_rows, basis_cols, "DeMo decode");
    if (rc != MPIDP_OK) return rc;
    if (out == NULL) return mpidp__fail(MPIDP_EINVAL, "DeMo decode: NULL argument");
    int64_t numel = t->rows * t->cols, len = mpidp_ef_tile_len(t), ntiles = mpidp_ef_ntiles(t);
    float *tiles = malloc((size_t)numel * sizeof *tiles);
    if (tiles == NULL) return mpidp__fail(MPIDP_ENOMEM, "DeMo decode: no memory");
    rc = mpidp_ef_sparse_mean(t, gathered, stride, R, k, 0, 0, 1, tiles);
    if (rc == MPIDP_OK)
        rc = mpidp_ef_dct_tiles(tiles, ntiles, t->tile_rows, t->tile_cols, basis_rows,
                                basis_cols, 1);
    if (rc == MPIDP_OK)
        for (int64_t tl = 0; tl < ntiles; tl++)
            mpidp__ef_tile_store(t, out, tl, tiles + tl * len);
    free(tiles);
    return rc;
}
