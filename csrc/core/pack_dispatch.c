/* Chooses the kernel path once per process: CPU detection, the MPIDP_SIMD
 * override, and the start-up self-check that keeps a wrong kernel from ever
 * touching training data.
 *
 * Paths, best first: avx512_bf16, avx512, avx2, ref. A path is "available" when
 * this build compiled it (its table getter is not NULL) and the CPU and OS
 * support its instructions. The chosen path must also pass mpidp__pack_selfcheck,
 * a bit-for-bit comparison with the reference; a path that fails is skipped in
 * favour of the next lower one and the reason is kept for the Python glue to
 * warn with. The self-check matters most for the AVX-512 kernels, which cannot
 * run on the machines where mpidp is developed. */
#include "mpidp/pack.h"

#include "mpidp/status.h"
#include "fail.h"
#include "pack_internal.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define MPIDP_X86 1
#endif

/* ---- CPU detection ---- */

enum { PATH_REF, PATH_AVX2, PATH_AVX512, PATH_AVX512_BF16, PATH_COUNT };

static const char *const path_names[PATH_COUNT] = {"ref", "avx2", "avx512", "avx512_bf16"};

/* For each path: NULL when this CPU runs it, else the first thing it lacks. */
typedef struct {
    const char *lacks[PATH_COUNT];
} cpu_support_t;

#ifdef MPIDP_X86
/* XGETBV needs no compiler flag when written as inline assembly; it is only
 * executed after CPUID reported OSXSAVE, which guarantees the instruction. */
static uint64_t xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

static cpu_support_t detect_cpu(void)
{
#ifdef MPIDP_PACK_ASSUME_ALL_ISAS
    /* Only for the AVX-512 emulation build (make -C benchmarks/c avx512-emu),
     * which runs the SIMD files through SIMDe on any CPU. */
    cpu_support_t all = {{NULL, NULL, NULL, NULL}};
    return all;
#endif
    cpu_support_t s = {{NULL, "AVX2", "AVX-512F", "AVX-512F"}};
#ifdef MPIDP_X86
    unsigned a = 0, b = 0, c = 0, d = 0;
    unsigned max_leaf = __get_cpuid_max(0, NULL);
    if (max_leaf < 1) return s;
    __cpuid(1, a, b, c, d);
    int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1,
        f16c = (c >> 29) & 1;
    uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    /* The OS must save the registers across context switches: XMM and YMM
     * (XCR0 bits 1-2) for AVX; also opmask, ZMM_Hi256 and Hi16_ZMM (bits 5-7)
     * for AVX-512. */
    int os_ymm = (xcr0 & 0x06) == 0x06, os_zmm = (xcr0 & 0xe6) == 0xe6;
    int avx2 = 0, f = 0, dq = 0, bw = 0, vl = 0, bf16 = 0;
    if (max_leaf >= 7) {
        unsigned max_sub;
        __cpuid_count(7, 0, max_sub, b, c, d);
        avx2 = (b >> 5) & 1;
        f = (b >> 16) & 1;
        dq = (b >> 17) & 1;
        bw = (b >> 30) & 1;
        vl = (b >> 31) & 1;
        if (max_sub >= 1) {
            __cpuid_count(7, 1, a, b, c, d);
            bf16 = (a >> 5) & 1;
        }
    }
    const char *lack2 = !avx ? "AVX"
                        : !avx2 ? "AVX2"
                        : !fma ? "FMA"
                        : !f16c ? "F16C"
                        : !os_ymm ? "OS support for the AVX (YMM) register state"
                        : NULL;
    const char *lack512 = !f ? "AVX-512F"
                          : !bw ? "AVX-512BW"
                          : !vl ? "AVX-512VL"
                          : !dq ? "AVX-512DQ"
                          : !os_zmm ? "OS support for the AVX-512 (ZMM, opmask) register state"
                          : lack2;
    s.lacks[PATH_AVX2] = lack2;
    s.lacks[PATH_AVX512] = lack512;
    s.lacks[PATH_AVX512_BF16] = lack512 ? lack512 : !bf16 ? "AVX512_BF16" : NULL;
#endif
    return s;
}

