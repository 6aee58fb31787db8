/* The conversion kernels: the reference against hand-computed values and an
 * independent double-precision oracle, every available SIMD path against the
 * reference (fused forms, odd lengths, misalignment, in-place use, flush-to-zero
 * modes), and the dispatch with its start-up self-check.
 *
 * The exhaustive sweeps over all 2^32 fp32 and all 2^16 half patterns live in
 * test_pack_exhaustive.c, which takes most of the time. */
#include "mpidp/cuda.h"
#include "mpidp/pack.h"
#include "mpidp/status.h"
#include "pack_oracle.h"
#include "test.h"
#include "pack_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define HAVE_MXCSR 1
#endif

/* ---- helpers ---- */

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static uint64_t rnd(void) { return oracle_rnd(&rng_state); }

/* A float that is often an ordinary number and sometimes any bit pattern. */
static float rnd_float(void)
{
    uint64_t r = rnd();
    if ((r & 7) == 0) return ffrom((uint32_t)(r >> 32));
    uint32_t exp = 112u + (uint32_t)((r >> 3) % 32); /* 2^-15 .. 2^16 */
    return ffrom((uint32_t)((r >> 40) & 0x7fffffu) | exp << 23 | (uint32_t)((r >> 8) & 1) << 31);
}

static size_t available_paths(const mpidp_pack_kernels_t *out[4]) { return oracle_paths(out); }

/* ---- the reference against hand-computed values ---- */

TEST(bf16_rounding_special_values)
{
    static const struct {
        uint32_t in;
        uint16_t out;
    } cases[] = {
        {0x00000000, 0x0000}, {0x80000000, 0x8000}, /* signed zeros */
        {0x3f800000, 0x3f80}, {0xbf800000, 0xbf80}, /* +-1 */
        {0x7f800000, 0x7f80}, {0xff800000, 0xff80}, /* +-inf */
        {0x7fc00000, 0x7fc0}, {0xffc00000, 0x7fc0}, /* quiet NaNs: canonical */
        {0x7f800001, 0x7fc0}, {0xff800001, 0x7fc0}, /* signalling, low bit only */
        {0x7f807fff, 0x7fc0}, {0x7fbfffff, 0x7fc0}, {0x7fffffff, 0x7fc0},
        {0x7f7fffff, 0x7f80}, {0xff7fffff, 0xff80}, /* max float rounds to inf */
        {0x7f7f7fff, 0x7f7f},                       /* just below the tie: max bf16 */
        {0x7f7f8000, 0x7f80},                       /* tie, odd: up to inf */
        {0x3f808000, 0x3f80}, {0x3f818000, 0x3f82}, /* ties to even, both ways */
        {0x3f808001, 0x3f81}, {0x3f807fff, 0x3f80},
        {0x3f80ffff, 0x3f81}, {0x3fffffff, 0x4000}, /* carry into the exponent */
        {0x00800000, 0x0080}, {0x00000001, 0x0000}, /* min normal, min subnormal */
        {0x80000001, 0x8000}, {0x00008000, 0x0000}, /* subnormal tie to even zero */
        {0x00018000, 0x0002}, {0x00008001, 0x0001}, /* subnormal tie up, above tie */
        {0x007f8000, 0x0080}, {0x807fffff, 0x8080}, /* subnormal rounds to min normal */
        {0x007f7fff, 0x007f}, {0x00400000, 0x0040},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t got = mpidp_bf16_from_f32(ffrom(cases[i].in));
        if (got != cases[i].out)
            fprintf(stderr, "  input 0x%08x\n", (unsigned)cases[i].in);
        ASSERT_EQ_U64(got, cases[i].out);
    }
}

TEST(fp16_rounding_special_values)
{
    static const struct {
        uint32_t in;
        uint16_t out;
    } cases[] = {
        {0x00000000, 0x0000}, {0x80000000, 0x8000}, {0x3f800000, 0x3c00},
        {0xc0000000, 0xc000}, {0x7f800000, 0x7c00}, {0xff800000, 0xfc00},
        {0x7fc00000, 0x7e00}, {0xffc00000, 0x7e00}, {0x7f800001, 0x7e00},
        {0xff800001, 0x7e00}, {0x7fbfffff, 0x7e00},
        {0x477fe000, 0x7bff}, /* 65504, the largest half */
        {0x477fefff, 0x7bff}, /* 65519.998: below the tie */
        {0x477ff000, 0x7c00}, /* 65520: tie with odd 65504, rounds to inf */
        {0xc77ff000, 0xfc00}, {0x47800000, 0x7c00}, {0x7f7fffff, 0x7c00},
        {0x38800000, 0x0400}, /* 2^-14, smallest normal half */
        {0x387fc000, 0x03ff}, /* 1023 * 2^-24, the largest subnormal half */
        {0x387fe000, 0x0400}, /* 1023.5 * 2^-24: tie, up to even 0x400 */
        {0x387fdfff, 0x03ff}, /* just below that tie */
        {0x387fa000, 0x03fe}, /* 1022.5 * 2^-24: tie, down to even 0x3fe */
        {0x33800000, 0x0001}, /* 2^-24, smallest subnormal half */
        {0x33000000, 0x0000}, /* 2^-25: tie with zero, to even zero */
        {0xb3000000, 0x8000}, {0x33000001, 0x0001}, {0x32ffffff, 0x0000},
        {0x33c00000, 0x0002}, /* 1.5 * 2^-24: tie to even 2 */
        {0x34200000, 0x0002}, /* 2.5 * 2^-24: tie to even 2 */
        {0x34300000, 0x0003}, /* 2.75 * 2^-24 */
        {0x3f801000, 0x3c00}, /* 1 + 2^-11: tie, to even 1 */
        {0x3f803000, 0x3c02}, /* 1 + 3 * 2^-11: tie, to even 1 + 2^-9 */
        {0x3f801001, 0x3c01}, {0x00000001, 0x0000}, {0x807fffff, 0x8000},
        {0x3fffffff, 0x4000}, /* carry into the exponent */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t got = mpidp_fp16_from_f32(ffrom(cases[i].in));
        if (got != cases[i].out)
            fprintf(stderr, "  input 0x%08x\n", (unsigned)cases[i].in);
        ASSERT_EQ_U64(got, cases[i].out);
    }
}

