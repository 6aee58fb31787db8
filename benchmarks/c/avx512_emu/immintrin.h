/* A stand-in <immintrin.h> that lets csrc/core/pack_avx512.c run on a CPU
 * without AVX-512, for `make -C benchmarks/c avx512-emu` only.
 *
 * The AVX-512 kernels cannot run on the machines mpidp is developed on. This
 * header maps the intrinsics to SIMDe (Debian: libsimde-dev), a portable C
 * implementation, so the kernels' logic (lane order, masks, the NaN and
 * subnormal patching of VCVTNEPS2BF16) runs through the same tests as the
 * other paths. It checks the algorithm, not the compiler's AVX-512 code; the
 * start-up self-check covers that on real hardware.
 *
 * SIMDe 0.7 lacks a few intrinsics the kernels use; they are written out here
 * lane by lane. VCVTNEPS2BF16 follows Intel's pseudocode: denormal inputs become
 * a signed zero, NaNs keep their payload with the quiet bit set, everything else
 * rounds to nearest even. */
#ifndef MPIDP_AVX512_EMU_IMMINTRIN_H
#define MPIDP_AVX512_EMU_IMMINTRIN_H

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

#include <stdint.h>
#include <string.h>

typedef simde__mmask16 __mmask16;
typedef simde__mmask8 __mmask8;

/* GCC's own headers may already declare these names. */
#define __m256bh emu_m256bh
#define _mm512_cvtneps_pbh emu_cvtneps_pbh
typedef simde__m256i __m256bh;

static inline uint16_t emu_cvtne(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t e = (x >> 23) & 0xff, m = x & 0x7fffff;
    if (e == 0) return (uint16_t)((x >> 16) & 0x8000);
    if (e == 0xff && m == 0) return (uint16_t)(x >> 16);
    if (e == 0xff) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

static inline __m256bh emu_cvtneps_pbh(simde__m512 v)
{
    float f[16];
    uint16_t o[16];
    simde_mm512_storeu_ps(f, v);
    for (int i = 0; i < 16; i++) o[i] = emu_cvtne(f[i]);
    return simde_mm256_loadu_si256((const void *)o);
}

static inline __mmask16 _kor_mask16(__mmask16 a, __mmask16 b) { return a | b; }

static inline simde__m256i _mm512_cvtepi32_epi16(simde__m512i v)
{
    uint32_t a[16];
    uint16_t o[16];
    simde_mm512_storeu_si512((void *)a, v);
    for (int i = 0; i < 16; i++) o[i] = (uint16_t)a[i];
    return simde_mm256_loadu_si256((const void *)o);
}

static inline simde__m512i _mm512_cvtepu16_epi32(simde__m256i v)
{
    uint16_t a[16];
    uint32_t o[16];
    simde_mm256_storeu_si256((void *)a, v);
    for (int i = 0; i < 16; i++) o[i] = a[i];
    return simde_mm512_loadu_si512((const void *)o);
}

static inline __mmask16 _mm512_cmplt_epu32_mask(simde__m512i x, simde__m512i y)
{
    uint32_t a[16], b[16];
    __mmask16 m = 0;
    simde_mm512_storeu_si512((void *)a, x);
    simde_mm512_storeu_si512((void *)b, y);
    for (int i = 0; i < 16; i++) m |= (__mmask16)((a[i] < b[i]) << i);
    return m;
}

static inline __mmask16 emu_cmpgt_epi32_mask(simde__m512i x, simde__m512i y)
{
    int32_t a[16], b[16];
    __mmask16 m = 0;
    simde_mm512_storeu_si512((void *)a, x);
    simde_mm512_storeu_si512((void *)b, y);
    for (int i = 0; i < 16; i++) m |= (__mmask16)((a[i] > b[i]) << i);
    return m;
}
#undef _mm512_cmpgt_epi32_mask
#define _mm512_cmpgt_epi32_mask emu_cmpgt_epi32_mask

static inline simde__m256i _mm512_cvtps_ph(simde__m512 v, int imm)
{
    (void)imm; /* the kernels always round to nearest even */
    float f[16];
    simde_mm512_storeu_ps(f, v);
    simde__m128i lo = simde_mm256_cvtps_ph(simde_mm256_loadu_ps(f), 0);
    simde__m128i hi = simde_mm256_cvtps_ph(simde_mm256_loadu_ps(f + 8), 0);
    return simde_mm256_set_m128i(hi, lo);
}

static inline simde__m512 _mm512_cvtph_ps(simde__m256i v)
{
    simde__m256 lo = simde_mm256_cvtph_ps(simde_mm256_castsi256_si128(v));
    simde__m256 hi = simde_mm256_cvtph_ps(simde_mm256_extracti128_si256(v, 1));
    float f[16];
    simde_mm256_storeu_ps(f, lo);
    simde_mm256_storeu_ps(f + 8, hi);
    return simde_mm512_loadu_ps(f);
}

#endif /* MPIDP_AVX512_EMU_IMMINTRIN_H */
