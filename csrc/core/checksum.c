/* 64-bit checksum (see mpidp/checksum.h). The mixing follows the well-known
 * multiply-xorshift construction (constants from the 64-bit golden ratio and
 * splitmix64's finaliser). */
#include "mpidp/checksum.h"

#include <string.h>

#define K0 UINT64_C(0x9E3779B97F4A7C15)
#define K1 UINT64_C(0xBF58476D1CE4E5B9)
#define K2 UINT64_C(0x94D049BB133111EB)

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t round64(uint64_t acc, uint64_t word)
{
    acc ^= word * K1;
    return rotl(acc, 29) * K0;
}

static inline uint64_t finish(uint64_t h)
{
    h ^= h >> 30;
    h *= K1;
    h ^= h >> 27;
    h *= K2;
    return h ^ (h >> 31);
}

uint64_t mpidp_checksum64(const void *data, size_t bytes, uint64_t seed)
{
    const unsigned char *p = data;
    uint64_t a = seed ^ K0, b = seed + K1, c = rotl(seed, 17) ^ K2, d = ~seed;
    size_t i = 0;
    for (; i + 32 <= bytes; i += 32) {
        uint64_t w[4];
        memcpy(w, p + i, sizeof w); /* unaligned-safe; compiles to plain loads */
        a = round64(a, w[0]);
        b = round64(b, w[1]);
        c = round64(c, w[2]);
        d = round64(d, w[3]);
    }
    uint64_t h = rotl(a, 1) + rotl(b, 7) + rotl(c, 12) + rotl(d, 18);
    for (; i + 8 <= bytes; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, sizeof w);
        h = round64(h, w);
    }
    uint64_t tail = 0;
    if (i < bytes) memcpy(&tail, p + i, bytes - i);
    h = round64(h, tail ^ ((uint64_t)(bytes - i) << 56));
    return finish(h ^ (uint64_t)bytes);
}