TEST(widening_special_values)
{
    ASSERT_EQ_U64(fbits(mpidp_f32_from_bf16(0x3f80)), 0x3f800000);
    ASSERT_EQ_U64(fbits(mpidp_f32_from_bf16(0x8001)), 0x80010000); /* subnormal */
    ASSERT_EQ_U64(fbits(mpidp_f32_from_bf16(0x7f81)), 0x7f810000); /* payload kept */
    ASSERT_EQ_U64(fbits(mpidp_f32_from_fp16(0x3c00)), 0x3f800000);
    ASSERT_EQ_U64(fbits(mpidp_f32_from_fp16(0x7bff)), 0x477fe000);
    ASSERT_EQ_U64(fbits(mpidp_f32_from_fp16(0x0001)), 0x33800000); /* 2^-24 */
    ASSERT_EQ_U64(fbits(mpidp_f32_from_fp16(0x83ff)), 0xb87fc000); /* largest subnormal */
    ASSERT_EQ_U64(fbits(mpidp_f32_from_fp16(0x0400)), 0x38800000);
    ASSERT_EQ_U64(fbits(mpidp_f32_from_fp16(0xfc00)), 0xff800000);
    ASSERT_EQ_U64(fbits(mpidp_f32_from_fp16(0x7c01)), 0x7f802000);
    ASSERT_EQ_U64(fbits(mpidp_f32_from_fp16(0x8000)), 0x80000000);
    /* Every half widens to its exact value and converts back to itself. */
    for (uint32_t h = 0; h < 0x10000; h++) {
        uint16_t b = (uint16_t)h;
        double want = (h & 0x7c00) == 0x7c00 ? 0.0
                      : ldexp((h & 0x7c00) ? (double)((h & 0x3ff) | 0x400) : (double)(h & 0x3ff),
                              (h & 0x7c00) ? (int)((h >> 10) & 0x1f) - 25 : -24);
        if (h & 0x8000) want = -want;
        if ((h & 0x7c00) != 0x7c00) ASSERT_TRUE(mpidp_f32_from_fp16(b) == (float)want);
        if ((h & 0x7fff) <= 0x7c00) ASSERT_EQ_U64(mpidp_fp16_from_f32(mpidp_f32_from_fp16(b)), h);
        if ((h & 0x7fff) <= 0x7f80) ASSERT_EQ_U64(mpidp_bf16_from_f32(mpidp_f32_from_bf16(b)), h);
    }
}

/* ---- the reference against an independent oracle ---- */

TEST(bf16_rounding_matches_double_oracle)
{
    /* Every high half with the low halves around the rounding point, then
     * random patterns. */
    static const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000};
    for (uint32_t hi = 0; hi < 0x10000; hi++) {
        for (size_t j = 0; j < sizeof lows / sizeof lows[0] + 1; j++) {
            uint32_t u = hi << 16 | (j < sizeof lows / sizeof lows[0] ? lows[j] : (uint32_t)rnd() & 0xffff);
            float x = ffrom(u);
            uint16_t want = oracle_bf16((double)x);
            if (mpidp_bf16_from_f32(x) != want) fprintf(stderr, "  input 0x%08x\n", (unsigned)u);
            ASSERT_EQ_U64(mpidp_bf16_from_f32(x), want);
        }
    }
    for (int i = 0; i < 1000000; i++) {
        float x = ffrom((uint32_t)rnd());
        ASSERT_EQ_U64(mpidp_bf16_from_f32(x), oracle_bf16((double)x));
    }
}

TEST(fp16_rounding_matches_double_oracle)
{
    /* fp16 rounds at bit 13 for normal results: every pattern of the top 19
     * bits with low bits around that point; and random patterns. GCC's
     * _Float16 conversion (a separate, library implementation) checks too. */
    static const uint32_t lows[] = {0x0000, 0x0fff, 0x1000, 0x1001, 0x1fff};
    for (uint32_t hi = 0; hi < (1u << 19); hi++) {
        for (size_t j = 0; j < sizeof lows / sizeof lows[0]; j++) {
            float x = ffrom(hi << 13 | lows[j]);
            uint16_t want = oracle_fp16((double)x);
            if (mpidp_fp16_from_f32(x) != want) fprintf(stderr, "  input 0x%08x\n", (unsigned)fbits(x));
            ASSERT_EQ_U64(mpidp_fp16_from_f32(x), want);
        }
    }
    for (int i = 0; i < 1000000; i++) {
        float x = ffrom((uint32_t)rnd());
        /* Half the time, a magnitude near the fp16 range where rounding is busiest. */
        if (i & 1) x = ffrom((fbits(x) & 0x807fffffu) | (uint32_t)(100 + rnd() % 45) << 23);
        uint16_t want = oracle_fp16((double)x);
        ASSERT_EQ_U64(mpidp_fp16_from_f32(x), want);
#if defined(__FLT16_MAX__)
        if (x == x) {
            _Float16 h = (_Float16)x;
            uint16_t hb;
            memcpy(&hb, &h, sizeof hb);
            ASSERT_EQ_U64(hb, want);
        }
#endif
    }
}

