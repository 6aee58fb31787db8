/* Error-feedback compression kernels: the building blocks of SparseLoCo and
 * DeMo (docs/error-feedback.md gives the rules and the exact arithmetic).
 *
 * Every kernel works on a float32 tensor in its own (row-major) layout and
 * a tiling of it: the tensor is viewed as rows x cols (1-D: 1 x n; 0-d:
 * 1 x 1; more dimensions: dim0 x the rest) and cut into tiles of
 * tile_rows x tile_cols, numbered row-major over the grid of tiles; inside
 * a tile, slot = row * tile_cols + col. Tile sides divide the tensor's, so
 * no tile is padded.
 *
 * A compressed tensor travels as a payload of fixed size (the same on every
 * rank for one tensor and one setting, so a bucket of them goes through one
 * MPI_Iallgather):
 *   quantized (bins > 0):  [mu f32][lookup f32 x bins][slot u16 x ntiles*k]
 *                          [codes, bits each, packed low bits first]
 *   plain (bins == 0):     [slot u16 x ntiles*k][value f32 x ntiles*k]
 * All little-endian; each tile's k slots are strictly increasing. Where k is
 * the tile's length (dense: every entry kept, MuLoCo's quantized deltas) the
 * slots are 0 .. k-1 in order and are left out of the payload. Readers of
 * gathered payloads check that (a slot outside its tile, a repeat or a code
 * outside the bins is MPIDP_EINVAL), so bytes from the wire can never make
 * a kernel write out of bounds. */
#ifndef MPIDP_EFCOMP_H
#define MPIDP_EFCOMP_H

#include <stddef.h>
#include <stdint.h>

/* Largest tile side: slots travel as 16 bits, so a tile holds <= 65536. */
#define MPIDP_EF_MAX_CHUNK 256
#define MPIDP_EF_MAX_BINS 256

typedef struct {
    int64_t rows, cols;           /* the tensor viewed as rows x cols */
    int64_t tile_rows, tile_cols; /* dividing rows and cols */
} mpidp_ef_tiling_t;

/* The largest divisor of n that is <= chunk (n itself when n <= chunk; 1 for
 * a prime n > chunk). n >= 1, chunk >= 1. */
int64_t mpidp_ef_tile_side(int64_t n, int64_t chunk);
/* The tiling of a tensor of `ndim` dimensions `sizes` (every size >= 1) with
 * tile sides of at most `chunk` (1 .. MPIDP_EF_MAX_CHUNK). */
int mpidp_ef_tiling(int ndim, const int64_t *sizes, int64_t chunk, mpidp_ef_tiling_t *out);
int64_t mpidp_ef_ntiles(const mpidp_ef_tiling_t *t);
int64_t mpidp_ef_tile_len(const mpidp_ef_tiling_t *t);
/* The flat index in the tensor of slot `slot` of tile `tile`. */
int64_t mpidp_ef_index(const mpidp_ef_tiling_t *t, int64_t tile, int64_t slot);

/* Bits per code for `bins` (2 .. 256): the smallest of 1, 2, 4, 8 that holds them. */
int mpidp_ef_code_bits(int bins);
/* Payload bytes of one tensor: ntiles tiles of len entries, k kept of each
 * (k == len: dense, no slots), `bins` quantizer bins (0: plain float32
 * values). -1 for arguments out of range. */
int64_t mpidp_ef_payload_bytes(int64_t ntiles, int64_t len, int64_t k, int bins);

/* Per-tile top-k of `tiles` (ntiles x len, tile-major): the k entries of
 * largest magnitude of each tile, written as strictly increasing slots with
 * their values. Ties go to the lower slot; NaN ranks above every number.
 * 1 <= k <= len <= 65536. */
int mpidp_ef_topk(const float *tiles, int64_t ntiles, int64_t len, int64_t k, uint16_t *slots,
                  float *values);

