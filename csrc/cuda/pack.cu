// The conversion kernels on CUDA devices (see mpidp/cuda.h for the contract).
//
// Every result matches the CPU reference (csrc/core/pack_ref.c) bit for bit:
//   - bf16 and fp16 rounding use the reference's integer code, not
//     __float2bfloat16_rn / __float2half_rn, whose NaN results (0x7FFF) differ
//     from our canonical NaNs;
//   - fp32 arithmetic uses __fmul_rn / __fadd_rn / __fsub_rn, which nvcc never
//     contracts into an FMA (plain a * b + c would be, by default), in the
//     reference's order;
//   - subnormals are kept as long as this file is not compiled with -ftz=true
//     or --use_fast_math (setup.py does neither).
//
// The kernels are elementwise and memory-bound. Each grid-stride kernel moves
// four elements per thread with 8- or 16-byte accesses when every pointer is
// aligned for that, and one element per thread otherwise.
#include "mpidp/cuda.h"

extern "C" {
#include "mpidp/status.h"
#include "../core/fail.h"
}

#include <cuda_runtime.h>

#include <stdint.h>

namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 4096;

// ---- per-element rules, as in pack_ref.c ----

__device__ __forceinline__ uint16_t bf16_from_f32(float x)
{
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ uint16_t fp16_from_f32(float x)
{
    uint32_t u = __float_as_uint(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7e00;
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) {
        a -= 0x38000000u;
        a += 0x0fffu + ((a >> 13) & 1u);
        return (uint16_t)(sign | (a >> 13));
    }
    if (a < 0x33000000u) return (uint16_t)sign;
    uint32_t shift = 126u - (a >> 23);
    uint32_t m = (a & 0x007fffffu) | 0x00800000u;
    uint32_t r = (m + ((1u << (shift - 1)) - 1u) + ((m >> shift) & 1u)) >> shift;
    return (uint16_t)(sign | r);
}

__device__ __forceinline__ float f32_from_bf16(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

// Exact. A subnormal half m * 2^-24 is computed as a float product: m is an
// integer below 1024 and the result is zero or a normal float, so neither the
// conversion nor the multiplication rounds or flushes.
__device__ __forceinline__ float f32_from_fp16(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
    if (em >= 0x7c00u) return __uint_as_float(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
    if (em >= 0x0400u) return __uint_as_float(sign | ((em << 13) + 0x38000000u));
    float f = __fmul_rn(__uint2float_rn(em), 0x1p-24f);
    return __uint_as_float(sign | __float_as_uint(f));
}

__device__ __forceinline__ float canon(float x)
{
    return isnan(x) ? __uint_as_float(0x7fc00000u) : x;
}

template <bool BF16>
__device__ __forceinline__ uint16_t to_half(float x)
{
    return BF16 ? bf16_from_f32(x) : fp16_from_f32(x);
}

template <bool BF16>
__device__ __forceinline__ float from_half(uint16_t h)
{
    return BF16 ? f32_from_bf16(h) : f32_from_fp16(h);
}

// Four 16-bit values packed in a uint2 (little-endian, element 0 lowest).
__device__ __forceinline__ uint16_t lane16(uint2 v, int k)
{
    uint32_t w = k < 2 ? v.x : v.y;
    return (uint16_t)(k & 1 ? w >> 16 : w & 0xffffu);
}

__device__ __forceinline__ uint2 pack4(const uint16_t h[4])
{
    return make_uint2((uint32_t)h[0] | (uint32_t)h[1] << 16, (uint32_t)h[2] | (uint32_t)h[3] << 16);
}

__device__ __forceinline__ float lane32(float4 v, int k)
{
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// ---- the element operations; one() does element i, four() elements 4g..4g+3 ----

template <bool BF16, bool REF, bool SCALE>
struct PackOp {
    uint16_t *dst;
    const float *src, *ref;
    float s;

    __device__ __forceinline__ uint16_t elem(float x, float r) const
    {
        if (REF) x = __fsub_rn(x, r);
        if (SCALE) x = __fmul_rn(x, s);
        return to_half<BF16>(x);
    }
    __device__ __forceinline__ void one(size_t i) const
    {
        dst[i] = elem(src[i], REF ? ref[i] : 0.0f);
    }
    __device__ __forceinline__ void four(size_t g) const
    {
        float4 x = reinterpret_cast<const float4 *>(src)[g];
        float4 r = REF ? reinterpret_cast<const float4 *>(ref)[g] : make_float4(0, 0, 0, 0);
        uint16_t h[4];
        for (int k = 0; k < 4; k++) h[k] = elem(lane32(x, k), lane32(r, k));
        reinterpret_cast<uint2 *>(dst)[g] = pack4(h);
    }
};

// The merge formula: t = b*w; t = (a*d) + t when a != 0; t = t + (c*r) with ref.
template <bool USE_DST, bool REF>
__device__ __forceinline__ float merge(float w, float d, float r, float a, float b, float c)
{
    float t = __fmul_rn(b, w);
    if (USE_DST) t = __fadd_rn(__fmul_rn(a, d), t);
    if (REF) t = __fadd_rn(t, __fmul_rn(c, r));
    return canon(t);
}

// SRC: 0 = fp32 source (merge_f32), 1 = bf16, 2 = fp16.
template <int SRC, bool USE_DST, bool REF>
struct MergeOp {
    float *dst;
    const void *src;
    const float *ref;
    float a, b, c;

    __device__ __forceinline__ float widen(size_t i) const
    {
        if (SRC == 0) return static_cast<const float *>(src)[i];
        return from_half<SRC == 1>(static_cast<const uint16_t *>(src)[i]);
    }
    __device__ __forceinline__ void one(size_t i) const
    {
        dst[i] = merge<USE_DST, REF>(widen(i), USE_DST ? dst[i] : 0.0f, REF ? ref[i] : 0.0f, a, b, c);
    }
    __device__ __forceinline__ void four(size_t g) const
    {
        float w[4];
        if (SRC == 0) {
            float4 v = static_cast<const float4 *>(src)[g];
            for (int k = 0; k < 4; k++) w[k] = lane32(v, k);
        } else {
            uint2 v = static_cast<const uint2 *>(src)[g];
            for (int k = 0; k < 4; k++) w[k] = from_half<SRC == 1>(lane16(v, k));
        }
        float4 d = USE_DST ? reinterpret_cast<const float4 *>(dst)[g] : make_float4(0, 0, 0, 0);
        float4 r = REF ? reinterpret_cast<const float4 *>(ref)[g] : make_float4(0, 0, 0, 0);
        float4 out;
        out.x = merge<USE_DST, REF>(w[0], d.x, r.x, a, b, c);
        out.y = merge<USE_DST, REF>(w[1], d.y, r.y, a, b, c);
        out.z = merge<USE_DST, REF>(w[2], d.z, r.z, a, b, c);
        out.w = merge<USE_DST, REF>(w[3], d.w, r.w, a, b, c);
        reinterpret_cast<float4 *>(dst)[g] = out;
    }
};

template <bool BF16>
struct SumOp {
    uint16_t *inout;
    const uint16_t *in;

    __device__ __forceinline__ uint16_t elem(uint16_t x, uint16_t y) const
    {
        return to_half<BF16>(__fadd_rn(from_half<BF16>(x), from_half<BF16>(y)));
    }
    __device__ __forceinline__ void one(size_t i) const { inout[i] = elem(in[i], inout[i]); }
    __device__ __forceinline__ void four(size_t g) const
    {
        uint2 x = reinterpret_cast<const uint2 *>(in)[g];
        uint2 y = reinterpret_cast<const uint2 *>(inout)[g];
        uint16_t h[4];
        for (int k = 0; k < 4; k++) h[k] = elem(lane16(x, k), lane16(y, k));
        reinterpret_cast<uint2 *>(inout)[g] = pack4(h);
    }
};

struct ScaleOp {
    float *x;
    float s;

    __device__ __forceinline__ void one(size_t i) const { x[i] = canon(__fmul_rn(x[i], s)); }
    __device__ __forceinline__ void four(size_t g) const
    {
        float4 v = reinterpret_cast<const float4 *>(x)[g];
        v.x = canon(__fmul_rn(v.x, s));
        v.y = canon(__fmul_rn(v.y, s));
        v.z = canon(__fmul_rn(v.z, s));
        v.w = canon(__fmul_rn(v.w, s));
        reinterpret_cast<float4 *>(x)[g] = v;
    }
};

// ---- launching ----

template <class Op>
__global__ void __launch_bounds__(kThreads) elementwise(Op op, size_t n, bool vec)
{
    size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        size_t groups = n / 4;
        for (size_t g = tid; g < groups; g += stride) op.four(g);
        // The last n % 4 elements, one per thread.
        size_t t = groups * 4 + tid;
        if (t < n) op.one(t);
    } else {
        for (size_t i = tid; i < n; i += stride) op.one(i);
    }
}

bool aligned(const void *p, uintptr_t bytes)
{
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <class Op>
int launch(const char *what, const Op &op, size_t n, bool vec, void *stream)
{
    if (n == 0) return MPIDP_OK;
    size_t work = vec ? n / 4 + 3 : n;
    size_t blocks = (work + kThreads - 1) / kThreads;
    if (blocks > kMaxBlocks) blocks = kMaxBlocks;
    elementwise<Op><<<(unsigned)blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(op, n, vec);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return mpidp__fail(MPIDP_ECUDA, "mpidp_cuda_%s: kernel launch failed: %s", what,
                           cudaGetErrorString(e));
    return MPIDP_OK;
}

template <bool BF16, bool REF, bool SCALE>
int pack_launch(const char *what, uint16_t *dst, const float *src, const float *ref, float s,
                size_t n, void *stream)
{
    PackOp<BF16, REF, SCALE> op{dst, src, ref, s};
    bool vec = aligned(dst, 8) && aligned(src, 16) && aligned(ref, 16);
    return launch(what, op, n, vec, stream);
}

// The same tests on the scalar arguments as the reference (ref != NULL, s != 1).
template <bool BF16>
int pack_any(const char *what, uint16_t *dst, const float *src, const float *ref, float s,
             size_t n, void *stream)
{
    bool scale = s != 1.0f;
    if (ref) {
        if (scale) return pack_launch<BF16, true, true>(what, dst, src, ref, s, n, stream);
        return pack_launch<BF16, true, false>(what, dst, src, ref, s, n, stream);
    }
    if (scale) return pack_launch<BF16, false, true>(what, dst, src, ref, s, n, stream);
    return pack_launch<BF16, false, false>(what, dst, src, ref, s, n, stream);
}

template <int SRC, bool USE_DST, bool REF>
int merge_launch(const char *what, float *dst, const void *src, const float *ref, float a,
                 float b, float c, size_t n, void *stream)
{
    MergeOp<SRC, USE_DST, REF> op{dst, src, ref, a, b, c};
    bool vec = aligned(dst, 16) && aligned(src, SRC == 0 ? 16 : 8) && aligned(ref, 16);
    return launch(what, op, n, vec, stream);
}

template <int SRC>
int merge_any(const char *what, float *dst, const void *src, const float *ref, float a,
              float b, float c, size_t n, void *stream)
{
    bool use_dst = a != 0.0f;
    if (ref) {
        if (use_dst) return merge_launch<SRC, true, true>(what, dst, src, ref, a, b, c, n, stream);
        return merge_launch<SRC, false, true>(what, dst, src, ref, a, b, c, n, stream);
    }
    if (use_dst) return merge_launch<SRC, true, false>(what, dst, src, ref, a, b, c, n, stream);
    return merge_launch<SRC, false, false>(what, dst, src, ref, a, b, c, n, stream);
}

template <bool BF16>
int sum_any(const char *what, uint16_t *inout, const uint16_t *in, size_t n, void *stream)
{
    SumOp<BF16> op{inout, in};
    return launch(what, op, n, aligned(inout, 8) && aligned(in, 8), stream);
}

} // namespace

extern "C" {

int mpidp_cuda_available(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError(); // no driver or no device: not an error here
        return 0;
    }
    return count > 0;
}

int mpidp_cuda_pack_bf16(uint16_t *dst, const float *src, const float *ref, float s, size_t n,
                         void *stream)
{
    return pack_any<true>("pack_bf16", dst, src, ref, s, n, stream);
}

int mpidp_cuda_pack_fp16(uint16_t *dst, const float *src, const float *ref, float s, size_t n,
                         void *stream)
{
    return pack_any<false>("pack_fp16", dst, src, ref, s, n, stream);
}

int mpidp_cuda_unpack_bf16(float *dst, const uint16_t *src, const float *ref, float a, float b,
                           float c, size_t n, void *stream)
{
    return merge_any<1>("unpack_bf16", dst, src, ref, a, b, c, n, stream);
}

int mpidp_cuda_unpack_fp16(float *dst, const uint16_t *src, const float *ref, float a, float b,
                           float c, size_t n, void *stream)
{
    return merge_any<2>("unpack_fp16", dst, src, ref, a, b, c, n, stream);
}

int mpidp_cuda_merge_f32(float *dst, const float *src, const float *ref, float a, float b,
                         float c, size_t n, void *stream)
{
    return merge_any<0>("merge_f32", dst, src, ref, a, b, c, n, stream);
}

int mpidp_cuda_sum_bf16(uint16_t *inout, const uint16_t *in, size_t n, void *stream)
{
    return sum_any<true>("sum_bf16", inout, in, n, stream);
}

int mpidp_cuda_sum_fp16(uint16_t *inout, const uint16_t *in, size_t n, void *stream)
{
    return sum_any<false>("sum_fp16", inout, in, n, stream);
}

int mpidp_cuda_scale_f32(float *x, float s, size_t n, void *stream)
{
    ScaleOp op{x, s};
    return launch("scale_f32", op, n, aligned(x, 16), stream);
}

} // extern "C"
