/* Error-feedback compression kernels (mpidp/efcomp.h) against plain
 * references written from the rules in docs/error-feedback.md. */
#include "mpidp/efcomp.h"
#include "mpidp/status.h"

#include "test.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double uniform(void) /* in [-1, 1) */
{
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / (double)(1ull << 52) - 1.0;
}

TEST(tile_side_is_the_largest_divisor_up_to_chunk)
{
    static const int64_t n[] = {2048, 1536, 5440, 32000, 50304, 50280, 50257, 100, 97, 64, 10, 1};
    static const int64_t s[] = {64, 64, 64, 64, 64, 60, 29, 50, 1, 64, 10, 1};
    for (size_t i = 0; i < sizeof n / sizeof *n; i++) ASSERT_EQ_INT(mpidp_ef_tile_side(n[i], 64), s[i]);
}

TEST(tiling_views_tensors_as_rows_by_cols)
{
    mpidp_ef_tiling_t t;
    ASSERT_EQ_INT(mpidp_ef_tiling(0, NULL, 64, &t), MPIDP_OK);
    ASSERT_TRUE(t.rows == 1 && t.cols == 1 && t.tile_rows == 1 && t.tile_cols == 1);
    int64_t one[] = {100};
    ASSERT_EQ_INT(mpidp_ef_tiling(1, one, 64, &t), MPIDP_OK);
    ASSERT_TRUE(t.rows == 1 && t.cols == 100 && t.tile_rows == 1 && t.tile_cols == 50);
    int64_t three[] = {6, 4, 32};
    ASSERT_EQ_INT(mpidp_ef_tiling(3, three, 64, &t), MPIDP_OK);
    ASSERT_TRUE(t.rows == 6 && t.cols == 128 && t.tile_rows == 6 && t.tile_cols == 64);
    ASSERT_EQ_INT(mpidp_ef_ntiles(&t), 2);
    int64_t bad[] = {3, 0};
    ASSERT_EQ_INT(mpidp_ef_tiling(2, bad, 64, &t), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_ef_tiling(1, one, 257, &t), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_ef_tiling(1, one, 0, &t), MPIDP_EINVAL);
}

TEST(index_maps_every_slot_of_every_tile_once)
{
    int64_t sizes[] = {12, 20};
    mpidp_ef_tiling_t t;
    ASSERT_EQ_INT(mpidp_ef_tiling(2, sizes, 5, &t), MPIDP_OK); /* tiles 4 x 5 */
    ASSERT_TRUE(t.tile_rows == 4 && t.tile_cols == 5);
    int seen[240] = {0};
    for (int64_t tile = 0; tile < mpidp_ef_ntiles(&t); tile++)
        for (int64_t s = 0; s < mpidp_ef_tile_len(&t); s++) {
            int64_t at = mpidp_ef_index(&t, tile, s);
            int64_t row = (tile / 4) * 4 + s / 5, col = (tile % 4) * 5 + s % 5;
            ASSERT_EQ_INT(at, row * 20 + col);
            seen[at]++;
        }
    for (int i = 0; i < 240; i++) ASSERT_EQ_INT(seen[i], 1);
}

/* Reference rank order: magnitude, NaN first, then the lower slot. */
static int ref_above(float a, int sa, float b, int sb)
{
    if (isnan(a) != isnan(b)) return isnan(a);
    if (!isnan(a) && fabsf(a) != fabsf(b)) return fabsf(a) > fabsf(b);
    return sa < sb;
}

TEST(topk_keeps_the_largest_magnitudes_lower_slot_on_ties)
{
    enum { L = 37, TILES = 3 };
    float tiles[TILES * L];
    for (int round = 0; round < 200; round++) {
        for (int i = 0; i < TILES * L; i++) {
            /* few distinct magnitudes: many ties, both signs, some NaN */
            tiles[i] = (float)((int)(uniform() * 4)) * (uniform() < 0 ? -1.0f : 1.0f);
            if (uniform() > 0.95) tiles[i] = NAN;
        }
        int64_t k = 1 + round % L;
        uint16_t slots[TILES * L];
        float values[TILES * L];
        ASSERT_EQ_INT(mpidp_ef_topk(tiles, TILES, L, k, slots, values), MPIDP_OK);
        for (int t = 0; t < TILES; t++) {
            const float *tile = tiles + t * L;
            int kept[L] = {0};
            for (int64_t j = 0; j < k; j++) {
                int s = slots[t * k + j];
                ASSERT_TRUE(j == 0 || s > slots[t * k + j - 1]);
                ASSERT_TRUE(memcmp(&values[t * k + j], &tile[s], sizeof(float)) == 0);
                kept[s] = 1;
            }
            /* every kept slot ranks above every slot left out */
            for (int a = 0; a < L; a++)
                for (int b = 0; b < L; b++)
                    if (kept[a] && !kept[b]) ASSERT_TRUE(ref_above(tile[a], a, tile[b], b));
        }
    }
    ASSERT_EQ_INT(mpidp_ef_topk(tiles, 1, L, 0, NULL, NULL), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_ef_topk(tiles, 1, L, L + 1, NULL, NULL), MPIDP_EINVAL);
}