/* The sum of two halves is rounded once from fp32; it must equal the correctly
 * rounded exact sum, computed in double (exact for two bf16 or fp16 values
 * within 53 bits, and otherwise innocuously double-rounded since 53 >= 2p + 2). */
TEST(sum_is_correctly_rounded)
{
    enum { N = 4096 };
    static uint16_t a[N], b[N], r[N];
    for (int round = 0; round < 256; round++) {
        for (size_t i = 0; i < N; i++) {
            uint64_t x = rnd();
            a[i] = (uint16_t)x;
            /* Often a nearby partner, so that cancellation and carries happen. */
            b[i] = (x >> 63) ? (uint16_t)(x >> 16) : (uint16_t)(a[i] ^ ((x >> 32) & 0x80ff));
        }
        for (int fmt = 0; fmt < 2; fmt++) {
            memcpy(r, b, sizeof r);
            (fmt ? mpidp__pack_ref.sum_fp16 : mpidp__pack_ref.sum_bf16)(r, a, N);
            for (size_t i = 0; i < N; i++) {
                double x = fmt ? mpidp_f32_from_fp16(a[i]) : mpidp_f32_from_bf16(a[i]);
                double y = fmt ? mpidp_f32_from_fp16(b[i]) : mpidp_f32_from_bf16(b[i]);
                uint16_t want = fmt ? oracle_fp16(x + y) : oracle_bf16(x + y);
                if (r[i] != want)
                    fprintf(stderr, "  %s 0x%04x + 0x%04x\n", fmt ? "fp16" : "bf16", a[i], b[i]);
                ASSERT_EQ_U64(r[i], want);
            }
        }
    }
}

TEST(pack_fused_forms_follow_the_formula)
{
    enum { N = 257 };
    static float src[N], ref[N];
    static uint16_t got[N];
    static const float scales[] = {1.0f, 0.5f, -3.0f, 1e-3f, 7e30f};
    for (size_t i = 0; i < N; i++) {
        src[i] = rnd_float();
        ref[i] = rnd_float();
    }
    src[0] = INFINITY;
    ref[0] = INFINITY; /* inf - inf: NaN, written canonical */
    for (size_t si = 0; si < sizeof scales / sizeof scales[0]; si++) {
        float s = scales[si];
        for (int with_ref = 0; with_ref < 2; with_ref++) {
            for (int fmt = 0; fmt < 2; fmt++) {
                (fmt ? mpidp__pack_ref.pack_fp16 : mpidp__pack_ref.pack_bf16)(
                    got, src, with_ref ? ref : NULL, s, N);
                for (size_t i = 0; i < N; i++) {
                    float t = src[i];
                    if (with_ref) t = t - ref[i];
                    t = t * s;
                    uint16_t want = fmt ? mpidp_fp16_from_f32(t) : mpidp_bf16_from_f32(t);
                    ASSERT_EQ_U64(got[i], want);
                }
            }
        }
    }
    uint16_t h;
    mpidp__pack_ref.pack_bf16(&h, src, ref, 1.0f, 1);
    ASSERT_EQ_U64(h, 0x7fc0);
}

TEST(unpack_follows_the_formula_and_order)
{
    /* (a*d + b*w) + c*r, in that order: with a*d = 2^27, b*w = -2^27, c*r = 1 the
     * result is 1, while a*d + (b*w + c*r) would round to 0. */
    float d = 0x1p27f, r = 1.0f;
    uint16_t w = mpidp_bf16_from_f32(-0x1p27f);
    mpidp__pack_ref.unpack_bf16(&d, &w, &r, 1.0f, 1.0f, 1.0f, 1);
    ASSERT_EQ_U64(fbits(d), fbits(1.0f));
    float wf = -0x1p27f;
    d = 0x1p27f;
    mpidp__pack_ref.merge_f32(&d, &wf, &r, 1.0f, 1.0f, 1.0f, 1);
    ASSERT_EQ_U64(fbits(d), fbits(1.0f));

    /* a == 0: dst is not read, so NaN garbage there does not leak through. */
    float dst[3] = {NAN, NAN, NAN};
    uint16_t h[3] = {0x3c00, 0xc000, 0x0001};
    mpidp__pack_ref.unpack_fp16(dst, h, NULL, 0.0f, 2.0f, 5.0f, 3);
    ASSERT_EQ_U64(fbits(dst[0]), fbits(2.0f));
    ASSERT_EQ_U64(fbits(dst[1]), fbits(-4.0f));
    ASSERT_EQ_U64(fbits(dst[2]), fbits(0x1p-23f));
    /* -0.0 counts as zero too. */
    dst[0] = NAN;
    mpidp__pack_ref.unpack_fp16(dst, h, NULL, -0.0f, 1.0f, 0.0f, 1);
    ASSERT_EQ_U64(fbits(dst[0]), fbits(1.0f));

    /* Generic values against the written-out formula. */
    enum { N = 301 };
    static float d0[N], got[N], ref[N];
    static uint16_t src[N];
    for (size_t i = 0; i < N; i++) {
        d0[i] = rnd_float();
        ref[i] = rnd_float();
        src[i] = (uint16_t)rnd();
    }
    const float a = 0.75f, b = -0.125f, c = 3.0f;
    for (int fmt = 0; fmt < 2; fmt++) {
        memcpy(got, d0, sizeof got);
        (fmt ? mpidp__pack_ref.unpack_fp16 : mpidp__pack_ref.unpack_bf16)(got, src, ref, a, b, c, N);
        for (size_t i = 0; i < N; i++) {
            float wv = fmt ? mpidp_f32_from_fp16(src[i]) : mpidp_f32_from_bf16(src[i]);
            float t = b * wv;
            float u = a * d0[i];
            t = u + t;
            float v = c * ref[i];
            t = t + v;
            uint32_t want = t != t ? 0x7fc00000u : fbits(t);
            ASSERT_EQ_U64(fbits(got[i]), want);
        }
    }
}