/* The statistical quantizer over v[0..n): codes[i] in [0, bins), *mu and
 * lookup[0..bins) such that v[i] decodes to lookup[codes[i]] + *mu. */
int mpidp_ef_quantize(const float *v, int64_t n, int bins, double range, uint8_t *codes,
                      float *mu, float *lookup);
/* Packs n codes of `bits` bits (1, 2, 4 or 8) into ceil(n*bits/8) bytes,
 * code i at bit (i * bits) % 8 of byte i*bits/8; unused high bits are 0. */
void mpidp_ef_pack_codes(const uint8_t *codes, int64_t n, int bits, uint8_t *out);
/* The inverse; MPIDP_EINVAL if a code is >= bins. */
int mpidp_ef_unpack_codes(const uint8_t *in, int64_t n, int bits, int bins, uint8_t *codes);

/* SparseLoCo's compression of one tensor (steps 6-9 of its round):
 *   e <- beta * e + alpha * delta   (delta NULL: a zero delta)
 *   keep the top k of each tile of e, quantize them (bins > 0)
 *   e <- e - what the payload decodes to, so e keeps every error
 *   write the payload (mpidp_ef_payload_bytes(ntiles, len, k, bins) bytes).
 * e and delta are the tensor's numel float32 in its own layout. */
int mpidp_ef_compress(const mpidp_ef_tiling_t *t, float *e, const float *delta, float beta,
                      float alpha, int64_t k, int bins, double range, uint8_t *payload);

/* The sparse mean of R ranks' payloads of one tensor, rank r's at
 * gathered + r * stride, decoded in rank order (so every rank computes the
 * same bits): out[c] = sum_r v_r[c] / (number of ranks that sent c, or R
 * when divide_by_all), 0 where no rank sent c. out is numel float32 in the
 * tensor's layout (tile_major = 0) or tile-major (tile_major = 1).
 * MPIDP_EINVAL, out partly written, for a payload that breaks the layout. */
int mpidp_ef_sparse_mean(const mpidp_ef_tiling_t *t, const uint8_t *gathered, size_t stride,
                         int R, int64_t k, int bins, int divide_by_all, int tile_major,
                         float *out);

/* The orthonormal DCT-II matrix of side s (1 .. MPIDP_EF_MAX_CHUNK):
 * basis[j*s + q] = a_q cos(pi (2j+1) q / (2s)), a_0 = sqrt(1/s), a_q = sqrt(2/s). */
int mpidp_ef_dct_basis(int64_t s, float *basis);
/* In place over tile-major tiles: X = Fr^T T Fc (inverse = 0) or
 * T = Fr X Fc^T (inverse = 1), Fr and Fc the bases of the tile's sides. */
int mpidp_ef_dct_tiles(float *tiles, int64_t ntiles, int64_t tile_rows, int64_t tile_cols,
                       const float *basis_rows, const float *basis_cols, int inverse);

/* DeMo's compression of one tensor (steps 3-6 of its step):
 *   delta <- beta * delta + lr * grad   (grad NULL: a zero gradient)
 *   X = the DCT of each tile of delta; keep the top k of each tile of X
 *   delta <- delta - the inverse DCT of what is kept
 *   write the plain payload (bins 0) of the kept coefficients. */
int mpidp_ef_demo_compress(const mpidp_ef_tiling_t *t, float *delta, const float *grad,
                           float beta, float lr, int64_t k, const float *basis_rows,
                           const float *basis_cols, uint8_t *payload);
/* DeMo's aggregate: the sparse mean (S4) of the gathered coefficients,
 * inverse-transformed, into out (numel float32, the tensor's layout). */
int mpidp_ef_demo_decode(const mpidp_ef_tiling_t *t, const uint8_t *gathered, size_t stride,
                         int R, int64_t k, const float *basis_rows, const float *basis_cols,
                         float *out);

#endif /* MPIDP_EFCOMP_H */