/* The quantizer's rule, written out step by step. */
static void ref_quantize(const float *v, int n, int bins, double range, uint8_t *codes,
                         float *mu, float *lookup)
{
    double sum = 0;
    for (int i = 0; i < n; i++) sum += v[i];
    *mu = n ? (float)(sum / n) : 0.0f;
    double sq = 0;
    for (int i = 0; i < n; i++) sq += (double)(v[i] - *mu) * (double)(v[i] - *mu);
    double sigma = n > 1 ? sqrt(sq / (n - 1)) : 0, step = range * sigma / bins;
    if (!(step > 0) || !isfinite(step)) step = 1;
    double bsum[256] = {0};
    int cnt[256] = {0};
    for (int i = 0; i < n; i++) {
        float c = v[i] - *mu;
        double x = nearbyint((double)c / step + bins / 2.0);
        int q = x < 0 ? 0 : x > bins - 1 ? bins - 1 : (int)x;
        codes[i] = (uint8_t)q, bsum[q] += c, cnt[q]++;
    }
    for (int b = 0; b < bins; b++) lookup[b] = cnt[b] ? (float)(bsum[b] / cnt[b]) : 0.0f;
}

TEST(quantizer_follows_the_rule)
{
    enum { N = 500 };
    float v[N], mu, ref_mu, lookup[256], ref_lookup[256];
    uint8_t codes[N], ref_codes[N];
    static const int bins[] = {2, 3, 4, 16, 256};
    for (size_t b = 0; b < sizeof bins / sizeof *bins; b++) {
        for (int i = 0; i < N; i++) v[i] = (float)(uniform() * 3 + 0.25);
        ASSERT_EQ_INT(mpidp_ef_quantize(v, N, bins[b], 6.0, codes, &mu, lookup), MPIDP_OK);
        ref_quantize(v, N, bins[b], 6.0, ref_codes, &ref_mu, ref_lookup);
        ASSERT_TRUE(memcmp(&mu, &ref_mu, sizeof mu) == 0);
        ASSERT_TRUE(memcmp(codes, ref_codes, N) == 0);
        ASSERT_TRUE(memcmp(lookup, ref_lookup, (size_t)bins[b] * sizeof(float)) == 0);
        for (int i = 0; i < N; i++) ASSERT_TRUE(codes[i] < bins[b]);
    }
}

TEST(quantizer_rounds_half_to_even_and_survives_constant_input)
{
    /* mean 0, sigma 2, step 6 * 2 / 4 = 3: 3 -> 1 + 2 = 3; -1 -> -1/3 + 2 = 1.67 -> 2 */
    float v[4] = {3, -1, -1, -1}, mu, lookup[8];
    uint8_t codes[4];
    ASSERT_EQ_INT(mpidp_ef_quantize(v, 4, 4, 6.0, codes, &mu, lookup), MPIDP_OK);
    ASSERT_TRUE(codes[0] == 3 && codes[1] == 2 && codes[2] == 2 && codes[3] == 2);
    ASSERT_TRUE(mu == 0 && lookup[3] == 3 && lookup[2] == -1 && lookup[0] == 0);
    /* exact halves: {1, -1, 0} has mean 0 and sigma 1; range 8 over 4 bins makes
     * step 2, so 1 -> 2.5 and -1 -> 1.5, both to the even 2 (half up gives 3) */
    float h[3] = {1, -1, 0};
    uint8_t hc[3];
    ASSERT_EQ_INT(mpidp_ef_quantize(h, 3, 4, 8.0, hc, &mu, lookup), MPIDP_OK);
    ASSERT_TRUE(hc[0] == 2 && hc[1] == 2 && hc[2] == 2);
    ASSERT_EQ_INT(mpidp_ef_quantize(h, 3, 8, 16.0, hc, &mu, lookup), MPIDP_OK); /* 4.5, 3.5 */
    ASSERT_TRUE(hc[0] == 4 && hc[1] == 4 && hc[2] == 4);
    float same[5] = {3, 3, 3, 3, 3};
    uint8_t c5[5];
    ASSERT_EQ_INT(mpidp_ef_quantize(same, 5, 4, 6.0, c5, &mu, lookup), MPIDP_OK);
    ASSERT_NEAR(lookup[c5[0]] + mu, 3.0, 0);
    ASSERT_EQ_INT(mpidp_ef_quantize(same, 5, 1, 6.0, c5, &mu, lookup), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_ef_quantize(same, 5, 4, 0.0, c5, &mu, lookup), MPIDP_EINVAL);
}

