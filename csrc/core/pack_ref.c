/* The scalar reference kernels: the definition every SIMD path must match.
 *
 * Portable C11 with no instruction-set flags. Conversions work on the bit
 * patterns with integer operations, so they are exact by construction and do
 * not depend on the compiler, the FPU's flush-to-zero mode or the rounding mode.
 * Arithmetic is plain fp32: one operation per statement so that no compiler
 * can contract a multiply and an add into an FMA (GCC does not anyway under
 * -std=c11, which implies -ffp-contract=off; clang contracts only within one
 * expression). The SIMD paths call these kernels for their last few elements,
 * so a tail is correct whenever the reference is. */
#include "mpidp/pack.h"
#include "pack_internal.h"

#include <string.h>

#define F32_CANON_NAN 0x7fc00000u
#define F64_CANON_NAN 0x7ff8000000000000ull
#define BF16_CANON_NAN 0x7fc0u
#define FP16_CANON_NAN 0x7e00u

static inline uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* x, or the canonical quiet NaN when x is any NaN. */
static inline float f32_canon(float x)
{
    return x != x ? f32_from_bits(F32_CANON_NAN) : x;
}

static inline double f64_canon(double x)
{
    if (x != x) {
        uint64_t u = F64_CANON_NAN;
        memcpy(&x, &u, sizeof x);
    }
    return x;
}

/* Round to nearest even by adding 0x7FFF plus the lowest kept bit and
 * truncating: a carry out of the mantissa correctly bumps the exponent, and
 * the largest finite floats round up to infinity. NaNs are caught first, since
 * the same addition would turn a NaN with only low payload bits into inf. */
uint16_t mpidp_bf16_from_f32(float x)
{
    uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return BF16_CANON_NAN;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE binary16 has 5 exponent bits (bias 15) and 10 mantissa bits. Magnitudes
 * from 65520 up (half-way between 65504, the largest finite half whose mantissa
 * is odd, and 65536) round to inf. Normal results rebias the exponent and round
 * like bf16 at bit 13. Below 2^-14 the result is subnormal, a multiple of 2^-24:
 * the 24-bit significand is shifted right by 14..24 places with nearest-even
 * rounding; everything up to 2^-25 inclusive (a tie with an even zero) becomes
 * a signed zero, fp32 subnormals included. */
uint16_t mpidp_fp16_from_f32(float x)
{
    uint32_t u = f32_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return FP16_CANON_NAN;
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) {
        a -= 0x38000000u; /* exponent bias 127 -> 15 */
        a += 0x0fffu + ((a >> 13) & 1u);
        return (uint16_t)(sign | (a >> 13));
    }
    if (a < 0x33000000u) return sign;
    uint32_t shift = 126u - (a >> 23);           /* 14..24 */
    uint32_t m = (a & 0x007fffffu) | 0x00800000u; /* implicit bit */
    uint32_t r = (m + ((1u << (shift - 1)) - 1u) + ((m >> shift) & 1u)) >> shift;
    return (uint16_t)(sign | r);
}

float mpidp_f32_from_bf16(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

float mpidp_f32_from_fp16(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return f32_from_bits(sign | 0x7f800000u | (m << 13));
    if (e != 0) return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0) return f32_from_bits(sign);
    /* A subnormal half m * 2^-24 is a normal float: shift the leading one up to
     * the implicit position, lowering the exponent by one per shift. */
    e = 113;
    while (!(m & 0x400u)) {
        m <<= 1;
        e--;
    }
    return f32_from_bits(sign | (e << 23) | ((m & 0x3ffu) << 13));
}

/* The fused pre-step of pack: t = src[i]; minus ref[i]; times s. The tests on
 * ref and s are the same in every path, so every path runs the same operations. */
static inline float pack_pre(const float *src, const float *ref, float s, int scale,
                             size_t i)
{
    float t = src[i];
    if (ref) t = t - ref[i];
    if (scale) t = t * s;
    return t;
}

static void pack_bf16_ref(uint16_t *dst, const float *src, const float *ref, float s,
                          size_t n)
{
    int scale = s != 1.0f;
    for (size_t i = 0; i < n; i++)
        dst[i] = mpidp_bf16_from_f32(pack_pre(src, ref, s, scale, i));
}

static void pack_fp16_ref(uint16_t *dst, const float *src, const float *ref, float s,
                          size_t n)
{
    int scale = s != 1.0f;
    for (size_t i = 0; i < n; i++)
        dst[i] = mpidp_fp16_from_f32(pack_pre(src, ref, s, scale, i));
}

/* The merge formula shared by unpack and merge_f32, w being the widened source:
 * t = b*w; t = (a*d) + t when a != 0; t = t + (c*r) when ref != NULL. */
static inline float merge_one(float w, float *dst, const float *ref, float a, float b,
                              float c, int use_dst, size_t i)
{
    float t = b * w;
    if (use_dst) {
        float u = a * dst[i];
        t = u + t;
    }
    if (ref) {
        float v = c * ref[i];
        t = t + v;
    }
    return f32_canon(t);
}

static void unpack_bf16_ref(float *dst, const uint16_t *src, const float *ref, float a,
                            float b, float c, size_t n)
{
    int use_dst = a != 0.0f;
    for (size_t i = 0; i < n; i++)
        dst[i] = merge_one(mpidp_f32_from_bf16(src[i]), dst, ref, a, b, c, use_dst, i);
}

static void unpack_fp16_ref(float *dst, const uint16_t *src, const float *ref, float a,
                            float b, float c, size_t n)
{
    int use_dst = a != 0.0f;
    for (size_t i = 0; i < n; i++)
        dst[i] = merge_one(mpidp_f32_from_fp16(src[i]), dst, ref, a, b, c, use_dst, i);
}

static void merge_f32_ref(float *dst, const float *src, const float *ref, float a,
                          float b, float c, size_t n)
{
    int use_dst = a != 0.0f;
    for (size_t i = 0; i < n; i++)
        dst[i] = merge_one(src[i], dst, ref, a, b, c, use_dst, i);
}

static void sum_bf16_ref(uint16_t *inout, const uint16_t *in, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float t = mpidp_f32_from_bf16(in[i]) + mpidp_f32_from_bf16(inout[i]);
        inout[i] = mpidp_bf16_from_f32(t);
    }
}

static void sum_fp16_ref(uint16_t *inout, const uint16_t *in, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float t = mpidp_f32_from_fp16(in[i]) + mpidp_f32_from_fp16(inout[i]);
        inout[i] = mpidp_fp16_from_f32(t);
    }
}

static void scale_f32_ref(float *x, float s, size_t n)
{
    for (size_t i = 0; i < n; i++) x[i] = f32_canon(x[i] * s);
}

static void scale_f64_ref(double *x, double s, size_t n)
{
    for (size_t i = 0; i < n; i++) x[i] = f64_canon(x[i] * s);
}

const mpidp_pack_kernels_t mpidp__pack_ref = {
    .name = "ref",
    .isa = "portable C",
    .pack_bf16 = pack_bf16_ref,
    .pack_fp16 = pack_fp16_ref,
    .unpack_bf16 = unpack_bf16_ref,
    .unpack_fp16 = unpack_fp16_ref,
    .sum_bf16 = sum_bf16_ref,
    .sum_fp16 = sum_fp16_ref,
    .scale_f32 = scale_f32_ref,
    .scale_f64 = scale_f64_ref,
    .merge_f32 = merge_f32_ref,
};
