/* Test helpers for the pack kernels: bit casts, a deterministic generator, and
 * an oracle for correct rounding that shares no code with the kernels.
 * Included by test_pack.c and test_pack_exhaustive.c. */
#ifndef MPIDP_PACK_ORACLE_H
#define MPIDP_PACK_ORACLE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "mpidp/pack.h"
#include "mpidp/status.h"

static inline uint32_t fbits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float ffrom(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* xorshift64*: deterministic, so a failure reproduces. */
static inline uint64_t oracle_rnd(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545f4914f6cdd1dull;
}

/* Correct rounding of a double to a binary format with p significand bits
 * (implicit bit included), whose smallest normal has frexp exponent emin and
 * whose largest finite value is maxf. Scaling by powers of two is exact, and
 * nearbyint rounds to nearest even in the default rounding mode. */
static inline double oracle_round(double x, int p, int emin, double maxf)
{
    if (x != x || isinf(x) || x == 0.0) return x;
    int e;
    frexp(x, &e);
    if (e < emin) e = emin;
    double r = ldexp(nearbyint(ldexp(x, p - e)), e - p);
    if (fabs(r) > maxf) return copysign(INFINITY, x);
    return r;
}

/* The correctly rounded bf16 of x (canonical NaN). */
static inline uint16_t oracle_bf16(double x)
{
    if (x != x) return 0x7fc0;
    /* The rounded value is a float whose 16 low bits are zero. */
    return (uint16_t)(fbits((float)oracle_round(x, 8, -125, 0x1.fep127)) >> 16);
}

/* The correctly rounded IEEE binary16 of x (canonical NaN). */
static inline uint16_t oracle_fp16(double x)
{
    if (x != x) return 0x7e00;
    double r = oracle_round(x, 11, -13, 65504.0);
    uint16_t sign = signbit(r) ? 0x8000 : 0;
    double a = fabs(r);
    if (isinf(a)) return sign | 0x7c00;
    if (a < 0x1p-14) return sign | (uint16_t)(a * 0x1p24);
    int e = ilogb(a);
    return sign | (uint16_t)((e + 15) << 10) | (uint16_t)((ldexp(a, -e) - 1.0) * 1024.0);
}

/* Every path this CPU and build can run, the reference first. */
static inline size_t oracle_paths(const mpidp_pack_kernels_t *out[4])
{
    static const char *const names[] = {"ref", "avx2", "avx512", "avx512_bf16"};
    size_t n = 0;
    for (size_t i = 0; i < 4; i++) {
        const mpidp_pack_kernels_t *k;
        if (mpidp_pack_kernels_for(names[i], &k) == MPIDP_OK) out[n++] = k;
    }
    return n;
}

#endif /* MPIDP_PACK_ORACLE_H */
