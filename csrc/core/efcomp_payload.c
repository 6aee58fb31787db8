/* Error-feedback compression: SparseLoCo's compression of a tensor into its
 * payload and the checked sparse mean of gathered payloads
 * (mpidp/efcomp.h). Payload fields are copied with memcpy: they sit at any
 * byte offset of a bucket. */
#include <stdlib.h>
#include <string.h>

#include "efcomp_internal.h"
#include "fail.h"
#include "mpidp/efcomp.h"
#include "mpidp/status.h"

void mpidp__ef_tile_load(const mpidp_ef_tiling_t *t, const float *tensor, int64_t tile,
                         float *buf)
{
    for (int64_t i = 0; i < t->tile_rows; i++)
        memcpy(buf + i * t->tile_cols, tensor + mpidp_ef_index(t, tile, i * t->tile_cols),
               (size_t)t->tile_cols * sizeof *buf);
}

void mpidp__ef_tile_store(const mpidp_ef_tiling_t *t, float *tensor, int64_t tile,
                          const float *buf)
{
    for (int64_t i = 0; i < t->tile_rows; i++)
        memcpy(tensor + mpidp_ef_index(t, tile, i * t->tile_cols), buf + i * t->tile_cols,
               (size_t)t->tile_cols * sizeof *buf);
}

int64_t mpidp_ef_payload_bytes(int64_t ntiles, int64_t len, int64_t k, int bins)
{
    if (ntiles < 0 || k < 1 || k > len || (bins != 0 && (bins < 2 || bins > MPIDP_EF_MAX_BINS)))
        return -1;
    int64_t n = ntiles * k;
    int64_t slots = k == len ? 0 : n * (int64_t)sizeof(uint16_t); /* dense: implicit */
    if (bins == 0) return slots + n * (int64_t)sizeof(float);
    return (int64_t)sizeof(float) * (1 + bins) + slots + (n * mpidp_ef_code_bits(bins) + 7) / 8;
}

static int check_tiling(const mpidp_ef_tiling_t *t, int64_t k, int bins, const char *who)
{
    if (t == NULL || t->tile_rows < 1 || t->tile_cols < 1 || t->rows % t->tile_rows ||
        t->cols % t->tile_cols || t->tile_rows > MPIDP_EF_MAX_CHUNK ||
        t->tile_cols > MPIDP_EF_MAX_CHUNK)
        return mpidp__fail(MPIDP_EINVAL, "%s: not a tiling of the tensor", who);
    if (k < 1 || k > mpidp_ef_tile_len(t))
        return mpidp__fail(MPIDP_EINVAL, "%s: k must be 1 .. %lld (the tile's length), got %lld",
                           who, (long long)mpidp_ef_tile_len(t), (long long)k);
    if (bins != 0 && (bins < 2 || bins > MPIDP_EF_MAX_BINS))
        return mpidp__fail(MPIDP_EINVAL, "%s: bins must be 0 (no quantizer) or 2 .. %d, got %d",
                           who, MPIDP_EF_MAX_BINS, bins);
    return MPIDP_OK;
}

/* The kept entries of every tile, their slots and values, and a tile buffer. */
typedef struct {
    uint16_t *slots;
    float *values, *tile;
    uint8_t *codes;
} kept_t;

static int kept_alloc(kept_t *s, int64_t n, int64_t len)
{
    s->slots = malloc((size_t)n * sizeof *s->slots + 1);
    s->values = malloc((size_t)(n + 2 * len) * sizeof *s->values);
    s->codes = malloc((size_t)n + 1);
    s->tile = s->values ? s->values + n : NULL;
    if (s->slots && s->values && s->codes) return MPIDP_OK;
    free(s->slots), free(s->values), free(s->codes);
    return mpidp__fail(MPIDP_ENOMEM, "no memory for %lld kept entries", (long long)n);
}

static void kept_free(kept_t *s) { free(s->slots), free(s->values), free(s->codes); }

/* The slots of n kept entries (none where the tiles are dense); returns
 * where the next field starts. */
static uint8_t *write_slots(uint8_t *payload, const kept_t *s, int64_t n, int dense)
{
    if (dense) return payload;
    memcpy(payload, s->slots, (size_t)n * sizeof *s->slots);
    return payload + n * sizeof *s->slots;
}

