/* Which 8-bit quantizer path runs (mpidp/quant8.h): the one of the pack path
 * in use, after a bit-for-bit self-check against the reference. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/pack.h"
#include "mpidp/quant8.h"
#include "mpidp/status.h"
#include "quant8_elem.h"
#include "fail.h"
#include "quant8_internal.h"

int mpidp_q8_kernels_for(const char *name, const mpidp_q8_kernels_t **out)
{
    if (out == NULL) return mpidp__fail(MPIDP_EINVAL, "quant8: NULL argument");
    *out = NULL;
    if (name == NULL) return mpidp__fail(MPIDP_EINVAL, "quant8: NULL path name");
    if (strcmp(name, "ref") == 0) {
        *out = &mpidp__q8_ref;
        return MPIDP_OK;
    }
    /* The pack dispatch knows whether this CPU and build can run the path. */
    const mpidp_pack_kernels_t *pk;
    int rc = mpidp_pack_kernels_for(name, &pk);
    if (rc != MPIDP_OK) return rc;
    *out = strcmp(name, "avx2") == 0 ? mpidp__q8_avx2_table() : mpidp__q8_avx512_table();
    if (*out == NULL || (*out)->encode == NULL)
        return mpidp__fail(MPIDP_ENOTSUP, "quant8: this build has no %s path", name);
    return MPIDP_OK;
}

static _Atomic(const mpidp_pack_kernels_t *) checked_for; /* the pack table it follows */
static _Atomic(const mpidp_q8_kernels_t *) current;
static char fallback_reason[256];

const mpidp_q8_kernels_t *mpidp_q8_kernels(void)
{
    const mpidp_pack_kernels_t *pk = mpidp_pack_kernels();
    const mpidp_q8_kernels_t *k = atomic_load(&current);
    if (k != NULL && atomic_load(&checked_for) == pk) return k;
    /* The pack path changed (or this is the first call): follow it. Two
     * threads may both get here; each stores the same answer. */
    const char *name = strncmp(pk->name, "avx512", 6) == 0 ? "avx512" : pk->name;
    const mpidp_q8_kernels_t *chosen = &mpidp__q8_ref;
    char why[200] = "";
    if (mpidp_q8_kernels_for(name, &k) == MPIDP_OK && k != &mpidp__q8_ref) {
        if (mpidp__q8_selfcheck(k, why, sizeof why) == 0) chosen = k;
        else snprintf(fallback_reason, sizeof fallback_reason, "quant8 %s: %s", name, why);
    }
    mpidp_error_clear(); /* a path this build lacks is not the caller's error */
    atomic_store(&current, chosen);
    atomic_store(&checked_for, pk);
    return chosen;
}

const char *mpidp_q8_fallback_reason(void) { return fallback_reason; }

/* ---- The self-check: every kernel against the reference, bit for bit. ---- */

static uint64_t next_random(uint64_t *state)
{
    uint64_t x = *state; /* xorshift64*: deterministic, so a failure reproduces */
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545f4914f6cdd1dull;
}

/* Block b of the input: a different kind of data in each (ordinary numbers,
 * tiny and huge ranges, constants, signed zeros, +-FLT_MAX, subnormals, any
 * bit pattern including NaN and infinities). */
static void fill(float *x, size_t n, uint64_t seed)
{
    uint64_t st = seed | 1;
    for (size_t i = 0; i < n; i++) {
        uint64_t r = next_random(&st);
        uint32_t u;
        switch ((i / MPIDP_Q8_BLOCK) % 7) {
        case 0: x[i] = (float)((int64_t)(r >> 40) - (1 << 23)) * 0x1p-20f; continue;
        case 1: x[i] = 5e4f + (float)(r % 300) * 0x1p-8f; continue;     /* 5e4 + k ulp */
        case 2: x[i] = (r & 1) ? -0.0f : 0.0f; continue;
        case 3: u = (uint32_t)(r >> 45) | (uint32_t)(r & 1) << 31; break; /* subnormals */
        case 4: x[i] = (r & 1) ? 3.4028235e38f : -3.4028235e38f; continue;
        case 5: x[i] = 1e30f * (float)((int)(r % 3) - 1); continue;
        default: u = (uint32_t)(r >> 32); break;                        /* anything */
        }
        memcpy(&x[i], &u, sizeof u);
    }
}

static int compare(const void *got, const void *want, size_t bytes, const char *what, size_t n,
                   float s, char *why, size_t why_len)
{
    if (memcmp(got, want, bytes) == 0) return 0;
    size_t i = 0;
    while (((const uint8_t *)got)[i] == ((const uint8_t *)want)[i]) i++;
    snprintf(why, why_len, "%s (n=%zu, s=%g) differs from the reference at byte %zu", what, n,
             (double)s, i);
    return 1;
}

int mpidp__q8_selfcheck(const mpidp_q8_kernels_t *k, char *why, size_t why_len)
{
    static const size_t lengths[] = {1, 7, 8, 15, 16, 17, 255, 256, 257, 300, 7 * 256 + 13};
    static const float scales[] = {1.0f, 0.375f, -3.5f};
    enum { MAXN = 7 * 256 + 13 + 1 };
    if (k == NULL || k->encode == NULL || k->decode == NULL) {
        snprintf(why, why_len, "a missing kernel");
        return 1;
    }
    float *src = malloc(MAXN * sizeof *src), *got = malloc(MAXN * sizeof *got),
          *want = malloc(MAXN * sizeof *want);
    uint8_t *qg = malloc(mpidp_q8_bytes(MAXN)), *qw = malloc(mpidp_q8_bytes(MAXN));
    int bad = src == NULL || got == NULL || want == NULL || qg == NULL || qw == NULL;
    if (bad) snprintf(why, why_len, "out of memory for the self-check");
    for (size_t li = 0; !bad && li < sizeof lengths / sizeof *lengths; li++) {
        size_t n = lengths[li], bytes = mpidp_q8_bytes(n);
        for (size_t si = 0; !bad && si < sizeof scales / sizeof *scales; si++) {
            float s = scales[si];
            fill(src, MAXN, n * 131 + si);
            /* src + 1: an unaligned source. */
            k->encode(qg, src + 1, s, n);
            mpidp__q8_ref.encode(qw, src + 1, s, n);
            bad = compare(qg, qw, bytes, "encode", n, s, why, why_len);
            for (int acc = 0; !bad && acc < 2; acc++) {
                fill(got, MAXN, n + 7);
                memcpy(want, got, MAXN * sizeof *got);
                k->decode(got + 1, qw, acc, n);
                mpidp__q8_ref.decode(want + 1, qw, acc, n);
                bad = compare(got, want, MAXN * sizeof *got, acc ? "decode-accumulate" : "decode",
                              n, s, why, why_len);
            }
        }
    }
    free(src), free(got), free(want), free(qg), free(qw);
    return bad;
}