TEST(scale_and_nan_canonicalisation)
{
    float x[5] = {1.5f, -2.0f, NAN, ffrom(0xffa00001u), INFINITY};
    mpidp__pack_ref.scale_f32(x, 0.5f, 5);
    ASSERT_EQ_U64(fbits(x[0]), fbits(0.75f));
    ASSERT_EQ_U64(fbits(x[1]), fbits(-1.0f));
    ASSERT_EQ_U64(fbits(x[2]), 0x7fc00000);
    ASSERT_EQ_U64(fbits(x[3]), 0x7fc00000);
    ASSERT_EQ_U64(fbits(x[4]), fbits(INFINITY));
    double y[3] = {3.0, -NAN, -0.0};
    mpidp__pack_ref.scale_f64(y, 2.0, 3);
    uint64_t yb[3];
    memcpy(yb, y, sizeof yb);
    ASSERT_EQ_U64(yb[0], 0x4018000000000000ull);
    ASSERT_EQ_U64(yb[1], 0x7ff8000000000000ull);
    ASSERT_EQ_U64(yb[2], 0x8000000000000000ull);
    x[0] = INFINITY;
    mpidp__pack_ref.scale_f32(x, 0.0f, 1); /* inf * 0 */
    ASSERT_EQ_U64(fbits(x[0]), 0x7fc00000);
}

/* ---- every path against the reference ---- */

enum { CMP_N = 70000, CMP_PAD = 40 };

typedef struct {
    float f_src[CMP_N + CMP_PAD], f_ref[CMP_N + CMP_PAD], f_init[CMP_N + CMP_PAD];
    float f_got[CMP_N + CMP_PAD], f_want[CMP_N + CMP_PAD];
    uint16_t h_src[CMP_N + CMP_PAD], h_init[CMP_N + CMP_PAD];
    uint16_t h_got[CMP_N + CMP_PAD], h_want[CMP_N + CMP_PAD];
    double d_init[CMP_N + CMP_PAD], d_got[CMP_N + CMP_PAD], d_want[CMP_N + CMP_PAD];
} cmp_bufs_t;

static cmp_bufs_t cmp;

static void cmp_fill(void)
{
    static const uint32_t specials[] = {
        0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001,
        0xff800001, 0x7f7fffff, 0x7f7f8000, 0x00000001, 0x807fffff, 0x00018000,
        0x00008000, 0x3f808000, 0x3f818000, 0x477ff000, 0x477fefff, 0x33000000,
        0x33c00000, 0x387ff000, 0x3f801000, 0x3f803000, 0x00800000, 0x007f8000,
    };
    size_t ns = sizeof specials / sizeof specials[0];
    for (size_t i = 0; i < CMP_N + CMP_PAD; i++) {
        cmp.f_src[i] = (i % 97) < ns ? ffrom(specials[i % 97]) : rnd_float();
        cmp.f_ref[i] = (i % 89) < 3 ? ffrom(specials[(i / 89) % ns]) : rnd_float();
        cmp.f_init[i] = rnd_float();
        cmp.h_src[i] = (uint16_t)rnd();
        cmp.h_init[i] = (uint16_t)rnd();
        uint64_t d = rnd();
        if (d & 1) d = (d & 0x800fffffffffffffull) | 0x3fe0000000000000ull;
        memcpy(&cmp.d_init[i], &d, sizeof d);
    }
}

/* Compares whole buffers (the padding too, so writes past n show) and prints
 * the first difference. */
static int same(const void *got, const void *want, size_t es, const char *what,
                const char *path, size_t n, size_t off)
{
    if (memcmp(got, want, (CMP_N + CMP_PAD) * es) == 0) return 1;
    size_t i = 0;
    while (!memcmp((const char *)got + i * es, (const char *)want + i * es, es)) i++;
    uint64_t g = 0, w = 0;
    memcpy(&g, (const char *)got + i * es, es);
    memcpy(&w, (const char *)want + i * es, es);
    fprintf(stderr, "  %s %s n=%zu off=%zu: element %zu: 0x%llx vs reference 0x%llx\n", path,
            what, n, off, i, (unsigned long long)g, (unsigned long long)w);
    return 0;
}

/* Runs every kernel of k and of the reference on the same data for one
 * (n, offset) pair, with several scalar arguments; 1 if all agree. */
