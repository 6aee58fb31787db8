/* Error-feedback compression: DeMo's orthonormal tile DCT-II and its
 * inverse (DCT-III) (mpidp/efcomp.h). Each tile is transformed as two small
 * matrix products in float32; the loops run over the output's columns
 * innermost so that the compiler vectorizes them, and always in the same
 * order, so the same input gives the same bits on every rank. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "efcomp_internal.h"
#include "fail.h"
#include "mpidp/efcomp.h"
#include "mpidp/status.h"

int mpidp_ef_dct_basis(int64_t s, float *basis)
{
    if (s < 1 || s > MPIDP_EF_MAX_CHUNK || basis == NULL)
        return mpidp__fail(MPIDP_EINVAL, "dct basis: expected a side of 1 .. %d, got %lld",
                           MPIDP_EF_MAX_CHUNK, (long long)s);
    const double pi = 3.14159265358979323846;
    for (int64_t j = 0; j < s; j++)
        for (int64_t q = 0; q < s; q++) {
            double a = q == 0 ? sqrt(1.0 / (double)s) : sqrt(2.0 / (double)s);
            basis[j * s + q] = (float)(a * cos(pi * (double)(2 * j + 1) * (double)q / (2.0 * s)));
        }
    return MPIDP_OK;
}

/* The products vectorize over the output's columns; where the CPU has AVX2
 * a clone of each runs 8 columns at a time. Every output element still sums
 * its terms in the same order with separate multiplies and adds
 * (-ffp-contract=off), so every clone gives the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MPIDP_NO_CLONES)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* out (m x n) = A (m x r) times B (r x n), where A(p, i) = a[p * sp + i * si]
 * (A itself: sp = r, si = 1; the transpose of an r x m matrix: sp = 1,
 * si = m). Each output row is summed in a local row, in order of i. */
static inline void mul_rows(const float *a, int64_t sp, int64_t si, int64_t m, int64_t r,
                            const float *b, int64_t n, float *out)
{
    for (int64_t p = 0; p < m; p++) {
        float acc[MPIDP_EF_MAX_CHUNK];
        for (int64_t j = 0; j < n; j++) acc[j] = 0.0f;
        for (int64_t i = 0; i < r; i++) {
            float x = a[p * sp + i * si];
            const float *row = b + i * n;
            for (int64_t j = 0; j < n; j++) acc[j] += x * row[j];
        }
        memcpy(out + p * n, acc, (size_t)n * sizeof *acc);
    }
}

/* Eight floats in a vector register (two halves where the build has no AVX). */
typedef float v8f __attribute__((vector_size(32)));

/* mul_rows for the usual width of 64, by half rows of 32 columns and two rows
 * at a time: 8 accumulators stay in registers and each load of B serves two
 * rows. The same terms in the same order as mul_rows, so the same bits. */
static inline void mul_rows_64(const float *a, int64_t sp, int64_t si, int64_t m, int64_t r,
                               const float *b, float *out)
{
    for (int64_t half = 0; half < 64; half += 32)
        for (int64_t p = 0; p < m; p += 2) {
            int two = p + 1 < m;
            v8f acc0[4] = {{0}}, acc1[4] = {{0}};
            for (int64_t i = 0; i < r; i++) {
                float x0 = a[p * sp + i * si], x1 = two ? a[(p + 1) * sp + i * si] : 0.0f;
                const float *row = b + i * 64 + half;
                for (int q = 0; q < 4; q++) {
                    v8f col;
                    memcpy(&col, row + 8 * q, sizeof col);
                    acc0[q] += x0 * col;
                    acc1[q] += x1 * col;
                }
            }
            memcpy(out + p * 64 + half, acc0, sizeof acc0);
            if (two) memcpy(out + (p + 1) * 64 + half, acc1, sizeof acc1);
        }
}

VECTOR_CLONES static void mul(const float *a, int64_t sp, int64_t si, int64_t m, int64_t r,
                              const float *b, int64_t n, float *out)
{
    if (n == 64)
        mul_rows_64(a, sp, si, m, r, b, out);
    else
        mul_rows(a, sp, si, m, r, b, n, out);
}

static void transpose(const float *a, int64_t m, int64_t n, float *out)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) out[j * m + i] = a[i * n + j];
}

void mpidp__ef_dct_tile(float *tile, int64_t r, int64_t c, const float *basis_rows,
                        const float *basis_cols, const float *cols_t, int inverse, float *work)
{
    if (!inverse) {
        mul(tile, c, 1, r, c, basis_cols, c, work);       /* T Fc */
        mul(basis_rows, 1, r, r, r, work, c, tile);       /* Fr^T (T Fc) */
    } else {
        mul(tile, c, 1, r, c, cols_t, c, work);           /* X Fc^T */
        mul(basis_rows, r, 1, r, r, work, c, tile);       /* Fr (X Fc^T) */
    }
}

int mpidp_ef_dct_tiles(float *tiles, int64_t ntiles, int64_t tile_rows, int64_t tile_cols,
                       const float *basis_rows, const float *basis_cols, int inverse)
{
    if (ntiles < 0 || tile_rows < 1 || tile_cols < 1 || tile_rows > MPIDP_EF_MAX_CHUNK ||
        tile_cols > MPIDP_EF_MAX_CHUNK || basis_rows == NULL || basis_cols == NULL ||
        (ntiles > 0 && tiles == NULL))
        return mpidp__fail(MPIDP_EINVAL, "dct: bad tile shape %lld x %lld or NULL argument",
                           (long long)tile_rows, (long long)tile_cols);
    int64_t len = tile_rows * tile_cols;
    float *work = malloc((size_t)(len + tile_cols * tile_cols) * sizeof *work);
    if (work == NULL) return mpidp__fail(MPIDP_ENOMEM, "dct: no memory for a tile");
    float *cols_t = work + len;
    transpose(basis_cols, tile_cols, tile_cols, cols_t);
    for (int64_t t = 0; t < ntiles; t++)
        mpidp__ef_dct_tile(tiles + t * len, tile_rows, tile_cols, basis_rows, basis_cols, cols_t,
                           inverse, work);
    free(work);
    return MPIDP_OK;
}