static const mpidp_pack_kernels_t *path_table(int path)
{
    switch (path) {
    case PATH_REF: return &mpidp__pack_ref;
    case PATH_AVX2: return mpidp__pack_avx2_table();
    case PATH_AVX512: return mpidp__pack_avx512_table();
    case PATH_AVX512_BF16: return mpidp__pack_avx512_bf16_table();
    }
    return NULL;
}

/* The path's table when the build has it and the CPU runs it, else NULL. */
static const mpidp_pack_kernels_t *available(int path, const cpu_support_t *cpu)
{
    return cpu->lacks[path] ? NULL : path_table(path);
}

/* Why an unavailable path cannot run, as a phrase for an error detail. */
static void explain(int path, const cpu_support_t *cpu, char *buf, size_t len)
{
    if (cpu->lacks[path])
        snprintf(buf, len, "this CPU lacks %s", cpu->lacks[path]);
    else
        snprintf(buf, len, "this build of mpidp has no %s kernels (it was compiled "
                 "without their instruction-set flags)", path_names[path]);
}

static int path_index(const char *name)
{
    for (int p = 0; p < PATH_COUNT; p++)
        if (strcmp(name, path_names[p]) == 0) return p;
    return -1;
}

/* ---- the chosen path ---- */

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(const mpidp_pack_kernels_t *) current;
static char fallback_reason[1024];

/* Appends printf-style text to fallback_reason (truncating, never overflowing). */
static void reason_append(const char *fmt, ...)
{
    size_t used = strlen(fallback_reason);
    if (used + 1 >= sizeof fallback_reason) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fallback_reason + used, sizeof fallback_reason - used, fmt, ap);
    va_end(ap);
}

/* Fills out[] with the tables to try, best first, starting from path `start`:
 * every lower path the build has and the CPU runs, the reference last. */
static size_t candidates_from(int start, const cpu_support_t *cpu,
                              const mpidp_pack_kernels_t *out[PATH_COUNT])
{
    size_t n = 0;
    for (int p = start; p >= PATH_REF; p--) {
        const mpidp_pack_kernels_t *k = available(p, cpu);
        if (k) out[n++] = k;
    }
    return n;
}

void mpidp__pack_choose(const mpidp_pack_kernels_t *const *candidates, size_t n)
{
    char why[400];
    pthread_mutex_lock(&init_lock);
    fallback_reason[0] = '\0';
    const mpidp_pack_kernels_t *chosen = &mpidp__pack_ref;
    for (size_t i = 0; i < n; i++) {
        const mpidp_pack_kernels_t *k = candidates[i];
        /* The reference needs no check: it is the definition. */
        if (k == &mpidp__pack_ref || mpidp__pack_selfcheck(k, why, sizeof why) == 0) {
            chosen = k;
            break;
        }
        reason_append("%s%s kernels failed the start-up self-check against the "
                      "reference (%s)", fallback_reason[0] ? "; " : "", k->name, why);
    }
    if (fallback_reason[0]) reason_append("; using %s", chosen->name);
    atomic_store(&current, chosen);
    pthread_mutex_unlock(&init_lock);
}

int mpidp_pack_init(const char *forced)
{
    cpu_support_t cpu = detect_cpu();
    int start = PATH_AVX512_BF16;
    if (forced && forced[0]) {
        int p = path_index(forced);
        if (p < 0)
            return mpidp__fail(MPIDP_EINVAL,
                               "MPIDP_SIMD=%s is not a kernel path (use ref, avx2, "
                               "avx512 or leave it unset)", forced);
        /* "avx512" means the best AVX-512 variant this CPU has. */
        if (p == PATH_AVX512 && available(PATH_AVX512_BF16, &cpu)) p = PATH_AVX512_BF16;
        if (!available(p, &cpu)) {
            char why[160];
            explain(p, &cpu, why, sizeof why);
            return mpidp__fail(MPIDP_ENOTSUP, "MPIDP_SIMD=%s but %s", forced, why);
        }
        start = p;
    }
    const mpidp_pack_kernels_t *cand[PATH_COUNT];
    mpidp__pack_choose(cand, candidates_from(start, &cpu, cand));
    return MPIDP_OK;
}