static int compare_run(const mpidp_pack_kernels_t *k, size_t n, size_t off)
{
    const mpidp_pack_kernels_t *r = &mpidp__pack_ref;
    size_t os = off, od = (off * 3 + 1) % 8, orf = (off + 5) % 8;
    const float *src = cmp.f_src + os, *ref = cmp.f_ref + orf;
    static const float scales[] = {1.0f, 0.25f, -1.75f, 300.0f};
    for (size_t si = 0; si < 4; si++) {
        for (int wr = 0; wr < 2; wr++) {
            for (int fmt = 0; fmt < 2; fmt++) {
                memcpy(cmp.h_got, cmp.h_init, sizeof cmp.h_got);
                memcpy(cmp.h_want, cmp.h_init, sizeof cmp.h_want);
                (fmt ? k->pack_fp16 : k->pack_bf16)(cmp.h_got + od, src, wr ? ref : NULL, scales[si], n);
                (fmt ? r->pack_fp16 : r->pack_bf16)(cmp.h_want + od, src, wr ? ref : NULL, scales[si], n);
                if (!same(cmp.h_got, cmp.h_want, 2, fmt ? "pack_fp16" : "pack_bf16", k->name, n, off))
                    return 0;
            }
        }
        memcpy(cmp.f_got, cmp.f_src, sizeof cmp.f_got);
        memcpy(cmp.f_want, cmp.f_src, sizeof cmp.f_want);
        k->scale_f32(cmp.f_got + od, scales[si], n);
        r->scale_f32(cmp.f_want + od, scales[si], n);
        if (!same(cmp.f_got, cmp.f_want, 4, "scale_f32", k->name, n, off)) return 0;
        memcpy(cmp.d_got, cmp.d_init, sizeof cmp.d_got);
        memcpy(cmp.d_want, cmp.d_init, sizeof cmp.d_want);
        k->scale_f64(cmp.d_got + od, scales[si], n);
        r->scale_f64(cmp.d_want + od, scales[si], n);
        if (!same(cmp.d_got, cmp.d_want, 8, "scale_f64", k->name, n, off)) return 0;
    }
    static const float abc[][3] = {{0, 1, 0}, {0.5f, 0.5f, 1}, {0, -2, 0.25f}, {1, 1, -1}, {1e-3f, 1e3f, 1e-3f}};
    for (size_t mi = 0; mi < 5; mi++) {
        for (int wr = 0; wr < 2; wr++) {
            for (int fmt = 0; fmt < 3; fmt++) {
                memcpy(cmp.f_got, cmp.f_init, sizeof cmp.f_got);
                if (abc[mi][0] == 0.0f)
                    for (size_t i = 0; i < CMP_N + CMP_PAD; i++) cmp.f_got[i] = NAN;
                memcpy(cmp.f_want, cmp.f_got, sizeof cmp.f_want);
                const float *rp = wr ? ref : NULL;
                float a = abc[mi][0], b = abc[mi][1], c = abc[mi][2];
                if (fmt == 2) {
                    k->merge_f32(cmp.f_got + od, src, rp, a, b, c, n);
                    r->merge_f32(cmp.f_want + od, src, rp, a, b, c, n);
                } else if (fmt == 1) {
                    k->unpack_fp16(cmp.f_got + od, cmp.h_src + os, rp, a, b, c, n);
                    r->unpack_fp16(cmp.f_want + od, cmp.h_src + os, rp, a, b, c, n);
                } else {
                    k->unpack_bf16(cmp.f_got + od, cmp.h_src + os, rp, a, b, c, n);
                    r->unpack_bf16(cmp.f_want + od, cmp.h_src + os, rp, a, b, c, n);
                }
                static const char *const names[] = {"unpack_bf16", "unpack_fp16", "merge_f32"};
                if (!same(cmp.f_got, cmp.f_want, 4, names[fmt], k->name, n, off)) return 0;
            }
        }
    }
    for (int fmt = 0; fmt < 2; fmt++) {
        memcpy(cmp.h_got, cmp.h_init, sizeof cmp.h_got);
        memcpy(cmp.h_want, cmp.h_init, sizeof cmp.h_want);
        (fmt ? k->sum_fp16 : k->sum_bf16)(cmp.h_got + od, cmp.h_src + os, n);
        (fmt ? r->sum_fp16 : r->sum_bf16)(cmp.h_want + od, cmp.h_src + os, n);
        if (!same(cmp.h_got, cmp.h_want, 2, fmt ? "sum_fp16" : "sum_bf16", k->name, n, off))
            return 0;
    }
    return 1;
}

TEST(every_path_matches_the_reference)
{
    const mpidp_pack_kernels_t *paths[4];
    size_t np = available_paths(paths);
    ASSERT_TRUE(np >= 1);
    cmp_fill();
    for (size_t p = 1; p < np; p++) {
        for (size_t n = 0; n <= 70; n++) ASSERT_TRUE(compare_run(paths[p], n, n % 8));
        static const size_t big[] = {127, 128, 129, 255, 1000, 4099, 65537, CMP_N};
        for (size_t i = 0; i < sizeof big / sizeof big[0]; i++)
            for (size_t off = 0; off < 8; off += 3) ASSERT_TRUE(compare_run(paths[p], big[i], off));
    }
}

TEST(every_path_works_in_place)
{
    const mpidp_pack_kernels_t *paths[4];
    size_t np = available_paths(paths);
    enum { N = 1003 };
    static float a[N], b[N], init[N];
    static uint16_t h[N], hi[N], hw[N];
    for (size_t i = 0; i < N; i++) {
        init[i] = rnd_float();
        h[i] = (uint16_t)rnd();
        hi[i] = h[i];
    }
    for (size_t p = 1; p < np; p++) {
        const mpidp_pack_kernels_t *k = paths[p], *r = &mpidp__pack_ref;
        /* unpack with dst == ref: p = a*p + b*w + c*p. */
        memcpy(a, init, sizeof a);
        memcpy(b, init, sizeof b);
        k->unpack_bf16(a, h, a, 0.5f, 0.25f, 0.125f, N);
        r->unpack_bf16(b, h, b, 0.5f, 0.25f, 0.125f, N);
        ASSERT_TRUE(memcmp(a, b, sizeof a) == 0);
        /* merge with dst == src. */
        memcpy(a, init, sizeof a);
        memcpy(b, init, sizeof b);
        k->merge_f32(a, a, NULL, 0.5f, 0.25f, 0.0f, N);
        r->merge_f32(b, b, NULL, 0.5f, 0.25f, 0.0f, N);
        ASSERT_TRUE(memcmp(a, b, sizeof a) == 0);
        /* sum with inout == in (doubling). */
        memcpy(h, hi, sizeof h);
        memcpy(hw, hi, sizeof hw);
        k->sum_fp16(h, h, N);
        r->sum_fp16(hw, hw, N);
        ASSERT_TRUE(memcmp(h, hw, sizeof h) == 0);
        memcpy(h, hi, sizeof h);
    }
}