TEST(code_packing_round_trips_every_code)
{
    static const int bits[] = {1, 2, 4, 8};
    for (int b = 0; b < 4; b++) {
        int n = 1000, bins = 1 << bits[b];
        uint8_t codes[1000], back[1000], packed[1000];
        for (int i = 0; i < n; i++) codes[i] = (uint8_t)(i * 7919 % bins);
        for (int m = 0; m <= 9; m++) { /* lengths that end mid-byte */
            mpidp_ef_pack_codes(codes, m, bits[b], packed);
            ASSERT_EQ_INT(mpidp_ef_unpack_codes(packed, m, bits[b], bins, back), MPIDP_OK);
            ASSERT_TRUE(memcmp(codes, back, (size_t)m) == 0);
            if ((m * bits[b]) % 8) /* unused high bits are 0 */
                ASSERT_EQ_INT(packed[m * bits[b] / 8] >> ((m * bits[b]) % 8), 0);
        }
        mpidp_ef_pack_codes(codes, n, bits[b], packed);
        ASSERT_EQ_INT(mpidp_ef_unpack_codes(packed, n, bits[b], bins, back), MPIDP_OK);
        ASSERT_TRUE(memcmp(codes, back, (size_t)n) == 0);
    }
    uint8_t three = 3, packed, back;
    mpidp_ef_pack_codes(&three, 1, 2, &packed);
    ASSERT_EQ_INT(packed, 3);
    ASSERT_EQ_INT(mpidp_ef_unpack_codes(&packed, 1, 2, 3, &back), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_ef_code_bits(4), 2);
    ASSERT_EQ_INT(mpidp_ef_code_bits(5), 4);
    ASSERT_EQ_INT(mpidp_ef_code_bits(256), 8);
}

TEST(payload_bytes_follow_the_layout)
{
    ASSERT_EQ_INT(mpidp_ef_payload_bytes(4, 4096, 128, 4), 4 * 5 + 4 * 128 * 2 + 4 * 128 / 4);
    ASSERT_EQ_INT(mpidp_ef_payload_bytes(3, 24, 5, 4), 20 + 30 + 4); /* 15 codes: 30 bits */
    ASSERT_EQ_INT(mpidp_ef_payload_bytes(4, 4096, 32, 0), 4 * 32 * 6);
    /* dense (k = the tile's length): no slots */
    ASSERT_EQ_INT(mpidp_ef_payload_bytes(4, 128, 128, 4), 4 * 5 + 4 * 128 / 4);
    ASSERT_EQ_INT(mpidp_ef_payload_bytes(4, 32, 32, 0), 4 * 32 * 4);
    ASSERT_EQ_INT(mpidp_ef_payload_bytes(4, 8, 0, 0), -1);
    ASSERT_EQ_INT(mpidp_ef_payload_bytes(4, 8, 9, 0), -1);
    ASSERT_EQ_INT(mpidp_ef_payload_bytes(4, 8, 1, 1), -1);
}

