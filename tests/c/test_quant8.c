/* The 8-bit block quantizer (mpidp/quant8.h): the reference against a
 * float64 model and its error bound, Bagua's two failing inputs, non-finite
 * blocks, and every SIMD path this CPU runs bit for bit against the
 * reference over a sweep of fp32 bit patterns. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/pack.h"
#include "mpidp/quant8.h"
#include "mpidp/status.h"
#include "test.h"
#include "quant8_internal.h"

static const char *const paths[] = {"avx2", "avx512"};

static uint64_t rnd(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545f4914f6cdd1dull;
}

static float f32(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static uint32_t bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* Encodes and decodes x[0..n) with the reference. */
static void round_trip(const float *x, float *out, size_t n)
{
    uint8_t *q = malloc(mpidp_q8_bytes(n));
    mpidp__q8_ref.encode(q, x, 1.0f, n);
    mpidp__q8_ref.decode(out, q, 0, n);
    free(q);
}

/* |decoded - x| <= (hi - lo) / 510 plus fp32 rounding, per block, against a
 * float64 model of the same rule; codes differ from the model's by at most
 * one, and only where the model's quotient is within fp32 noise of a tie. */
static int check_against_model(const float *x, size_t n)
{
    uint8_t *q = malloc(mpidp_q8_bytes(n));
    float *y = malloc(n * sizeof *y);
    mpidp__q8_ref.encode(q, x, 1.0f, n);
    mpidp__q8_ref.decode(y, q, 0, n);
    int bad = 0;
    for (size_t at = 0; at < n && !bad; at += MPIDP_Q8_BLOCK) {
        size_t len = n - at < MPIDP_Q8_BLOCK ? n - at : MPIDP_Q8_BLOCK;
        double lo = x[at], hi = x[at];
        for (size_t i = 0; i < len; i++) lo = fmin(lo, x[at + i]), hi = fmax(hi, x[at + i]);
        double S = (hi - lo) / 255.0, mag = fmax(fabs(lo), fabs(hi));
        double slack = 2.0 * ldexp(1.0, ilogb(mag > 0 ? mag : 1.0) - 23) + 0x1p-148;
        const uint8_t *codes = q + (at / MPIDP_Q8_BLOCK) * MPIDP_Q8_RECORD + MPIDP_Q8_HEADER;
        for (size_t i = 0; i < len && !bad; i++) {
            double t = x[at + i], err = fabs((double)y[at + i] - t);
            if (err > S / 2 * (1 + 0x1p-20) + slack) {
                fprintf(stderr, "x=%a decoded %a: error %g > half a step %g\n", t,
                        (double)y[at + i], err, S / 2);
                bad = 1;
            }
            if (S > 0) {
                double model = (t - lo) / S, frac = model - floor(model);
                int qm = (int)fmin(255, fmax(0, nearbyint(model)));
                int near_tie = fabs(frac - 0.5) < 1e-4;
                if (abs((int)codes[i] - qm) > (near_tie ? 1 : 0)) {
                    fprintf(stderr, "x=%a: code %d, model %d (%.6f)\n", t, codes[i], qm, model);
                    bad = 1;
                }
            }
        }
    }
    free(q), free(y);
    return bad;
}

TEST(record_sizes)
{
    ASSERT_EQ_INT((int)mpidp_q8_bytes(0), 0);
    ASSERT_EQ_INT((int)mpidp_q8_bytes(1), MPIDP_Q8_RECORD);
    ASSERT_EQ_INT((int)mpidp_q8_bytes(MPIDP_Q8_BLOCK), MPIDP_Q8_RECORD);
    ASSERT_EQ_INT((int)mpidp_q8_bytes(MPIDP_Q8_BLOCK + 1), 2 * MPIDP_Q8_RECORD);
}