int mpidp_ef_compress(const mpidp_ef_tiling_t *t, float *e, const float *delta, float beta,
                      float alpha, int64_t k, int bins, double range, uint8_t *payload)
{
    int rc = check_tiling(t, k, bins, "compress");
    if (rc != MPIDP_OK) return rc;
    if (e == NULL || payload == NULL) return mpidp__fail(MPIDP_EINVAL, "compress: NULL argument");
    int64_t ntiles = mpidp_ef_ntiles(t), len = mpidp_ef_tile_len(t), n = ntiles * k;
    int dense = k == len;
    kept_t s;
    if ((rc = kept_alloc(&s, n, len)) != MPIDP_OK) return rc;
    for (int64_t tile = 0; tile < ntiles; tile++) {
        mpidp__ef_tile_load(t, e, tile, s.tile);
        if (delta != NULL) {
            float *d = s.tile + len;
            mpidp__ef_tile_load(t, delta, tile, d);
            for (int64_t i = 0; i < len; i++) s.tile[i] = beta * s.tile[i] + alpha * d[i];
        } else {
            for (int64_t i = 0; i < len; i++) s.tile[i] = beta * s.tile[i];
        }
        mpidp__ef_tile_store(t, e, tile, s.tile);
        if ((rc = mpidp_ef_topk(s.tile, 1, len, k, s.slots + tile * k, s.values + tile * k)))
            goto out;
    }
    float mu = 0.0f, lookup[MPIDP_EF_MAX_BINS];
    if (bins > 0) {
        if ((rc = mpidp_ef_quantize(s.values, n, bins, range, s.codes, &mu, lookup))) goto out;
        for (int64_t i = 0; i < n; i++) s.values[i] = lookup[s.codes[i]] + mu;
    }
    /* e keeps what the payload does not carry: the entries left out and the
     * quantizer's error on the kept ones. */
    for (int64_t i = 0; i < n; i++) e[mpidp_ef_index(t, i / k, s.slots[i])] -= s.values[i];
    if (bins == 0) {
        uint8_t *p = write_slots(payload, &s, n, dense);
        memcpy(p, s.values, (size_t)n * sizeof *s.values);
    } else {
        memcpy(payload, &mu, sizeof mu);
        memcpy(payload + sizeof mu, lookup, (size_t)bins * sizeof *lookup);
        uint8_t *p = write_slots(payload + sizeof(float) * (size_t)(1 + bins), &s, n, dense);
        mpidp_ef_pack_codes(s.codes, n, mpidp_ef_code_bits(bins), p);
    }
out:
    kept_free(&s);
    return rc;
}

/* Adds one rank's payload into sum and count (count NULL: not counted). */
static int add_payload(const mpidp_ef_tiling_t *t, const uint8_t *p, int rank, int64_t k,
                       int bins, int tile_major, float *sum, uint32_t *count, uint8_t *codes)
{
    int64_t ntiles = mpidp_ef_ntiles(t), len = mpidp_ef_tile_len(t), n = ntiles * k;
    int dense = k == len;      /* every slot, in order: none travels */
    size_t slot_bytes = dense ? 0 : (size_t)n * sizeof(uint16_t);
    float mu = 0.0f, lookup[MPIDP_EF_MAX_BINS];
    const uint8_t *slots = p, *values = p + slot_bytes;
    if (bins > 0) {
        memcpy(&mu, p, sizeof mu);
        memcpy(lookup, p + sizeof mu, (size_t)bins * sizeof *lookup);
        slots = p + sizeof(float) * (size_t)(1 + bins);
        if (mpidp_ef_unpack_codes(slots + slot_bytes, n, mpidp_ef_code_bits(bins), bins,
                                  codes) != MPIDP_OK)
            return mpidp__fail(MPIDP_EINVAL, "payload of rank %d: a code is outside the %d bins",
                               rank, bins);
    }
    for (int64_t tile = 0; tile < ntiles; tile++) {
        int64_t prev = -1;
        for (int64_t s = 0; s < k; s++) {
            int64_t i = tile * k + s;
            uint16_t slot = (uint16_t)s;
            if (!dense) memcpy(&slot, slots + i * sizeof slot, sizeof slot);
            if (slot >= len || (int64_t)slot <= prev)
                return mpidp__fail(MPIDP_EINVAL, "payload of rank %d: tile %lld has slot %u "
                                   "after %lld (slots must increase and stay below %lld)", rank,
                                   (long long)tile, (unsigned)slot, (long long)prev,
                                   (long long)len);
            prev = slot;
            float v;
            if (bins > 0) v = lookup[codes[i]] + mu;
            else memcpy(&v, values + i * sizeof v, sizeof v);
            int64_t at = tile_major ? tile * len + slot : mpidp_ef_index(t, tile, slot);
            sum[at] += v;
            if (count) count[at]++;
        }
    }
    return MPIDP_OK;
}

int mpidp_ef_sparse_mean(const mpidp_ef_tiling_t *t, const uint8_t *gathered, size_t stride,
                         int R, int64_t k, int bins, int divide_by_all, int tile_major,
                         float *out)
{
    int rc = check_tiling(t, k, bins, "sparse mean");
    if (rc != MPIDP_OK) return rc;
    if (R < 1 || gathered == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "sparse mean: expected R >= 1 and buffers");
    if ((int64_t)stride < mpidp_ef_payload_bytes(mpidp_ef_ntiles(t), mpidp_ef_tile_len(t), k, bins))
        return mpidp__fail(MPIDP_EINVAL, "sparse mean: stride %zu is shorter than a payload",
                           stride);
    int64_t numel = t->rows * t->cols, n = mpidp_ef_ntiles(t) * k;
    uint32_t *count = divide_by_all ? NULL : calloc((size_t)numel, sizeof *count);
    uint8_t *codes = malloc((size_t)n + 1);
    if ((!divide_by_all && count == NULL) || codes == NULL) {
        free(count), free(codes);
        return mpidp__fail(MPIDP_ENOMEM, "sparse mean: no memory");
    }
    memset(out, 0, (size_t)numel * sizeof *out);
    for (int r = 0; r < R && rc == MPIDP_OK; r++)
        rc = add_payload(t, gathered + (size_t)r * stride, r, k, bins, tile_major, out, count,
                         codes);
    if (rc == MPIDP_OK) {
        for (int64_t i = 0; i < numel; i++)
            if (divide_by_all) out[i] /= (float)R;
            else if (count[i] > 1) out[i] /= (float)count[i];
    }
    free(count), free(codes);
    return rc;
}