TEST(dct_basis_is_orthonormal_and_transforms_round_trip)
{
    static const int64_t sides[] = {1, 2, 7, 64};
    for (int si = 0; si < 4; si++) {
        int64_t s = sides[si];
        float *f = malloc((size_t)(s * s) * sizeof *f);
        ASSERT_EQ_INT(mpidp_ef_dct_basis(s, f), MPIDP_OK);
        for (int64_t a = 0; a < s; a++)
            for (int64_t b = 0; b < s; b++) {
                double dot = 0;
                for (int64_t j = 0; j < s; j++) dot += (double)f[j * s + a] * f[j * s + b];
                ASSERT_NEAR(dot, a == b, 1e-6);
            }
        free(f);
    }
    /* 2 tiles of 3 x 4: forward equals the double-precision formula; back is the input */
    float fr[9], fc[16], tiles[24], orig[24];
    mpidp_ef_dct_basis(3, fr), mpidp_ef_dct_basis(4, fc);
    for (int i = 0; i < 24; i++) orig[i] = tiles[i] = (float)uniform();
    ASSERT_EQ_INT(mpidp_ef_dct_tiles(tiles, 2, 3, 4, fr, fc, 0), MPIDP_OK);
    const double pi = 3.14159265358979323846;
    for (int t = 0; t < 2; t++)
        for (int a = 0; a < 3; a++)
            for (int b = 0; b < 4; b++) {
                double x = 0;
                for (int i = 0; i < 3; i++)
                    for (int j = 0; j < 4; j++)
                        x += orig[t * 12 + i * 4 + j] * (a ? sqrt(2 / 3.0) : sqrt(1 / 3.0)) *
                             cos(pi * (2 * i + 1) * a / 6.0) * (b ? sqrt(2 / 4.0) : sqrt(1 / 4.0)) *
                             cos(pi * (2 * j + 1) * b / 8.0);
                ASSERT_NEAR(tiles[t * 12 + a * 4 + b], x, 1e-6);
            }
    ASSERT_EQ_INT(mpidp_ef_dct_tiles(tiles, 2, 3, 4, fr, fc, 1), MPIDP_OK);
    for (int i = 0; i < 24; i++) ASSERT_NEAR(tiles[i], orig[i], 1e-6);
}

/* out = A B with every element summed from 0 in order of the inner index,
 * one rounding per multiply and per add: the order the kernels promise on
 * every build (their AVX2 clone included). */
static void ordered_product(const float *a, int sp, int si, int m, int r, const float *b, int n,
                            float *out)
{
    for (int p = 0; p < m; p++)
        for (int j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int i = 0; i < r; i++) {
                float prod = a[p * sp + i * si] * b[i * n + j];
                acc = acc + prod;
            }
            out[p * n + j] = acc;
        }
}

TEST(dct_gives_the_bits_of_the_ordered_scalar_products)
{
    static const int sides[][2] = {{64, 64}, {5, 48}, {1, 64}, {64, 7}};
    for (int c = 0; c < 4; c++) {
        int r = sides[c][0], n = sides[c][1], len = r * n;
        float *fr = malloc(sizeof(float) * (size_t)(r * r)), *fc = malloc(sizeof(float) * (size_t)(n * n));
        float *tile = malloc(sizeof(float) * (size_t)len), *work = malloc(sizeof(float) * (size_t)len);
        float *ref = malloc(sizeof(float) * (size_t)len), *fct = malloc(sizeof(float) * (size_t)(n * n));
        mpidp_ef_dct_basis(r, fr), mpidp_ef_dct_basis(n, fc);
        for (int i = 0; i < len; i++) tile[i] = ref[i] = (float)uniform();
        ASSERT_EQ_INT(mpidp_ef_dct_tiles(tile, 1, r, n, fr, fc, 0), MPIDP_OK);
        ordered_product(ref, n, 1, r, n, fc, n, work);        /* T Fc */
        ordered_product(fr, 1, r, r, r, work, n, ref);        /* Fr^T (T Fc) */
        ASSERT_TRUE(memcmp(tile, ref, sizeof(float) * (size_t)len) == 0);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) fct[j * n + i] = fc[i * n + j];
        ASSERT_EQ_INT(mpidp_ef_dct_tiles(tile, 1, r, n, fr, fc, 1), MPIDP_OK);
        ordered_product(ref, n, 1, r, n, fct, n, work);       /* X Fc^T */
        ordered_product(fr, r, 1, r, r, work, n, ref);        /* Fr (X Fc^T) */
        ASSERT_TRUE(memcmp(tile, ref, sizeof(float) * (size_t)len) == 0);
        free(fr), free(fc), free(tile), free(work), free(ref), free(fct);
    }
}