/* Every kernel on heap arrays of exactly n elements at every small length:
 * AddressSanitizer reports any read or write past either end. */
TEST(kernels_stay_in_bounds)
{
    const mpidp_pack_kernels_t *paths[4];
    size_t np = available_paths(paths);
    for (size_t n = 1; n <= 100; n += (n < 40 ? 1 : 13)) {
        float *f1 = malloc(n * sizeof *f1), *f2 = malloc(n * sizeof *f2), *f3 = malloc(n * sizeof *f3);
        uint16_t *h1 = malloc(n * sizeof *h1), *h2 = malloc(n * sizeof *h2);
        double *d = malloc(n * sizeof *d);
        ASSERT_TRUE(f1 && f2 && f3 && h1 && h2 && d);
        for (size_t i = 0; i < n; i++) {
            f1[i] = f2[i] = f3[i] = rnd_float();
            h1[i] = h2[i] = (uint16_t)rnd();
            d[i] = (double)f1[i];
        }
        for (size_t p = 0; p < np; p++) {
            const mpidp_pack_kernels_t *k = paths[p];
            k->pack_bf16(h1, f1, f2, 0.5f, n);
            k->pack_fp16(h1, f1, NULL, 1.0f, n);
            k->unpack_bf16(f3, h2, f2, 1.0f, 1.0f, 1.0f, n);
            k->unpack_fp16(f3, h2, NULL, 0.0f, 1.0f, 1.0f, n);
            k->merge_f32(f3, f1, f2, 0.5f, 0.5f, 1.0f, n);
            k->sum_bf16(h1, h2, n);
            k->sum_fp16(h2, h1, n);
            k->scale_f32(f3, 0.5f, n);
            k->scale_f64(d, 0.5, n);
        }
        free(f1);
        free(f2);
        free(f3);
        free(h1);
        free(h2);
        free(d);
    }
}

/* Zero-length calls touch nothing, so they accept NULL pointers (an empty
 * tensor's data pointer may be NULL). */
TEST(zero_length_accepts_null)
{
    const mpidp_pack_kernels_t *paths[4];
    size_t np = available_paths(paths);
    for (size_t p = 0; p < np; p++) {
        const mpidp_pack_kernels_t *k = paths[p];
        k->pack_bf16(NULL, NULL, NULL, 2.0f, 0);
        k->pack_fp16(NULL, NULL, NULL, 1.0f, 0);
        k->unpack_bf16(NULL, NULL, NULL, 1.0f, 1.0f, 1.0f, 0);
        k->unpack_fp16(NULL, NULL, NULL, 0.0f, 1.0f, 1.0f, 0);
        k->merge_f32(NULL, NULL, NULL, 1.0f, 1.0f, 1.0f, 0);
        k->sum_bf16(NULL, NULL, 0);
        k->sum_fp16(NULL, NULL, 0);
        k->scale_f32(NULL, 2.0f, 0);
        k->scale_f64(NULL, 2.0, 0);
    }
    ASSERT_TRUE(np >= 1);
}

/* With flush-to-zero and denormals-are-zero set (torch.set_flush_denormal),
 * arithmetic flushes in every path alike and the conversions ignore the mode:
 * the paths still agree bit for bit. */
TEST(paths_agree_under_flush_to_zero)
{
#ifdef HAVE_MXCSR
    const mpidp_pack_kernels_t *paths[4];
    size_t np = available_paths(paths);
    cmp_fill();
    /* Plenty of subnormal inputs. */
    for (size_t i = 0; i < CMP_N + CMP_PAD; i += 3) cmp.f_src[i] = ffrom((uint32_t)rnd() & 0x807fffffu);
    for (size_t i = 0; i < CMP_N + CMP_PAD; i += 5) cmp.h_src[i] = (uint16_t)(rnd() & 0x807f);
    unsigned int saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040);
    int ok = 1;
    for (size_t p = 1; p < np && ok; p++) ok = compare_run(paths[p], 4099, 1) && compare_run(paths[p], 33, 2);
    _mm_setcsr(saved);
    ASSERT_TRUE(ok);
    /* The conversion itself ignores the mode. */
    _mm_setcsr(saved | 0x8040);
    uint16_t b = mpidp_bf16_from_f32(ffrom(0x00018000));
    uint16_t h = mpidp_fp16_from_f32(ffrom(0x33c00000));
    _mm_setcsr(saved);
    ASSERT_EQ_U64(b, 0x0002);
    ASSERT_EQ_U64(h, 0x0002);
#endif
}

/* ---- self-check and dispatch ---- */

static void trunc_pack_bf16(uint16_t *dst, const float *src, const float *ref, float s, size_t n)
{
    (void)ref;
    (void)s;
    for (size_t i = 0; i < n; i++) dst[i] = (uint16_t)(fbits(src[i]) >> 16);
}

/* Wrong only on exact ties (rounds half away from zero): caught only if the
 * self-check's data contains ties. */
static void tie_away_pack_fp16(uint16_t *dst, const float *src, const float *ref, float s, size_t n)
{
    mpidp__pack_ref.pack_fp16(dst, src, ref, s, n);
    if (ref || s != 1.0f) return;
    for (size_t i = 0; i < n; i++) {
        uint32_t u = fbits(src[i]);
        uint32_t e = (u >> 23) & 0xff;
        /* u + 0x1000 is the next half up, exactly. */
        if (e >= 113 && e < 142 && (u & 0x1fff) == 0x1000)
            dst[i] = mpidp_fp16_from_f32(ffrom(u + 0x1000));
    }
}

