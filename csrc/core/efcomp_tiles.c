/* Error-feedback compression: the tiling of a tensor and the per-tile top-k
 * (mpidp/efcomp.h). */
#include <stdlib.h>
#include <string.h>

#include "fail.h"
#include "mpidp/efcomp.h"
#include "mpidp/status.h"

int64_t mpidp_ef_tile_side(int64_t n, int64_t chunk)
{
    if (n <= chunk) return n;
    for (int64_t s = chunk; s > 1; s--)
        if (n % s == 0) return s;
    return 1;
}

int mpidp_ef_tiling(int ndim, const int64_t *sizes, int64_t chunk, mpidp_ef_tiling_t *out)
{
    if (out == NULL || ndim < 0 || (ndim > 0 && sizes == NULL))
        return mpidp__fail(MPIDP_EINVAL, "tiling: NULL argument or negative ndim");
    if (chunk < 1 || chunk > MPIDP_EF_MAX_CHUNK)
        return mpidp__fail(MPIDP_EINVAL, "chunk: expected 1 .. %d, got %lld", MPIDP_EF_MAX_CHUNK,
                           (long long)chunk);
    int64_t rows = 1, cols = 1;
    for (int d = 0; d < ndim; d++) {
        if (sizes[d] < 1)
            return mpidp__fail(MPIDP_EINVAL, "tiling: dimension %d has size %lld (expected >= 1)",
                               d, (long long)sizes[d]);
        if (ndim >= 2 && d == 0) rows = sizes[0];
        else if (cols > INT64_MAX / sizes[d])
            return mpidp__fail(MPIDP_EINVAL, "tiling: the tensor is too large");
        else cols *= sizes[d];
    }
    out->rows = rows;
    out->cols = cols;
    out->tile_rows = mpidp_ef_tile_side(rows, chunk);
    out->tile_cols = mpidp_ef_tile_side(cols, chunk);
    return MPIDP_OK;
}

int64_t mpidp_ef_ntiles(const mpidp_ef_tiling_t *t)
{
    return (t->rows / t->tile_rows) * (t->cols / t->tile_cols);
}

int64_t mpidp_ef_tile_len(const mpidp_ef_tiling_t *t) { return t->tile_rows * t->tile_cols; }

int64_t mpidp_ef_index(const mpidp_ef_tiling_t *t, int64_t tile, int64_t slot)
{
    int64_t across = t->cols / t->tile_cols;
    int64_t row = (tile / across) * t->tile_rows + slot / t->tile_cols;
    int64_t col = (tile % across) * t->tile_cols + slot % t->tile_cols;
    return row * t->cols + col;
}

/* 1 when (a at slot sa) ranks above (b at slot sb): larger magnitude, NaN
 * above every number, the lower slot on a tie. */
static int ranks_above(float a, int64_t sa, float b, int64_t sb)
{
    int na = a != a, nb = b != b;
    if (na != nb) return na;
    if (!na) {
        float ma = a < 0 ? -a : a, mb = b < 0 ? -b : b;
        if (ma != mb) return ma > mb;
    }
    return sa < sb;
}

/* heap[0] is the lowest-ranked of the kept slots (a min-heap by rank). */
static void sift_down(uint16_t *heap, int64_t n, int64_t i, const float *tile)
{
    for (;;) {
        int64_t low = i, l = 2 * i + 1, r = l + 1;
        if (l < n && ranks_above(tile[heap[low]], heap[low], tile[heap[l]], heap[l])) low = l;
        if (r < n && ranks_above(tile[heap[low]], heap[low], tile[heap[r]], heap[r])) low = r;
        if (low == i) return;
        uint16_t tmp = heap[i];
        heap[i] = heap[low];
        heap[low] = tmp;
        i = low;
    }
}

static int by_slot(const void *a, const void *b)
{
    return (int)*(const uint16_t *)a - (int)*(const uint16_t *)b;
}

int mpidp_ef_topk(const float *tiles, int64_t ntiles, int64_t len, int64_t k, uint16_t *slots,
                  float *values)
{
    if ((ntiles > 0 && (tiles == NULL || slots == NULL || values == NULL)) || ntiles < 0)
        return mpidp__fail(MPIDP_EINVAL, "topk: NULL argument");
    if (len < 1 || len > 65536 || k < 1 || k > len)
        return mpidp__fail(MPIDP_EINVAL, "topk: expected 1 <= k <= tile length <= 65536, got "
                           "k %lld of %lld", (long long)k, (long long)len);
    for (int64_t t = 0; t < ntiles; t++) {
        const float *tile = tiles + t * len;
        uint16_t *heap = slots + t * k;
        for (int64_t s = 0; s < k; s++) heap[s] = (uint16_t)s;
        for (int64_t i = k / 2; i-- > 0;) sift_down(heap, k, i, tile);
        /* Slots come in increasing order, so a later one never wins a tie. */
        for (int64_t s = k; s < len; s++) {
            if (ranks_above(tile[s], s, tile[heap[0]], heap[0])) {
                heap[0] = (uint16_t)s;
                sift_down(heap, k, 0, tile);
            }
        }
        qsort(heap, (size_t)k, sizeof *heap, by_slot);
        for (int64_t s = 0; s < k; s++) values[t * k + s] = tile[heap[s]];
    }
    return MPIDP_OK;
}