static void auto_init(void)
{
    if (atomic_load(&current)) return;
    cpu_support_t cpu = detect_cpu();
    const mpidp_pack_kernels_t *cand[PATH_COUNT];
    mpidp__pack_choose(cand, candidates_from(PATH_AVX512_BF16, &cpu, cand));
}

const mpidp_pack_kernels_t *mpidp_pack_kernels(void)
{
    const mpidp_pack_kernels_t *k = atomic_load(&current);
    if (k) return k;
    /* First use without mpidp_pack_init: choose automatically, once, even when
     * several threads get here together. */
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, auto_init);
    return atomic_load(&current);
}

const char *mpidp_pack_path(void) { return mpidp_pack_kernels()->name; }

const char *mpidp_pack_fallback_reason(void) { return fallback_reason; }

const char *mpidp_pack_path_name(size_t i) { return i < PATH_COUNT ? path_names[i] : NULL; }

int mpidp_pack_kernels_for(const char *name, const mpidp_pack_kernels_t **out)
{
    *out = NULL;
    int p = name ? path_index(name) : -1;
    if (p < 0)
        return mpidp__fail(MPIDP_EINVAL, "unknown kernel path \"%s\"",
                           name ? name : "(null)");
    cpu_support_t cpu = detect_cpu();
    const mpidp_pack_kernels_t *k = available(p, &cpu);
    if (!k) {
        char why[160];
        explain(p, &cpu, why, sizeof why);
        return mpidp__fail(MPIDP_ENOTSUP, "kernel path %s is unavailable: %s", name, why);
    }
    *out = k;
    return MPIDP_OK;
}

/* ---- the self-check ---- */

/* Longest run checked, plus room for a misalignment of up to 3 elements and a
 * guard of 8 elements on each side that must come back untouched. */
#define SC_MAXN 1031
#define SC_CAP (SC_MAXN + 24)
#define SC_BASE 8

/* Inputs that exercise every rounding rule: signed zeros, infinities, quiet
 * and signalling NaNs (also with only low payload bits, which a naive bf16
 * rounding turns into inf), the largest and smallest normals, fp32 subnormals,
 * ties to even both ways for bf16 and fp16, and the fp16 overflow and
 * subnormal boundaries. */
static const uint32_t special_f32[] = {
    0x00000000, 0x80000000, 0x3f800000, 0xbf800000, 0x7f800000, 0xff800000,
    0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001, 0x7fbfffff, 0x7f80ffff,
    0x7fffffff, 0xffffffff, 0x7f7fffff, 0xff7fffff, 0x7f7f8000, 0x7f7f7fff,
    0x00800000, 0x80800000, 0x00000001, 0x80000001, 0x007fffff, 0x807fffff,
    0x007f8000, 0x007f7fff, 0x00018000, 0x00008000, 0x3f808000, 0x3f818000,
    0x3f80ffff, 0x3f817fff, 0x477fe000, 0x477fefff, 0x477ff000, 0xc77ff000,
    0x477fffff, 0x47800000, 0x38800000, 0x387fffff, 0x387fe000, 0x387ff000,
    0x33800000, 0x33000000, 0x33000001, 0x32ffffff, 0x33c00000, 0x34200000,
    0x3f801000, 0x3f803000, 0x3f800fff, 0x3f801001, 0xb3c00000, 0x00400000,
    0x387fc000, 0x387fa000, 0x387fdfff, 0xb87fe000,
};

static const uint16_t special_16[] = {
    0x0000, 0x8000, 0x3f80, 0xbf80, 0x7f80, 0xff80, 0x7fc0, 0xffc0, 0x7f81, 0xff81,
    0x7fff, 0x0001, 0x8001, 0x007f, 0x0080, 0x7f7f, 0xff7f, 0x3c00, 0x7c00, 0xfc00,
    0x7e00, 0x7c01, 0xfc01, 0x7dff, 0x03ff, 0x83ff, 0x0400, 0x7bff, 0xfbff, 0x3555,
};

