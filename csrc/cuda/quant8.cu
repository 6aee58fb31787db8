// The 8-bit block quantizer on CUDA devices (mpidp/quant8.h for the format
// and the arithmetic, mpidp/cuda.h for the launch contract).
//
// One thread block of 256 threads per quantization block, one element per
// thread. The bounds are a shared-memory min/max reduction (exact in any
// order; canonicalised with + 0.0f as on the host), the block's constants
// come from the very function the host paths use (mpidp__q8_block_params,
// __host__ __device__), and every fp32 operation is a __f*_rn intrinsic in
// the reference's order, so the records and decoded values equal the CPU
// reference's bit for bit.
#include "mpidp/cuda.h"
#include "mpidp/quant8.h"

extern "C" {
#include "mpidp/status.h"
#include "../core/fail.h"
#include "../core/quant8_internal.h"
}

#include <cuda_runtime.h>

#include <stdint.h>

namespace {

constexpr unsigned kMaxGrid = 65535;
constexpr uint32_t kCanonNan = 0x7fc00000u;
static_assert(MPIDP_Q8_BLOCK == 256, "one thread per element of a block");

__device__ float scaled(float x, float s) { return s != 1.0f ? __fmul_rn(x, s) : x; }

__device__ float read_f32(const uint8_t *p)
{
    float x;
    memcpy(&x, p, sizeof x);
    return x;
}

__global__ void __launch_bounds__(MPIDP_Q8_BLOCK)
encode_kernel(uint8_t *dst, const float *src, float s, size_t n)
{
    __shared__ float mn[MPIDP_Q8_BLOCK], mx[MPIDP_Q8_BLOCK];
    __shared__ mpidp_q8_block_t b;
    const unsigned i = threadIdx.x;
    for (size_t blk = blockIdx.x; blk * MPIDP_Q8_BLOCK < n; blk += gridDim.x) {
        size_t at = blk * MPIDP_Q8_BLOCK;
        size_t len = n - at < MPIDP_Q8_BLOCK ? n - at : MPIDP_Q8_BLOCK;
        // Threads past the end stand in with element 0: neutral for min/max.
        float t = scaled(src[at + (i < len ? i : 0)], s);
        int finite = __fsub_rn(t, t) == 0.0f;
        mn[i] = t;
        mx[i] = t;
        finite = __syncthreads_and(finite);
        for (unsigned half = MPIDP_Q8_BLOCK / 2; half > 0; half /= 2) {
            if (i < half) {
                mn[i] = mn[i + half] < mn[i] ? mn[i + half] : mn[i];
                mx[i] = mx[i + half] > mx[i] ? mx[i + half] : mx[i];
            }
            __syncthreads();
        }
        uint8_t *rec = dst + blk * MPIDP_Q8_RECORD;
        if (i == 0) {
            float nan = __uint_as_float(kCanonNan);
            float lo = finite ? __fadd_rn(mn[0], 0.0f) : nan;
            float hi = finite ? __fadd_rn(mx[0], 0.0f) : nan;
            memcpy(rec, &lo, sizeof lo);
            memcpy(rec + sizeof lo, &hi, sizeof hi);
            b = mpidp__q8_block_params(lo, hi);
        }
        __syncthreads();
        uint8_t code = 0;
        if (b.finite && i < len) {
            float d = __fsub_rn(__fmul_rn(t, b.p), b.lop);
            float r = rintf(__fmul_rn(d, b.inv));
            r = r < 0.0f ? 0.0f : r;
            r = r > 255.0f ? 255.0f : r;
            code = (uint8_t)r;
        }
        rec[MPIDP_Q8_HEADER + i] = code;
        __syncthreads(); // mn, mx and b are reused by the next block
    }
}

__global__ void __launch_bounds__(MPIDP_Q8_BLOCK)
decode_kernel(float *dst, const uint8_t *src, int accumulate, size_t n)
{
    const unsigned i = threadIdx.x;
    const float nan = __uint_as_float(kCanonNan);
    for (size_t blk = blockIdx.x; blk * MPIDP_Q8_BLOCK < n; blk += gridDim.x) {
        size_t at = blk * MPIDP_Q8_BLOCK;
        if (at + i >= n) continue;
        const uint8_t *rec = src + blk * MPIDP_Q8_RECORD;
        mpidp_q8_block_t b = mpidp__q8_block_params(read_f32(rec), read_f32(rec + 4));
        float x = nan;
        if (b.finite) {
            x = __fmul_rn((float)rec[MPIDP_Q8_HEADER + i], b.step);
            x = __fadd_rn(x, b.lop);
            x = __fmul_rn(x, b.unp);
            x = x < b.lo ? b.lo : x;
            x = x > b.hi ? b.hi : x;
        }
        if (accumulate) x = __fadd_rn(dst[at + i], x);
        dst[at + i] = x != x ? nan : x;
    }
}

unsigned grid_for(size_t n)
{
    size_t blocks = (n + MPIDP_Q8_BLOCK - 1) / MPIDP_Q8_BLOCK;
    return (unsigned)(blocks < kMaxGrid ? blocks : kMaxGrid);
}

int launched(const char *what)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return mpidp__fail(MPIDP_ECUDA, "mpidp_cuda_%s: kernel launch failed: %s", what,
                           cudaGetErrorString(e));
    return MPIDP_OK;
}

} // namespace

extern "C" {

int mpidp_cuda_q8_encode(uint8_t *dst, const float *src, float s, size_t n, void *stream)
{
    if (n == 0) return MPIDP_OK;
    encode_kernel<<<grid_for(n), MPIDP_Q8_BLOCK, 0, static_cast<cudaStream_t>(stream)>>>(
        dst, src, s, n);
    return launched("q8_encode");
}

int mpidp_cuda_q8_decode(float *dst, const uint8_t *src, int accumulate, size_t n, void *stream)
{
    if (n == 0) return MPIDP_OK;
    decode_kernel<<<grid_for(n), MPIDP_Q8_BLOCK, 0, static_cast<cudaStream_t>(stream)>>>(
        dst, src, accumulate, n);
    return launched("q8_decode");
}

} // extern "C"
