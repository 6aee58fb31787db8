/* Exhaustive sweeps of the conversion kernels.
 *
 *   - All 2^32 fp32 bit patterns through pack_bf16 and pack_fp16 (s = 1, no ref)
 *     of every path this CPU runs, bit for bit against the reference. On an
 *     AVX2 machine this also checks the reference's fp16 rounding against the
 *     hardware's (F16C's vcvtps2ph), an independent implementation.
 *   - All 2^16 bf16 and fp16 patterns through unpack (a = 0, b = 1) of every
 *     path, against the reference and the exact value.
 *   - sum_bf16 and sum_fp16 over every 16-bit value paired with 256 partners
 *     (16.7 million pairs per format): the reference against the double
 *     oracle, every path against the reference.
 *
 * The 2^32 sweep runs on two threads in chunks of 2^20 values. Setting
 * MPIDP_EXHAUSTIVE_SUM=1 adds every one of the 2^32 pairs to the sum check
 * (several minutes; meant for an unsanitised -O2 build, see the report in
 * the pull request). */
#include <pthread.h>

#include "mpidp/pack.h"
#include "mpidp/status.h"
#include "pack_oracle.h"
#include "test.h"
#include "pack_internal.h"

enum { CHUNK = 1 << 20, THREADS = 2 };

typedef struct {
    const mpidp_pack_kernels_t *const *paths;
    size_t npaths;
    uint64_t begin, end; /* range of whatever the job sweeps */
    int failed;
    char what[200];
} job_t;

/* Records the first failure of a job: "<path> <kernel>: " then the details. */
static void job_fail(job_t *j, const char *path, const char *kernel, const char *fmt,
                     unsigned long long a, unsigned long long b, unsigned long long c)
{
    if (j->failed) return;
    j->failed = 1;
    int len = snprintf(j->what, sizeof j->what, "%s %s: ", path, kernel);
    if (len > 0 && (size_t)len < sizeof j->what)
        snprintf(j->what + len, sizeof j->what - (size_t)len, fmt, a, b, c);
}

/* Splits [0, total) between THREADS jobs running fn over the paths, waits
 * for them and returns how many failed (each failure printed). */
static int run_jobs(void *(*fn)(void *), const mpidp_pack_kernels_t *const *paths, size_t np,
                    uint64_t total)
{
    job_t jobs[THREADS];
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++) {
        jobs[i] = (job_t){.paths = paths, .npaths = np};
        jobs[i].begin = total / THREADS * (uint64_t)i;
        jobs[i].end = i == THREADS - 1 ? total : total / THREADS * (uint64_t)(i + 1);
        if (pthread_create(&t[i], NULL, fn, &jobs[i]) != 0) fn(&jobs[i]), t[i] = 0;
    }
    int failed = 0;
    for (int i = 0; i < THREADS; i++) {
        if (t[i]) pthread_join(t[i], NULL);
        if (jobs[i].failed) fprintf(stderr, "  %s\n", jobs[i].what);
        failed += jobs[i].failed;
    }
    return failed;
}

/* Chunks [begin, end) of the 2^32 fp32 patterns, 2^20 per chunk. */
static void *pack_sweep(void *arg)
{
    job_t *j = arg;
    float *src = malloc(CHUNK * sizeof *src);
    uint16_t *want_b = malloc(CHUNK * sizeof(uint16_t)), *want_h = malloc(CHUNK * sizeof(uint16_t));
    uint16_t *got = malloc(CHUNK * sizeof(uint16_t));
    if (!src || !want_b || !want_h || !got) {
        job_fail(j, "test", "buffers", "out of memory%.0llu%.0llu%.0llu", 0, 0, 0);
        goto out;
    }
    for (uint64_t c = j->begin; c < j->end && !j->failed; c++) {
        uint32_t base = (uint32_t)(c * CHUNK);
        /* Four patterns per store: the fill is a fifth of the sanitised run. */
        typedef uint32_t v4u __attribute__((vector_size(16)));
        v4u v = {base, base + 1, base + 2, base + 3};
        const v4u four = {4, 4, 4, 4};
        for (uint32_t i = 0; i < CHUNK; i += 4, v += four) memcpy(src + i, &v, sizeof v);
        mpidp__pack_ref.pack_bf16(want_b, src, NULL, 1.0f, CHUNK);
        mpidp__pack_ref.pack_fp16(want_h, src, NULL, 1.0f, CHUNK);
        for (size_t p = 1; p < j->npaths; p++) {
            for (int fmt = 0; fmt < 2; fmt++) {
                const uint16_t *want = fmt ? want_h : want_b;
                (fmt ? j->paths[p]->pack_fp16 : j->paths[p]->pack_bf16)(got, src, NULL, 1.0f, CHUNK);
                if (memcmp(got, want, CHUNK * sizeof *got) == 0) continue;
                uint32_t i = 0;
                while (got[i] == want[i]) i++;
                job_fail(j, j->paths[p]->name, fmt ? "pack_fp16" : "pack_bf16", "input 0x%08llx gave 0x%04llx, the reference 0x%04llx",
                         (unsigned long long)(base + i), got[i], want[i]);
            }
        }
    }
out:
    free(src);
    free(want_b);
    free(want_h);
    free(got);
    return NULL;
}

TEST(pack_every_fp32_pattern)
{
    const mpidp_pack_kernels_t *paths[4];
    size_t np = oracle_paths(paths);
    if (np < 2) {
        printf("  (only the reference runs here: nothing to compare)\n");
        return;
    }
    ASSERT_EQ_INT(run_jobs(pack_sweep, paths, np, (1ull << 32) / CHUNK), 0);
}