static uint64_t sc_next(uint64_t *state)
{
    /* xorshift64*: deterministic, so a failure reproduces. */
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545f4914f6cdd1dull;
}

/* Every array of the self-check, each SC_CAP elements long; the self-check
 * allocates them together as one of these (about 55 KB). */
typedef struct {
    double d_init[SC_CAP], d_got[SC_CAP], d_want[SC_CAP];
    float src[SC_CAP], ref[SC_CAP], init[SC_CAP], got[SC_CAP], want[SC_CAP];
    uint16_t h_src[SC_CAP], h_init[SC_CAP], h_got[SC_CAP], h_want[SC_CAP];
} sc_bufs_t;

/* Runs of (length, offset): lengths around every vector width (8, 16, 32),
 * zero, and one long run; offsets misalign each array differently. */
static const struct {
    size_t n, off;
} sc_runs[] = {
    {0, 0},  {1, 1},  {3, 2},  {7, 3},  {8, 0},   {9, 1},   {15, 2},       {16, 3},
    {17, 0}, {31, 1}, {32, 2}, {33, 3}, {47, 0},  {63, 1},  {64, 2},       {65, 3},
    {97, 1}, {129, 2}, {255, 3}, {SC_MAXN, 1},
};

static void sc_fill(sc_bufs_t *b)
{
    uint64_t st = 0x9e3779b97f4a7c15ull;
    size_t ns = sizeof special_f32 / sizeof special_f32[0];
    size_t nh = sizeof special_16 / sizeof special_16[0];
    for (size_t i = 0; i < SC_CAP; i++) {
        uint64_t r = sc_next(&st);
        uint32_t u;
        if (i >= SC_BASE && i - SC_BASE < ns) {
            u = special_f32[i - SC_BASE];
        } else if (r & 1) {
            u = (uint32_t)(r >> 32); /* any bit pattern */
        } else {
            /* An ordinary number in [2^-8, 2^8) of either sign, so that the
             * fused arithmetic also sees values that do not overflow. */
            u = (uint32_t)((r >> 40) & 0x007fffffu) | (uint32_t)((r >> 2) & 1u) << 31 |
                (uint32_t)(119 + (r >> 8) % 16) << 23;
        }
        memcpy(&b->src[i], &u, sizeof u);
        uint32_t v = (uint32_t)(sc_next(&st) & 0x807fffffu) |
                     ((uint32_t)(120 + (r >> 16) % 14) << 23);
        memcpy(&b->ref[i], &v, sizeof v);
        /* Also NaNs and infinities in ref, now and then. */
        if (r % 61 == 0) memcpy(&b->ref[i], &special_f32[(r >> 20) % ns], sizeof(float));
        b->h_src[i] = (i >= SC_BASE && i - SC_BASE < nh) ? special_16[i - SC_BASE]
                                                         : (uint16_t)(r >> 16);
        b->h_init[i] = (i >= SC_BASE + 3 && i - SC_BASE - 3 < nh)
                           ? special_16[nh - 1 - (i - SC_BASE - 3)]
                           : (uint16_t)(r >> 48);
        uint64_t dv = sc_next(&st);
        if (!(dv & 3)) dv = (dv & 0x800fffffffffffffull) | 0x3ff0000000000000ull;
        memcpy(&b->d_init[i], &dv, sizeof dv);
    }
    for (size_t i = 0; i < SC_CAP; i++) b->init[i] = b->ref[(i * 7) % SC_CAP] * 0.5f;
}

/* The elements a run can touch: its n, the misalignment and a guard each side. */
static size_t sc_span(size_t n)
{
    size_t span = n + 2 * SC_BASE + 4;
    return span < SC_CAP ? span : SC_CAP;
}

/* Compares got and want (elements of es bytes) over the run's span, guards
 * included; on a difference describes it in why and returns 1. The output
 * starts at SC_BASE + off, and the input element that lines up with output
 * element i is input[i + shift]. */