TEST(reference_within_half_a_step_of_a_float64_model)
{
    uint64_t st = 12345;
    enum { N = 64 * MPIDP_Q8_BLOCK + 77 };
    float *x = malloc(N * sizeof *x);
    /* Per block a different centre and spread: 1e-40 to 1e30, both signs. */
    static const float spreads[] = {1.0f, 1e-3f, 1e3f, 1e-20f, 1e-38f, 1e-44f, 1e20f, 1e30f};
    for (size_t i = 0; i < N; i++) {
        size_t b = i / MPIDP_Q8_BLOCK;
        float spread = spreads[b % 8], centre = (float)((int)(b % 5) - 2) * spread * 3.0f;
        double u = (double)(rnd(&st) >> 11) * 0x1p-53 * 2.0 - 1.0;
        x[i] = centre + (float)(u * spread);
    }
    ASSERT_TRUE(check_against_model(x, N) == 0);
    free(x);
}

/* Bagua's first defect: the lower bound was not clamped, so the extremes of
 * a wide block gave level -1 (and a negative float converted to uint8). */
TEST(bagua_wide_block_keeps_codes_in_range)
{
    float x[MPIDP_Q8_BLOCK], y[MPIDP_Q8_BLOCK];
    for (int i = 0; i < MPIDP_Q8_BLOCK; i++) x[i] = (i % 3 == 0) ? -1e30f : (i % 3 == 1) ? 1e30f : 0.0f;
    uint8_t q[MPIDP_Q8_RECORD];
    mpidp__q8_ref.encode(q, x, 1.0f, MPIDP_Q8_BLOCK);
    ASSERT_EQ_INT(q[MPIDP_Q8_HEADER + 0], 0);
    ASSERT_EQ_INT(q[MPIDP_Q8_HEADER + 1], 255);
    mpidp__q8_ref.decode(y, q, 0, MPIDP_Q8_BLOCK);
    ASSERT_TRUE(y[0] == -1e30f && y[1] == 1e30f);
    ASSERT_TRUE(fabsf(y[2]) <= 1e30f / 255.0f);
    ASSERT_TRUE(check_against_model(x, MPIDP_Q8_BLOCK) == 0);
    /* The widest finite block, -FLT_MAX to FLT_MAX, neither overflows. */
    for (int i = 0; i < MPIDP_Q8_BLOCK; i++) x[i] = (i & 1) ? FLT_MAX : -FLT_MAX * ((float)i / 256.0f);
    round_trip(x, y, MPIDP_Q8_BLOCK);
    for (int i = 0; i < MPIDP_Q8_BLOCK; i++) ASSERT_TRUE(isfinite(y[i]));
    ASSERT_TRUE(y[1] == FLT_MAX);
    ASSERT_TRUE(check_against_model(x, MPIDP_Q8_BLOCK) == 0);
}

/* Bagua's second defect: rounding relative to 0 made a narrow block far from
 * 0 decode to a constant. Counted from the block's minimum, 256 values one
 * ulp apart keep one code each and decode exactly. */
TEST(bagua_narrow_block_far_from_zero_keeps_its_resolution)
{
    float x[MPIDP_Q8_BLOCK], y[MPIDP_Q8_BLOCK];
    for (int i = 0; i < MPIDP_Q8_BLOCK; i++) x[i] = f32(bits(5e4f) + (uint32_t)((i * 37) % 256));
    round_trip(x, y, MPIDP_Q8_BLOCK);
    for (int i = 0; i < MPIDP_Q8_BLOCK; i++) ASSERT_TRUE(y[i] == x[i]);
    /* The literal input: 5e4 + 1e-3 is 5e4 in fp32 (its ulp is 2^-8). */
    float z[2] = {5e4f, 5e4f + 1e-3f}, w[2];
    round_trip(z, w, 2);
    ASSERT_TRUE(w[0] == z[0] && w[1] == z[1]);
    /* A narrow block of fractions: the error stays within half a step. */
    for (int i = 0; i < MPIDP_Q8_BLOCK; i++) x[i] = 5e4f + (float)i * 0.0625f;
    ASSERT_TRUE(check_against_model(x, MPIDP_Q8_BLOCK) == 0);
}