static void overrun_sum_bf16(uint16_t *inout, const uint16_t *in, size_t n)
{
    mpidp__pack_ref.sum_bf16(inout, in, n);
    if (n) inout[n] ^= 1; /* one past the end */
}

static void reads_dst_unpack_fp16(float *dst, const uint16_t *src, const float *ref, float a,
                                  float b, float c, size_t n)
{
    mpidp__pack_ref.unpack_fp16(dst, src, ref, a == 0.0f ? 1e-30f : a, b, c, n);
}

static void payload_pack_bf16(uint16_t *dst, const float *src, const float *ref, float s, size_t n)
{
    mpidp__pack_ref.pack_bf16(dst, src, ref, s, n);
    for (size_t i = 0; i < n; i++)
        if (src[i] != src[i] && !ref && s == 1.0f) dst[i] = (uint16_t)((fbits(src[i]) >> 16) | 0x40);
}

static void fma_merge_f32(float *dst, const float *src, const float *ref, float a, float b,
                          float c, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float t = b * src[i];
        if (a != 0.0f) t = fmaf(a, dst[i], t);
        if (ref) t = fmaf(c, ref[i], t);
        dst[i] = t != t ? ffrom(0x7fc00000u) : t;
    }
}

static int selfcheck_rejects(void (*patch)(mpidp_pack_kernels_t *), const char *kernel)
{
    mpidp_pack_kernels_t bad = mpidp__pack_ref;
    bad.name = "broken";
    patch(&bad);
    char why[400];
    int rc = mpidp__pack_selfcheck(&bad, why, sizeof why);
    if (rc == 0) fprintf(stderr, "  self-check accepted a broken %s\n", kernel);
    else if (!strstr(why, kernel)) fprintf(stderr, "  self-check message lacks %s: %s\n", kernel, why);
    return rc != 0 && strstr(why, kernel) != NULL;
}

static void patch_trunc(mpidp_pack_kernels_t *k) { k->pack_bf16 = trunc_pack_bf16; }
static void patch_tie(mpidp_pack_kernels_t *k) { k->pack_fp16 = tie_away_pack_fp16; }
static void patch_overrun(mpidp_pack_kernels_t *k) { k->sum_bf16 = overrun_sum_bf16; }
static void patch_reads(mpidp_pack_kernels_t *k) { k->unpack_fp16 = reads_dst_unpack_fp16; }
static void patch_payload(mpidp_pack_kernels_t *k) { k->pack_bf16 = payload_pack_bf16; }
static void patch_fma(mpidp_pack_kernels_t *k) { k->merge_f32 = fma_merge_f32; }
static void patch_missing(mpidp_pack_kernels_t *k) { k->scale_f64 = NULL; }

TEST(selfcheck_accepts_every_available_path)
{
    const mpidp_pack_kernels_t *paths[4];
    size_t np = available_paths(paths);
    char why[400];
    for (size_t p = 0; p < np; p++) {
        int rc = mpidp__pack_selfcheck(paths[p], why, sizeof why);
        if (rc) fprintf(stderr, "  %s: %s\n", paths[p]->name, why);
        ASSERT_EQ_INT(rc, 0);
        ASSERT_STREQ(why, "");
    }
}

TEST(selfcheck_rejects_broken_kernels)
{
    ASSERT_TRUE(selfcheck_rejects(patch_trunc, "pack_bf16"));
    ASSERT_TRUE(selfcheck_rejects(patch_tie, "pack_fp16"));
    ASSERT_TRUE(selfcheck_rejects(patch_overrun, "sum_bf16"));
    ASSERT_TRUE(selfcheck_rejects(patch_reads, "unpack_fp16"));
    ASSERT_TRUE(selfcheck_rejects(patch_payload, "pack_bf16"));
    ASSERT_TRUE(selfcheck_rejects(patch_fma, "merge_f32"));
    ASSERT_TRUE(selfcheck_rejects(patch_missing, "missing kernel"));
}

TEST(choose_falls_back_past_a_broken_table)
{
    mpidp_pack_kernels_t bad = mpidp__pack_ref;
    bad.name = "avx512";
    bad.pack_bf16 = trunc_pack_bf16;
    const mpidp_pack_kernels_t *next;
    if (mpidp_pack_kernels_for("avx2", &next) != MPIDP_OK) next = &mpidp__pack_ref;
    const mpidp_pack_kernels_t *cand[] = {&bad, next, &mpidp__pack_ref};
    mpidp__pack_choose(cand, 3);
    ASSERT_TRUE(mpidp_pack_kernels() == next);
    const char *why = mpidp_pack_fallback_reason();
    ASSERT_TRUE(strstr(why, "avx512 kernels failed the start-up self-check") != NULL);
    ASSERT_TRUE(strstr(why, "pack_bf16") != NULL);
    ASSERT_TRUE(strstr(why, next->name) != NULL);
    /* Two broken tables: both reasons, then the reference. */
    mpidp_pack_kernels_t bad2 = bad;
    bad2.name = "avx2";
    bad2.pack_bf16 = mpidp__pack_ref.pack_bf16;
    bad2.merge_f32 = fma_merge_f32;
    const mpidp_pack_kernels_t *cand2[] = {&bad, &bad2, &mpidp__pack_ref};
    mpidp__pack_choose(cand2, 3);
    ASSERT_STREQ(mpidp_pack_path(), "ref");
    why = mpidp_pack_fallback_reason();
    ASSERT_TRUE(strstr(why, "avx512 kernels failed") && strstr(why, "avx2 kernels failed"));
    ASSERT_TRUE(strstr(why, "using ref") != NULL);
    /* A clean init clears the reason. */
    ASSERT_OK(mpidp_pack_init(NULL));
    ASSERT_STREQ(mpidp_pack_fallback_reason(), "");
}