static int sc_compare(const void *got, const void *want, size_t es, const void *input,
                      size_t in_es, ptrdiff_t shift, const char *what, size_t n,
                      size_t off, char *why, size_t why_len)
{
    if (memcmp(got, want, sc_span(n) * es) == 0) return 0;
    size_t i = 0;
    while (memcmp((const char *)got + i * es, (const char *)want + i * es, es) == 0) i++;
    uint64_t g = 0, w = 0, x = 0;
    memcpy(&g, (const char *)got + i * es, es);
    memcpy(&w, (const char *)want + i * es, es);
    ptrdiff_t j = (ptrdiff_t)i + shift;
    if (j >= 0 && j < (ptrdiff_t)SC_CAP) memcpy(&x, (const char *)input + j * in_es, in_es);
    const char *where = (i < SC_BASE + off || i >= SC_BASE + off + n)
                            ? " (outside the range it was given)"
                            : "";
    snprintf(why, why_len,
             "%s, n=%zu, offset %zu: element %zd%s with input 0x%llx gave 0x%llx, "
             "the reference 0x%llx", what, n, off, (ptrdiff_t)i - (ptrdiff_t)(SC_BASE + off),
             where, (unsigned long long)x, (unsigned long long)g, (unsigned long long)w);
    return 1;
}

static const float sc_scales[] = {1.0f, 0.375f, -3.5f, 1024.0f};
static const struct {
    float a, b, c;
    int with_ref;
} sc_merges[] = {
    {0.0f, 1.0f, 0.0f, 0}, {0.5f, 0.25f, -1.0f, 1}, {0.0f, 2.0f, 1.0f, 1}, {1.0f, 1.0f, 0.0f, 0},
    {-0.0f, 0.125f, 3.0f, 1},
};

/* Runs every kernel of `k` against the reference over every case. Long (~95
 * lines) on purpose: each run (a length and alignment, sc_runs) sets up its
 * buffers once and then checks pack, scale, merge/unpack and sum on them in
 * one pass; split per kernel, every part would repeat that set-up. */