TEST(non_finite_block_decodes_to_nan_and_others_do_not)
{
    enum { N = 3 * MPIDP_Q8_BLOCK };
    float x[N], y[N];
    for (int i = 0; i < N; i++) x[i] = (float)i * 0.5f;
    x[MPIDP_Q8_BLOCK + 7] = INFINITY;
    round_trip(x, y, N);
    for (int i = 0; i < N; i++) {
        int in_bad_block = i / MPIDP_Q8_BLOCK == 1;
        ASSERT_TRUE(in_bad_block ? bits(y[i]) == 0x7fc00000u : isfinite(y[i]));
    }
    x[MPIDP_Q8_BLOCK + 7] = NAN;
    x[2 * MPIDP_Q8_BLOCK] = -INFINITY;
    round_trip(x, y, N);
    ASSERT_TRUE(isfinite(y[0]) && isnan(y[MPIDP_Q8_BLOCK]) && isnan(y[N - 1]));
    /* Accumulating a NaN block poisons the sum (GradScaler sees it). */
    uint8_t *q = malloc(mpidp_q8_bytes(N));
    mpidp__q8_ref.encode(q, x, 1.0f, N);
    for (int i = 0; i < N; i++) y[i] = 1.0f;
    mpidp__q8_ref.decode(y, q, 1, N);
    ASSERT_TRUE(y[0] == 1.0f && isnan(y[MPIDP_Q8_BLOCK + 1]));
    free(q);
}

TEST(constant_zero_and_tiny_blocks)
{
    float x[MPIDP_Q8_BLOCK + 5], y[MPIDP_Q8_BLOCK + 5];
    for (int i = 0; i < MPIDP_Q8_BLOCK + 5; i++) x[i] = -2.75f;
    round_trip(x, y, MPIDP_Q8_BLOCK + 5);
    for (int i = 0; i < MPIDP_Q8_BLOCK + 5; i++) ASSERT_TRUE(y[i] == -2.75f);
    for (int i = 0; i < MPIDP_Q8_BLOCK; i++) x[i] = (i & 1) ? -0.0f : 0.0f;
    round_trip(x, y, MPIDP_Q8_BLOCK);
    for (int i = 0; i < MPIDP_Q8_BLOCK; i++) ASSERT_TRUE(bits(y[i]) == 0); /* +0: bounds are canonical */
    /* Subnormals a few ulps apart: exact (the 2^100 regime). */
    for (int i = 0; i < MPIDP_Q8_BLOCK; i++) x[i] = f32((uint32_t)(i % 200)) * ((i & 2) ? -1.0f : 1.0f);
    round_trip(x, y, MPIDP_Q8_BLOCK);
    for (int i = 0; i < MPIDP_Q8_BLOCK; i++) ASSERT_TRUE(fabsf(y[i] - x[i]) <= f32(2));
    ASSERT_TRUE(check_against_model(x, MPIDP_Q8_BLOCK) == 0);
}

TEST(scale_is_applied_before_quantizing_and_tail_codes_are_zero)
{
    float x[300], y[300], ys[300];
    uint64_t st = 99;
    for (int i = 0; i < 300; i++) x[i] = (float)(int64_t)(rnd(&st) % 2001) - 1000.0f;
    uint8_t q[2 * MPIDP_Q8_RECORD];
    memset(q, 0xab, sizeof q);
    mpidp__q8_ref.encode(q, x, 0.25f, 300);
    for (int i = 300 - MPIDP_Q8_BLOCK; i < MPIDP_Q8_BLOCK; i++)
        ASSERT_EQ_INT(q[MPIDP_Q8_RECORD + MPIDP_Q8_HEADER + i], 0);
    mpidp__q8_ref.decode(ys, q, 0, 300);
    for (int i = 0; i < 300; i++) y[i] = x[i] * 0.25f;
    float z[300];
    round_trip(y, z, 300);
    ASSERT_TRUE(memcmp(z, ys, sizeof z) == 0);
}