TEST(unpack_every_half_pattern)
{
    const mpidp_pack_kernels_t *paths[4];
    size_t np = oracle_paths(paths);
    enum { N = 1 << 16 };
    static uint16_t src[N];
    static float want[N], got[N];
    for (uint32_t i = 0; i < N; i++) src[i] = (uint16_t)i;
    for (int fmt = 0; fmt < 2; fmt++) {
        for (size_t i = 0; i < N; i++) want[i] = NAN; /* a == 0 must not read dst */
        (fmt ? mpidp__pack_ref.unpack_fp16 : mpidp__pack_ref.unpack_bf16)(want, src, NULL, 0.0f, 1.0f, 0.0f, N);
        for (uint32_t i = 0; i < N; i++) {
            uint32_t w = fbits(want[i]);
            int nan = fmt ? (i & 0x7c00) == 0x7c00 && (i & 0x3ff) : (i & 0x7f80) == 0x7f80 && (i & 0x7f);
            if (nan) {
                ASSERT_EQ_U64(w, 0x7fc00000);
            } else if (!fmt) {
                ASSERT_EQ_U64(w, i << 16);
            } else {
                /* An exact value that rounds back to the same half. */
                ASSERT_EQ_U64(mpidp_fp16_from_f32(want[i]), i);
                ASSERT_EQ_U64(oracle_fp16((double)want[i]), i);
            }
        }
        for (size_t p = 1; p < np; p++) {
            for (size_t i = 0; i < N; i++) got[i] = NAN;
            (fmt ? paths[p]->unpack_fp16 : paths[p]->unpack_bf16)(got, src, NULL, 0.0f, 1.0f, 0.0f, N);
            for (uint32_t i = 0; i < N; i++) {
                if (fbits(got[i]) != fbits(want[i]))
                    fprintf(stderr, "  %s %s 0x%04x\n", paths[p]->name,
                            fmt ? "unpack_fp16" : "unpack_bf16", (unsigned)i);
                ASSERT_EQ_U64(fbits(got[i]), fbits(want[i]));
            }
        }
    }
}

/* Pairs (a, b) for a in [begin, end): b runs over `partners` values of the
 * second operand (all 2^16, or a pseudo-random sample). The reference must
 * equal the oracle; every other path must equal the reference. */
static uint32_t sum_partners = 256;

static void *sum_sweep(void *arg)
{
    job_t *j = arg;
    enum { N = 1 << 16 };
    uint16_t *in = malloc(N * sizeof *in), *ref = malloc(N * sizeof *ref);
    uint16_t *got = malloc(N * sizeof *got), *init = malloc(N * sizeof *init);
    if (!in || !ref || !got || !init) {
        job_fail(j, "test", "buffers", "out of memory%.0llu%.0llu%.0llu", 0, 0, 0);
        goto out;
    }
    uint32_t np = sum_partners;
    for (uint64_t a = j->begin; a < j->end && !j->failed; a++) {
        uint64_t st = 0x9e3779b97f4a7c15ull ^ (a * 0x100000001b3ull);
        for (uint32_t i = 0; i < np; i++) {
            in[i] = (uint16_t)a;
            init[i] = np == N ? (uint16_t)i : (uint16_t)oracle_rnd(&st);
        }
        /* Also the neighbours of a and of -a, where cancellation happens. */
        if (np < N)
            for (uint32_t i = 0; i < 8 && i < np; i++)
                init[i] = (uint16_t)((a ^ 0x8000) + i - 4);
        for (int fmt = 0; fmt < 2; fmt++) {
            memcpy(ref, init, np * sizeof *ref);
            (fmt ? mpidp__pack_ref.sum_fp16 : mpidp__pack_ref.sum_bf16)(ref, in, np);
            double x = fmt ? mpidp_f32_from_fp16((uint16_t)a) : mpidp_f32_from_bf16((uint16_t)a);
            for (uint32_t i = 0; i < np; i++) {
                double y = fmt ? mpidp_f32_from_fp16(init[i]) : mpidp_f32_from_bf16(init[i]);
                uint16_t want = fmt ? oracle_fp16(x + y) : oracle_bf16(x + y);
                if (ref[i] != want) {
                    job_fail(j, "ref", fmt ? "sum_fp16" : "sum_bf16", "0x%04llx + 0x%04llx gave 0x%04llx", a, init[i], ref[i]);
                    break;
                }
            }
            for (size_t p = 1; p < j->npaths; p++) {
                memcpy(got, init, np * sizeof *got);
                (fmt ? j->paths[p]->sum_fp16 : j->paths[p]->sum_bf16)(got, in, np);
                if (memcmp(got, ref, np * sizeof *got) == 0) continue;
                uint32_t i = 0;
                while (got[i] == ref[i]) i++;
                job_fail(j, j->paths[p]->name, fmt ? "sum_fp16" : "sum_bf16", "0x%04llx + 0x%04llx gave 0x%04llx", a, init[i], got[i]);
            }
        }
    }
out:
    free(in);
    free(ref);
    free(got);
    free(init);
    return NULL;
}

TEST(sum_pairs_correctly_rounded)
{
    const mpidp_pack_kernels_t *paths[4];
    size_t np = oracle_paths(paths);
    const char *all = getenv("MPIDP_EXHAUSTIVE_SUM");
    sum_partners = all && all[0] == '1' ? 1u << 16 : 256u;
    if (sum_partners == 1u << 16) printf("  (MPIDP_EXHAUSTIVE_SUM=1: all 2^32 pairs)\n");
    ASSERT_EQ_INT(run_jobs(sum_sweep, paths, np, 1u << 16), 0);
}

TEST_MAIN(pack_every_fp32_pattern, unpack_every_half_pattern, sum_pairs_correctly_rounded)
