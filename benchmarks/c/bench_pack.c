/* Single-thread throughput of every kernel of every path this CPU runs,
 * against memcpy, in GB/s of bytes read plus bytes written (memcpy of B bytes
 * counts 2B). Best of several repeats, with the buffers touched beforehand so
 * page faults are not timed, and the caches flushed (by writing a buffer
 * larger than the last-level cache) before every timed run, so that in-place
 * kernels do not find their data still cached from the set-up copy.
 *
 *     make -C benchmarks/c && benchmarks/out/bench_pack [MiB of fp32] [repeats]
 *
 * The default, 64 MiB of fp32, is far beyond the caches: it measures memory
 * bandwidth, as a large gradient bucket sees it. Use 1 (MiB) to see the
 * in-cache compute speed. */
#include "mpidp/pack.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *xmalloc(size_t bytes)
{
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    memset(p, 0, bytes);
    return p;
}

enum kernel {
    K_PACK_BF16, K_PACK_BF16_FUSED, K_PACK_FP16, K_UNPACK_BF16, K_UNPACK_BF16_MERGE,
    K_UNPACK_FP16, K_SUM_BF16, K_SUM_FP16, K_SCALE_F32, K_MERGE_F32, K_COUNT
};

static const struct {
    const char *name;
    double bytes_per_elem; /* read + written */
} kinfo[K_COUNT] = {
    {"pack_bf16 (cast)", 4 + 2},
    {"pack_bf16 (s*(x-ref))", 4 + 4 + 2},
    {"pack_fp16 (cast)", 4 + 2},
    {"unpack_bf16 (a=0,b=1)", 2 + 4},
    {"unpack_bf16 (a,b,c,ref)", 2 + 4 + 4 + 4},
    {"unpack_fp16 (a=0,b=1)", 2 + 4},
    {"sum_bf16", 2 + 2 + 2},
    {"sum_fp16", 2 + 2 + 2},
    {"scale_f32", 4 + 4},
    {"merge_f32 (a,b,0,NULL)", 4 + 4 + 4},
};

static float *f_src, *f_ref, *f_dst;
static uint16_t *h_a, *h_b;
static char *scratch;
static size_t scratch_bytes;

/* Evicts the benchmark's buffers from the caches (none when they fit in them
 * anyway, as with a 1 MiB run: then the in-cache speed is what is measured). */
static void flush_caches(void)
{
    if (scratch) memset(scratch, (int)(scratch_bytes & 0x7f), scratch_bytes);
}

static void run(const mpidp_pack_kernels_t *k, enum kernel which, size_t n)
{
    switch (which) {
    case K_PACK_BF16: k->pack_bf16(h_a, f_src, NULL, 1.0f, n); break;
    case K_PACK_BF16_FUSED: k->pack_bf16(h_a, f_src, f_ref, 0.5f, n); break;
    case K_PACK_FP16: k->pack_fp16(h_a, f_src, NULL, 1.0f, n); break;
    case K_UNPACK_BF16: k->unpack_bf16(f_dst, h_a, NULL, 0.0f, 1.0f, 0.0f, n); break;
    case K_UNPACK_BF16_MERGE: k->unpack_bf16(f_dst, h_a, f_ref, 0.5f, 0.25f, 1.0f, n); break;
    case K_UNPACK_FP16: k->unpack_fp16(f_dst, h_a, NULL, 0.0f, 1.0f, 0.0f, n); break;
    case K_SUM_BF16: k->sum_bf16(h_b, h_a, n); break;
    case K_SUM_FP16: k->sum_fp16(h_b, h_a, n); break;
    case K_SCALE_F32: k->scale_f32(f_dst, 1.0f, n); break;
    case K_MERGE_F32: k->merge_f32(f_dst, f_src, NULL, 0.5f, 0.5f, 0.0f, n); break;
    case K_COUNT: break;
    }
}

int main(int argc, char **argv)
{
    size_t mib = argc > 1 ? (size_t)atol(argv[1]) : 64;
    int reps = argc > 2 ? atoi(argv[2]) : 7;
    if (mib == 0 || reps <= 0) {
        fprintf(stderr, "usage: bench_pack [MiB of fp32 > 0] [repeats > 0]\n");
        return 2;
    }
    size_t n = mib * (1u << 20) / sizeof(float);
    f_src = xmalloc(n * sizeof(float));
    f_ref = xmalloc(n * sizeof(float));
    f_dst = xmalloc(n * sizeof(float));
    h_a = xmalloc(n * sizeof(uint16_t));
    h_b = xmalloc(n * sizeof(uint16_t));
    uint64_t st = 88172645463325252ull;
    for (size_t i = 0; i < n; i++) {
        st ^= st << 13;
        st ^= st >> 7;
        st ^= st << 17;
        f_src[i] = (float)(st % 20001) * 1e-3f - 10.0f;
        f_ref[i] = f_src[i] * 0.9f;
    }
    mpidp__pack_ref.pack_bf16(h_a, f_src, NULL, 1.0f, n);
    memcpy(h_b, h_a, n * sizeof(uint16_t));
    if (mib >= 16) {
        scratch_bytes = (size_t)128 << 20;
        scratch = xmalloc(scratch_bytes);
    }

    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        flush_caches();
        double t0 = now();
        memcpy(f_dst, f_src, n * sizeof(float));
        double t = now() - t0;
        if (t < best) best = t;
    }
    double memcpy_gbs = 2.0 * (double)n * sizeof(float) / best / 1e9;
    printf("%zu MiB of fp32 (%zu elements), best of %d; GB/s = (bytes read + written) / s\n",
           mib, n, reps);
    printf("%-26s %-12s %9s %10s\n", "kernel", "path", "GB/s", "x memcpy");
    printf("%-26s %-12s %9.2f %10.2f\n", "memcpy", "libc", memcpy_gbs, 1.0);

    static const char *const paths[] = {"ref", "avx2", "avx512", "avx512_bf16"};
    for (int kk = 0; kk < K_COUNT; kk++) {
        for (size_t p = 0; p < 4; p++) {
            const mpidp_pack_kernels_t *k;
            if (mpidp_pack_kernels_for(paths[p], &k) != 0) continue;
            run(k, (enum kernel)kk, n); /* warm-up */
            best = 1e9;
            for (int r = 0; r < reps; r++) {
                /* sum works in place; refresh its accumulator outside the timing. */
                if (kk == K_SUM_BF16 || kk == K_SUM_FP16) memcpy(h_b, h_a, n * sizeof(uint16_t));
                flush_caches();
                double t0 = now();
                run(k, (enum kernel)kk, n);
                double t = now() - t0;
                if (t < best) best = t;
            }
            double gbs = kinfo[kk].bytes_per_elem * (double)n / best / 1e9;
            printf("%-26s %-12s %9.2f %10.2f\n", kinfo[kk].name, k->name, gbs, gbs / memcpy_gbs);
        }
    }
    free(f_src);
    free(f_ref);
    free(f_dst);
    free(h_a);
    free(h_b);
    free(scratch);
    return 0;
}