/* Every SIMD path this CPU runs, bit for bit against the reference: every
 * upper-16-bit fp32 pattern with random low bits, in blocks that mix
 * neighbouring patterns (so ranges run from 0 to everything), with four
 * scales, unaligned, and both decode modes over the reference's records. */
TEST(simd_paths_match_the_reference_bit_for_bit)
{
    enum { N = 65536 + 301 };
    float *x = malloc((N + 1) * sizeof *x), *got = malloc((N + 1) * sizeof *got),
          *want = malloc((N + 1) * sizeof *want);
    uint8_t *qg = malloc(mpidp_q8_bytes(N)), *qw = malloc(mpidp_q8_bytes(N));
    uint64_t st = 7;
    static const float scales[] = {1.0f, 0.5f, -3.0f, 1e-30f};
    int ran = 0;
    for (size_t p = 0; p < sizeof paths / sizeof *paths; p++) {
        const mpidp_q8_kernels_t *k;
        if (mpidp_q8_kernels_for(paths[p], &k) != MPIDP_OK) {
            printf("  (%s: %s)\n", paths[p], mpidp_error_detail());
            mpidp_error_clear();
            continue;
        }
        ran++;
        for (size_t si = 0; si < 4; si++) {
            for (size_t i = 0; i < N; i++) {
                uint32_t hi16 = (uint32_t)(i * 40503u) & 0xffffu; /* a permutation of 0..65535 */
                x[i + 1] = f32(hi16 << 16 | (uint32_t)(rnd(&st) & 0xffffu));
            }
            for (size_t n = N; n > N - 3; n--) {
                k->encode(qg, x + 1, scales[si], n);
                mpidp__q8_ref.encode(qw, x + 1, scales[si], n);
                ASSERT_TRUE(memcmp(qg, qw, mpidp_q8_bytes(n)) == 0);
                for (int acc = 0; acc < 2; acc++) {
                    for (size_t i = 0; i <= N; i++) got[i] = want[i] = x[N - i];
                    k->decode(got + 1, qw, acc, n);
                    mpidp__q8_ref.decode(want + 1, qw, acc, n);
                    ASSERT_TRUE(memcmp(got, want, (N + 1) * sizeof *got) == 0);
                }
            }
        }
        char why[200];
        ASSERT_EQ_INT(mpidp__q8_selfcheck(k, why, sizeof why), 0);
    }
    printf("  %d SIMD path(s) compared\n", ran);
    free(x), free(got), free(want), free(qg), free(qw);
}

TEST(the_chosen_path_follows_the_pack_path)
{
    const mpidp_q8_kernels_t *k = mpidp_q8_kernels();
    ASSERT_TRUE(k != NULL);
    ASSERT_STREQ(mpidp_q8_fallback_reason(), "");
    const char *pack = mpidp_pack_path();
    ASSERT_TRUE(strncmp(pack, k->name, strlen(k->name)) == 0);
    ASSERT_OK(mpidp_pack_init("ref"));
    ASSERT_STREQ(mpidp_q8_kernels()->name, "ref");
    ASSERT_OK(mpidp_pack_init(NULL));
    ASSERT_TRUE(mpidp_q8_kernels() == k);
    const mpidp_q8_kernels_t *none;
    ASSERT_EQ_INT(mpidp_q8_kernels_for("neon", &none), MPIDP_EINVAL);
    ASSERT_TRUE(none == NULL);
}

TEST_MAIN(record_sizes, reference_within_half_a_step_of_a_float64_model,
          bagua_wide_block_keeps_codes_in_range,
          bagua_narrow_block_far_from_zero_keeps_its_resolution,
          non_finite_block_decodes_to_nan_and_others_do_not, constant_zero_and_tiny_blocks,
          scale_is_applied_before_quantizing_and_tail_codes_are_zero,
          simd_paths_match_the_reference_bit_for_bit, the_chosen_path_follows_the_pack_path)