TEST(the_known_paths_are_listed_in_order)
{
    static const char *const want[] = {"ref", "avx2", "avx512", "avx512_bf16"};
    for (size_t i = 0; i < 4; i++) ASSERT_STREQ(mpidp_pack_path_name(i), want[i]);
    ASSERT_TRUE(mpidp_pack_path_name(4) == NULL);
    ASSERT_TRUE(mpidp_pack_path_name((size_t)-1) == NULL);
}

TEST(init_auto_and_forced)
{
    const mpidp_pack_kernels_t *paths[4];
    size_t np = available_paths(paths);
    ASSERT_OK(mpidp_pack_init(NULL));
    /* Auto picks the best available path (the last in ref, avx2, avx512, avx512_bf16 order). */
    ASSERT_STREQ(mpidp_pack_path(), paths[np - 1]->name);
    ASSERT_OK(mpidp_pack_init(""));
    ASSERT_STREQ(mpidp_pack_path(), paths[np - 1]->name);
    ASSERT_OK(mpidp_pack_init("ref"));
    ASSERT_STREQ(mpidp_pack_path(), "ref");
    ASSERT_TRUE(mpidp_pack_kernels() == &mpidp__pack_ref);

    const mpidp_pack_kernels_t *k;
    if (mpidp_pack_kernels_for("avx2", &k) == MPIDP_OK) {
        ASSERT_OK(mpidp_pack_init("avx2"));
        ASSERT_STREQ(mpidp_pack_path(), "avx2");
    } else {
        ASSERT_EQ_INT(mpidp_pack_init("avx2"), MPIDP_ENOTSUP);
    }
    if (mpidp_pack_kernels_for("avx512", &k) == MPIDP_OK) {
        ASSERT_OK(mpidp_pack_init("avx512"));
        ASSERT_TRUE(strncmp(mpidp_pack_path(), "avx512", 6) == 0);
    } else {
        ASSERT_OK(mpidp_pack_init("ref"));
        mpidp_error_clear();
        ASSERT_EQ_INT(mpidp_pack_init("avx512"), MPIDP_ENOTSUP);
        ASSERT_TRUE(strstr(mpidp_error_detail(), "MPIDP_SIMD=avx512 but this CPU lacks AVX-512") != NULL);
        ASSERT_STREQ(mpidp_pack_path(), "ref"); /* the failed call changed nothing */
        ASSERT_TRUE(k == NULL);
    }
    ASSERT_EQ_INT(mpidp_pack_init("sse4"), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "sse4") != NULL);
    ASSERT_EQ_INT(mpidp_pack_kernels_for("neon", &k), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_pack_kernels_for(NULL, &k), MPIDP_EINVAL);
    ASSERT_OK(mpidp_pack_kernels_for("ref", &k));
    ASSERT_TRUE(k == &mpidp__pack_ref);
    ASSERT_OK(mpidp_pack_init(NULL));
}

/* The C tests build without CUDA: every CUDA entry point says so. */
TEST(cuda_stub_reports_not_supported)
{
#ifndef MPIDP_WITH_CUDA
    ASSERT_EQ_INT(mpidp_cuda_available(), 0);
    mpidp_error_clear();
    ASSERT_EQ_INT(mpidp_cuda_pack_bf16(NULL, NULL, NULL, 1.0f, 4, NULL), MPIDP_ENOTSUP);
    ASSERT_STREQ(mpidp_error_detail(), "mpidp was built without CUDA");
    ASSERT_EQ_INT(mpidp_cuda_pack_fp16(NULL, NULL, NULL, 1.0f, 4, NULL), MPIDP_ENOTSUP);
    ASSERT_EQ_INT(mpidp_cuda_unpack_bf16(NULL, NULL, NULL, 0, 1, 0, 4, NULL), MPIDP_ENOTSUP);
    ASSERT_EQ_INT(mpidp_cuda_unpack_fp16(NULL, NULL, NULL, 0, 1, 0, 4, NULL), MPIDP_ENOTSUP);
    ASSERT_EQ_INT(mpidp_cuda_sum_bf16(NULL, NULL, 4, NULL), MPIDP_ENOTSUP);
    ASSERT_EQ_INT(mpidp_cuda_sum_fp16(NULL, NULL, 4, NULL), MPIDP_ENOTSUP);
    ASSERT_EQ_INT(mpidp_cuda_scale_f32(NULL, 2.0f, 4, NULL), MPIDP_ENOTSUP);
    ASSERT_EQ_INT(mpidp_cuda_merge_f32(NULL, NULL, NULL, 1, 1, 1, 4, NULL), MPIDP_ENOTSUP);
#endif
}

TEST_MAIN(bf16_rounding_special_values, fp16_rounding_special_values, widening_special_values,
          bf16_rounding_matches_double_oracle, fp16_rounding_matches_double_oracle,
          sum_is_correctly_rounded, pack_fused_forms_follow_the_formula,
          unpack_follows_the_formula_and_order, scale_and_nan_canonicalisation,
          every_path_matches_the_reference, every_path_works_in_place, kernels_stay_in_bounds, zero_length_accepts_null,
          paths_agree_under_flush_to_zero,
          selfcheck_accepts_every_available_path, selfcheck_rejects_broken_kernels,
          choose_falls_back_past_a_broken_table, the_known_paths_are_listed_in_order,
          init_auto_and_forced,
          cuda_stub_reports_not_supported)