static int sc_run_all(const mpidp_pack_kernels_t *k, sc_bufs_t *b, char *why, size_t len)
{
    const mpidp_pack_kernels_t *r = &mpidp__pack_ref;
    char what[96];
    for (size_t ri = 0; ri < sizeof sc_runs / sizeof sc_runs[0]; ri++) {
        size_t n = sc_runs[ri].n, off = sc_runs[ri].off;
        /* Each array gets its own misalignment. */
        size_t o_src = SC_BASE + off, o_ref = SC_BASE + ((off + 2) & 3),
               o_dst = SC_BASE + ((off + 1) & 3);
        const float *src = b->src + o_src, *ref = b->ref + o_ref;
        ptrdiff_t shift = (ptrdiff_t)o_src - (ptrdiff_t)o_dst;
        size_t span = sc_span(n);

        for (size_t si = 0; si < sizeof sc_scales / sizeof sc_scales[0]; si++) {
            float s = sc_scales[si];
            for (int with_ref = 0; with_ref < 2; with_ref++) {
                const float *rp = with_ref ? ref : NULL;
                for (int fmt = 0; fmt < 2; fmt++) {
                    memcpy(b->h_got, b->h_init, span * sizeof(uint16_t));
                    memcpy(b->h_want, b->h_init, span * sizeof(uint16_t));
                    (fmt ? k->pack_fp16 : k->pack_bf16)(b->h_got + o_dst, src, rp, s, n);
                    (fmt ? r->pack_fp16 : r->pack_bf16)(b->h_want + o_dst, src, rp, s, n);
                    snprintf(what, sizeof what, "%s (s=%g, ref %s)",
                             fmt ? "pack_fp16" : "pack_bf16", (double)s,
                             with_ref ? "given" : "NULL");
                    /* Report the source element that lines up with dst. */
                    if (sc_compare(b->h_got, b->h_want, 2, b->src, 4, shift, what, n,
                                   o_dst - SC_BASE, why, len))
                        return 1;
                }
            }
            memcpy(b->got, b->src, span * sizeof(float));
            memcpy(b->want, b->src, span * sizeof(float));
            k->scale_f32(b->got + o_src, s, n);
            r->scale_f32(b->want + o_src, s, n);
            snprintf(what, sizeof what, "scale_f32 (s=%g)", (double)s);
            if (sc_compare(b->got, b->want, 4, b->src, 4, 0, what, n, o_src - SC_BASE, why,
                           len))
                return 1;
            memcpy(b->d_got, b->d_init, span * sizeof(double));
            memcpy(b->d_want, b->d_init, span * sizeof(double));
            k->scale_f64(b->d_got + o_dst, (double)s, n);
            r->scale_f64(b->d_want + o_dst, (double)s, n);
            snprintf(what, sizeof what, "scale_f64 (s=%g)", (double)s);
            if (sc_compare(b->d_got, b->d_want, 8, b->d_init, 8, 0, what, n, o_dst - SC_BASE,
                           why, len))
                return 1;
        }

        for (size_t mi = 0; mi < sizeof sc_merges / sizeof sc_merges[0]; mi++) {
            float a = sc_merges[mi].a, bb = sc_merges[mi].b, c = sc_merges[mi].c;
            const float *rp = sc_merges[mi].with_ref ? ref : NULL;
            for (int fmt = 0; fmt < 3; fmt++) {
                /* With a == 0 dst starts as NaN: reading it would show. */
                if (a == 0.0f) {
                    const uint32_t garbage = 0x7fa00001u;
                    for (size_t i = 0; i < span; i++) memcpy(&b->got[i], &garbage, 4);
                } else {
                    memcpy(b->got, b->init, span * sizeof(float));
                }
                memcpy(b->want, b->got, span * sizeof(float));
                const void *input;
                size_t in_es;
                if (fmt == 2) {
                    k->merge_f32(b->got + o_dst, src, rp, a, bb, c, n);
                    r->merge_f32(b->want + o_dst, src, rp, a, bb, c, n);
                    input = b->src;
                    in_es = 4;
                } else {
                    const uint16_t *hs = b->h_src + o_src;
                    (fmt ? k->unpack_fp16 : k->unpack_bf16)(b->got + o_dst, hs, rp, a, bb, c, n);
                    (fmt ? r->unpack_fp16 : r->unpack_bf16)(b->want + o_dst, hs, rp, a, bb, c, n);
                    input = b->h_src;
                    in_es = 2;
                }
                snprintf(what, sizeof what, "%s (a=%g, b=%g, c=%g, ref %s)",
                         fmt == 2 ? "merge_f32" : fmt ? "unpack_fp16" : "unpack_bf16",
                         (double)a, (double)bb, (double)c, rp ? "given" : "NULL");
                if (sc_compare(b->got, b->want, 4, input, in_es, shift, what, n,
                               o_dst - SC_BASE, why, len))
                    return 1;
            }
        }

        for (int fmt = 0; fmt < 2; fmt++) {
            memcpy(b->h_got, b->h_init, span * sizeof(uint16_t));
            memcpy(b->h_want, b->h_init, span * sizeof(uint16_t));
            const uint16_t *in = b->h_src + o_src;
            (fmt ? k->sum_fp16 : k->sum_bf16)(b->h_got + o_dst, in, n);
            (fmt ? r->sum_fp16 : r->sum_bf16)(b->h_want + o_dst, in, n);
            if (sc_compare(b->h_got, b->h_want, 2, b->h_src, 2, shift,
                           fmt ? "sum_fp16" : "sum_bf16", n, o_dst - SC_BASE, why, len))
                return 1;
        }
    }
    return 0;
}

int mpidp__pack_selfcheck(const mpidp_pack_kernels_t *k, char *why, size_t why_len)
{
    if (why_len) why[0] = '\0';
    if (!k->pack_bf16 || !k->pack_fp16 || !k->unpack_bf16 || !k->unpack_fp16 ||
        !k->sum_bf16 || !k->sum_fp16 || !k->scale_f32 || !k->scale_f64 || !k->merge_f32) {
        snprintf(why, why_len, "the %s table has a missing kernel", k->name);
        return 1;
    }
    sc_bufs_t *b = malloc(sizeof *b);
    if (!b) {
        snprintf(why, why_len, "out of memory for the self-check buffers");
        return 1;
    }
    sc_fill(b);
    int bad = sc_run_all(k, b, why, why_len);
    free(b);
    return bad;
}
