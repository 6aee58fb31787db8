/* Shared by the libFuzzer harnesses: a byte reader that turns the fuzzer's
 * input into integers and doubles, biased towards the values that break code
 * (0, -1, the int64 and int32 limits, powers of two, NaN, infinities), and a
 * failure macro that aborts so libFuzzer records the input as a crash.
 *
 * Encoding (make_seeds.py writes seeds in it, so keep the two in step):
 *   fz_int(lo, hi): one selector byte k.
 *       k <  0xC0  lo + k % (hi - lo + 1)       (a "normal" value)
 *       k <  0xE0  FZ_SPECIAL[k - 0xC0]          (32 edge values)
 *       otherwise  the next 8 bytes, little-endian, as int64
 *   fz_double(): one selector byte k.
 *       k <  0x80  k / 8.0                       (0 .. 15.875)
 *       k <  0xA0  -(k - 0x80) / 8.0
 *       k <  0xC0  FZ_SPECIAL_D[k - 0xA0]         (NaN, infinities, limits)
 *       otherwise  the next 8 bytes as the bits of a double
 * Reading past the end of the input yields zero bytes, so every input is
 * accepted and a short input simply means "mostly zeros". */
#ifndef MPIDP_FUZZ_COMMON_H
#define MPIDP_FUZZ_COMMON_H

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const uint8_t *p;
    size_t n;
} fz_t;

static inline uint8_t fz_u8(fz_t *f)
{
    if (f->n == 0) return 0;
    f->n--;
    return *f->p++;
}

static inline uint64_t fz_u64(fz_t *f)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)fz_u8(f) << (8 * i);
    return v;
}

static inline int fz_empty(const fz_t *f) { return f->n == 0; }

static const int64_t FZ_SPECIAL[32] = {
    0,
    1,
    -1,
    2,
    -2,
    INT64_MAX,
    INT64_MIN,
    INT64_MAX - 1,
    INT64_MIN + 1,
    INT32_MAX,
    INT32_MIN,
    (int64_t)UINT32_MAX,
    (int64_t)1 << 31,
    (int64_t)1 << 32,
    (int64_t)1 << 62,
    -((int64_t)1 << 62),
    INT64_MAX / 2,
    INT64_MAX / 2 + 1,
    INT64_MAX / 4 + 1,
    INT64_MAX / 8 + 1,
    3037000499,  /* floor(sqrt(INT64_MAX)) */
    3037000500,
    ((int64_t)1 << 32) + 1,
    65535,
    65536,
    255,
    256,
    7,
    8,
    1000000007,
    INT64_MAX - 2,
    ((int64_t)1 << 61) + 1,
};

static inline int64_t fz_int(fz_t *f, int64_t lo, int64_t hi)
{
    uint8_t k = fz_u8(f);
    if (k < 0xC0) return lo + (int64_t)(k % (uint64_t)(hi - lo + 1));
    if (k < 0xE0) return FZ_SPECIAL[k - 0xC0];
    return (int64_t)fz_u64(f);
}

static inline double fz_bits_to_double(uint64_t bits)
{
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

static inline double fz_double(fz_t *f)
{
    uint8_t k = fz_u8(f);
    if (k < 0x80) return k / 8.0;
    if (k < 0xA0) return -(double)(k - 0x80) / 8.0;
    if (k < 0xC0) {
        switch (k - 0xA0) {
        case 0: return NAN;
        case 1: return -NAN;
        case 2: return INFINITY;
        case 3: return -INFINITY;
        case 4: return 0.0;
        case 5: return -0.0;
        case 6: return DBL_MAX;
        case 7: return -DBL_MAX;
        case 8: return DBL_MIN;
        case 9: return -DBL_MIN;
        case 10: return DBL_TRUE_MIN;
        case 11: return 1e300;
        case 12: return -1e300;
        case 13: return 1e-300;
        case 14: return 1.0;
        case 15: return -1.0;
        case 16: return 0.5;
        case 17: return 0.95;
        case 18: return 0.999999999;
        case 19: return 1.0 - DBL_EPSILON / 2;
        case 20: return 1.0 + DBL_EPSILON;
        case 21: return 9007199254740993.0; /* 2^53 + 1, rounded */
        case 22: return (double)INT64_MAX;
        case 23: return 1e-5;
        case 24: return 4.0;
        case 25: return 3.9;
        case 26: return 100.0;
        case 27: return 0.05;
        case 28: return 0.01;
        case 29: return 0.2;
        case 30: return fz_bits_to_double(0x7ff0000000000001ull); /* signalling NaN */
        default: return fz_bits_to_double(0xfff8000000000123ull); /* NaN with payload */
        }
    }
    return fz_bits_to_double(fz_u64(f));
}

/* A broken invariant: say which and abort, so libFuzzer saves the input. */
#define FZ_CHECK(cond, ...)                                                     \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "\nINVARIANT BROKEN %s:%d: %s\n  ", __FILE__,        \
                    __LINE__, #cond);                                           \
            fprintf(stderr, __VA_ARGS__);                                       \
            fputc('\n', stderr);                                                \
            abort();                                                            \
        }                                                                       \
    } while (0)

#endif /* MPIDP_FUZZ_COMMON_H */