/* A 2-D tensor of 8 x 12 cut into tiles of 4 x 6 (L 24). */
static mpidp_ef_tiling_t small_tiling(void)
{
    mpidp_ef_tiling_t t;
    int64_t sizes[] = {8, 12};
    mpidp_ef_tiling(2, sizes, 6, &t);
    return t;
}

TEST(compress_keeps_every_error_in_the_buffer)
{
    mpidp_ef_tiling_t t = small_tiling();
    enum { N = 96 };
    static const int bins[] = {0, 4};
    static const int64_t ks[] = {1, 8, 15, 22, 24}; /* 24: dense */
    for (int b = 0; b < 2; b++)
        for (int ki = 0; ki < 5; ki++) {
            int64_t k = ks[ki];
            float e[N], d[N], updated[N], sent[N];
            uint8_t payload[1024];
            for (int i = 0; i < N; i++) e[i] = (float)uniform(), d[i] = (float)uniform();
            for (int i = 0; i < N; i++) updated[i] = 0.9f * e[i] + 0.5f * d[i];
            ASSERT_EQ_INT(mpidp_ef_compress(&t, e, d, 0.9f, 0.5f, k, bins[b], 6.0, payload), MPIDP_OK);
            /* one rank's payload decodes to exactly what it sent */
            ASSERT_EQ_INT(mpidp_ef_sparse_mean(&t, payload, 1024, 1, k, bins[b], 0, 0, sent), MPIDP_OK);
            int nonzero = 0;
            for (int i = 0; i < N; i++) {
                ASSERT_NEAR(e[i] + sent[i], updated[i], 1e-6);
                if (bins[b] == 0) ASSERT_TRUE(sent[i] == 0.0f || e[i] == 0.0f);
                nonzero += sent[i] != 0.0f;
            }
            ASSERT_EQ_INT(nonzero, 4 * k); /* 4 tiles of k */
        }
}

TEST(sparse_mean_divides_by_the_ranks_that_chose)
{
    mpidp_ef_tiling_t t = small_tiling();
    enum { N = 96 };
    int64_t k = 2;
    int64_t bytes = mpidp_ef_payload_bytes(4, 24, k, 0);
    uint8_t gathered[3 * 48];
    ASSERT_EQ_INT(bytes, 48);
    /* rank r keeps, in every tile, slot 0 (value r+1) and slot r+1 (value 10) */
    for (int r = 0; r < 3; r++) {
        float e[N] = {0};
        for (int tile = 0; tile < 4; tile++) {
            e[mpidp_ef_index(&t, tile, 0)] = (float)(r + 1) * 100;
            e[mpidp_ef_index(&t, tile, r + 1)] = 10;
        }
        ASSERT_EQ_INT(mpidp_ef_compress(&t, e, NULL, 1, 1, k, 0, 6.0, gathered + r * bytes), MPIDP_OK);
    }
    float out[N];
    ASSERT_EQ_INT(mpidp_ef_sparse_mean(&t, gathered, (size_t)bytes, 3, k, 0, 0, 0, out), MPIDP_OK);
    for (int tile = 0; tile < 4; tile++) {
        ASSERT_NEAR(out[mpidp_ef_index(&t, tile, 0)], 200, 0);  /* (100+200+300)/3 */
        for (int r = 0; r < 3; r++) ASSERT_NEAR(out[mpidp_ef_index(&t, tile, r + 1)], 10, 0);
        ASSERT_NEAR(out[mpidp_ef_index(&t, tile, 4)], 0, 0);
    }
    ASSERT_EQ_INT(mpidp_ef_sparse_mean(&t, gathered, (size_t)bytes, 3, k, 0, 1, 0, out), MPIDP_OK);
    ASSERT_NEAR(out[mpidp_ef_index(&t, 2, 1)], 10 / 3.0f, 1e-6);
    /* tile-major output */
    ASSERT_EQ_INT(mpidp_ef_sparse_mean(&t, gathered, (size_t)bytes, 3, k, 0, 0, 1, out), MPIDP_OK);
    ASSERT_NEAR(out[24 * 3 + 2], 10, 0);
}

