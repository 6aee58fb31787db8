/* libFuzzer harness: the readers of gathered error-feedback payloads
 * (mpidp_ef_sparse_mean, mpidp_ef_demo_decode), whose bytes come from other
 * ranks over the wire.
 *
 * The input picks a tensor shape, a tile side, k, the quantizer's bins, the
 * number of ranks and the mean's flags; the rest of it is the ranks'
 * payloads (zero-filled when short). The harness decodes the payloads on
 * its own, from the layout in mpidp/efcomp.h, and checks the library's
 * answer against that:
 *   - never a crash, an out-of-bounds access or UB (ASan/UBSan);
 *   - refusal (MPIDP_EINVAL with a detail) exactly when some payload breaks
 *     the layout: a slot outside its tile, slots not increasing within a
 *     tile, a code outside the bins (k = the tile's length: dense, no
 *     slots);
 *   - on success, the same bits as the reference's sum in rank order and
 *     its division (any NaN for a NaN: which operand's payload a sum of two
 *     NaNs keeps is the compiler's choice).
 *
 * Input layout: u8 rows-1 (% 24), u8 cols-1 (% 40), u8 chunk-1 (% 12),
 * u8 k selector, u8 bins selector (0: plain, else 2 + b % 15), u8 R-1 (% 4),
 * u8 flags (bit 0 divide by all, bit 1 tile-major, bit 2 DeMo's decode),
 * then the payload bytes. */
#include "mpidp/efcomp.h"
#include "mpidp/status.h"

#include "fuzz_common.h"

/* The reference: 1 and the mean in ref, or 0 for a payload that breaks the layout. */
static int reference(const mpidp_ef_tiling_t *t, const uint8_t *g, size_t stride, int R,
                     int64_t k, int bins, int all, int tile_major, float *ref)
{
    int64_t ntiles = mpidp_ef_ntiles(t), len = mpidp_ef_tile_len(t), n = ntiles * k,
            numel = t->rows * t->cols;
    int bits = bins ? mpidp_ef_code_bits(bins) : 0;
    unsigned *count = calloc((size_t)numel, sizeof *count);
    memset(ref, 0, (size_t)numel * sizeof *ref);
    int ok = 1;
    for (int r = 0; r < R && ok; r++) {
        const uint8_t *p = g + (size_t)r * stride;
        float mu = 0, lookup[256];
        size_t head = bins ? 4u * (size_t)(1 + bins) : 0;
        if (bins) memcpy(&mu, p, 4), memcpy(lookup, p + 4, 4u * (size_t)bins);
        int dense = k == len; /* every slot in order, none in the payload */
        const uint8_t *slots = p + head, *rest = slots + (dense ? 0 : 2 * n);
        for (int64_t i = 0; i < n && ok; i++) {
            int64_t tile = i / k;
            uint16_t s = (uint16_t)(i % k);
            if (!dense) {
                s = (uint16_t)(slots[2 * i] | slots[2 * i + 1] << 8);
                if (s >= len) ok = 0;
                if (i % k && s <= (uint16_t)(slots[2 * i - 2] | slots[2 * i - 1] << 8)) ok = 0;
            }
            if (!ok) break;
            float v;
            if (bins) {
                int64_t bit = i * bits;
                unsigned q = (rest[bit / 8] >> (bit % 8)) & ((1u << bits) - 1);
                if ((int)q >= bins) { ok = 0; break; }
                v = lookup[q] + mu;
            } else {
                memcpy(&v, rest + 4 * i, 4);
            }
            int64_t at = tile_major ? tile * len + s : mpidp_ef_index(t, tile, s);
            ref[at] += v;
            count[at]++;
        }
    }
    for (int64_t i = 0; ok && i < numel; i++) {
        if (all) ref[i] /= (float)R;
        else if (count[i] > 1) ref[i] /= (float)count[i];
    }
    free(count);
    return ok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_t f = {data, size};
    int64_t sizes[2] = {1 + fz_u8(&f) % 24, 1 + fz_u8(&f) % 40};
    int64_t chunk = 1 + fz_u8(&f) % 12;
    uint8_t ksel = fz_u8(&f), bsel = fz_u8(&f);
    int R = 1 + fz_u8(&f) % 4;
    uint8_t flags = fz_u8(&f);
    mpidp_ef_tiling_t t;
    FZ_CHECK(mpidp_ef_tiling(2, sizes, chunk, &t) == MPIDP_OK, "tiling of %lld x %lld",
             (long long)sizes[0], (long long)sizes[1]);
    int64_t len = mpidp_ef_tile_len(&t), k = 1 + ksel % len, numel = t.rows * t.cols;
    int demo = flags & 4, bins = (demo || bsel == 0) ? 0 : 2 + bsel % 15;
    int all = demo ? 0 : flags & 1, tile_major = demo ? 1 : (flags >> 1) & 1;
    size_t stride = (size_t)mpidp_ef_payload_bytes(mpidp_ef_ntiles(&t), len, k, bins);
    uint8_t *g = calloc((size_t)R * stride + 1, 1);
    memcpy(g, f.p, f.n < (size_t)R * stride ? f.n : (size_t)R * stride);
    float *out = malloc((size_t)numel * sizeof *out), *ref = malloc((size_t)numel * sizeof *ref);
    int ok = reference(&t, g, stride, R, k, bins, all, tile_major, ref);
    int rc;
    if (demo) {
        float *fr = malloc((size_t)(t.tile_rows * t.tile_rows) * sizeof *fr);
        float *fc = malloc((size_t)(t.tile_cols * t.tile_cols) * sizeof *fc);
        mpidp_ef_dct_basis(t.tile_rows, fr), mpidp_ef_dct_basis(t.tile_cols, fc);
        rc = mpidp_ef_demo_decode(&t, g, stride, R, k, fr, fc, out);
        if (ok && rc == MPIDP_OK) { /* the reference's mean, transformed the same way */
            mpidp_ef_dct_tiles(ref, mpidp_ef_ntiles(&t), t.tile_rows, t.tile_cols, fr, fc, 1);
            float *laid = malloc((size_t)numel * sizeof *laid);
            for (int64_t tile = 0; tile < mpidp_ef_ntiles(&t); tile++)
                for (int64_t s = 0; s < len; s++) laid[mpidp_ef_index(&t, tile, s)] = ref[tile * len + s];
            memcpy(ref, laid, (size_t)numel * sizeof *ref);
            free(laid);
        }
        free(fr), free(fc);
    } else {
        rc = mpidp_ef_sparse_mean(&t, g, stride, R, k, bins, all, tile_major, out);
    }
    FZ_CHECK(ok ? rc == MPIDP_OK : rc == MPIDP_EINVAL, "reference %s, library %d",
             ok ? "accepts" : "refuses", rc);
    if (rc != MPIDP_OK) FZ_CHECK(mpidp_error_detail()[0] != '\0', "refused without a detail");
    else /* NaN payloads depend on operand order, which the compiler may swap */
        for (int64_t i = 0; i < numel; i++)
            FZ_CHECK((out[i] != out[i] && ref[i] != ref[i]) ||
                         memcmp(out + i, ref + i, sizeof *out) == 0,
                     "sums differ at %lld: %a vs %a", (long long)i, out[i], ref[i]);
    free(g), free(out), free(ref);
    return 0;
}