TEST(sparse_mean_refuses_broken_payloads)
{
    mpidp_ef_tiling_t t = small_tiling();
    float e[96], out[96];
    for (int i = 0; i < 96; i++) e[i] = (float)uniform();
    int64_t k = 3, bytes = mpidp_ef_payload_bytes(4, 24, k, 4);
    uint8_t p[256];
    ASSERT_EQ_INT(mpidp_ef_compress(&t, e, NULL, 1, 1, k, 4, 6.0, p), MPIDP_OK);
    uint8_t bad[256];
    uint16_t slot;
    memcpy(bad, p, (size_t)bytes), slot = 24, memcpy(bad + 20, &slot, 2); /* outside the tile */
    ASSERT_EQ_INT(mpidp_ef_sparse_mean(&t, bad, (size_t)bytes, 1, k, 4, 0, 0, out), MPIDP_EINVAL);
    memcpy(bad, p, (size_t)bytes), memcpy(bad + 22, bad + 20, 2);         /* a repeat */
    ASSERT_EQ_INT(mpidp_ef_sparse_mean(&t, bad, (size_t)bytes, 1, k, 4, 0, 0, out), MPIDP_EINVAL);
    /* with 3 bins a code of 3 is outside them */
    memcpy(bad, p, (size_t)bytes), bad[bytes - 1] = 0xFF;
    ASSERT_EQ_INT(mpidp_ef_sparse_mean(&t, bad, (size_t)bytes, 1, k, 3, 0, 0, out), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_ef_sparse_mean(&t, p, (size_t)bytes - 1, 1, k, 4, 0, 0, out), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_ef_sparse_mean(&t, p, (size_t)bytes, 1, k, 4, 0, 0, out), MPIDP_OK);
}

TEST(demo_with_every_coefficient_sends_the_whole_momentum)
{
    mpidp_ef_tiling_t t = small_tiling();
    float fr[16], fc[36], delta[96], grad[96], expect[96], out[96];
    mpidp_ef_dct_basis(4, fr), mpidp_ef_dct_basis(6, fc);
    for (int i = 0; i < 96; i++) delta[i] = (float)uniform(), grad[i] = (float)uniform();
    for (int i = 0; i < 96; i++) expect[i] = 0.5f * delta[i] + 0.1f * grad[i];
    uint8_t payload[96 * 6];
    ASSERT_EQ_INT(mpidp_ef_demo_compress(&t, delta, grad, 0.5f, 0.1f, 24, fr, fc, payload), MPIDP_OK);
    ASSERT_EQ_INT(mpidp_ef_demo_decode(&t, payload, sizeof payload, 1, 24, fr, fc, out), MPIDP_OK);
    for (int i = 0; i < 96; i++) {
        ASSERT_NEAR(delta[i], 0, 1e-6);
        ASSERT_NEAR(out[i], expect[i], 1e-6);
    }
}

TEST(demo_keeps_what_it_does_not_send)
{
    mpidp_ef_tiling_t t = small_tiling();
    float fr[16], fc[36], delta[96], before[96], out[96];
    mpidp_ef_dct_basis(4, fr), mpidp_ef_dct_basis(6, fc);
    for (int i = 0; i < 96; i++) before[i] = delta[i] = (float)uniform();
    uint8_t payload[4 * 5 * 6];
    ASSERT_EQ_INT(mpidp_ef_demo_compress(&t, delta, NULL, 1, 1, 5, fr, fc, payload), MPIDP_OK);
    ASSERT_EQ_INT(mpidp_ef_demo_decode(&t, payload, sizeof payload, 1, 5, fr, fc, out), MPIDP_OK);
    double left = 0, total = 0;
    for (int i = 0; i < 96; i++) {
        ASSERT_NEAR(delta[i] + out[i], before[i], 1e-6);
        left += delta[i] * delta[i], total += before[i] * before[i];
    }
    ASSERT_TRUE(left < total && left > 0);
}

TEST_MAIN(tile_side_is_the_largest_divisor_up_to_chunk, tiling_views_tensors_as_rows_by_cols,
          index_maps_every_slot_of_every_tile_once, topk_keeps_the_largest_magnitudes_lower_slot_on_ties,
          quantizer_follows_the_rule, quantizer_rounds_half_to_even_and_survives_constant_input,
          code_packing_round_trips_every_code, payload_bytes_follow_the_layout,
          dct_basis_is_orthonormal_and_transforms_round_trip,
          dct_gives_the_bits_of_the_ordered_scalar_products, compress_keeps_every_error_in_the_buffer,
          sparse_mean_divides_by_the_ranks_that_chose, sparse_mean_refuses_broken_payloads,
          demo_with_every_coefficient_sends_the_whole_momentum, demo_keeps_what_it_does_not_send)
