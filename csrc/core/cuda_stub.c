/* The CUDA entry points of mpidp/cuda.h when mpidp is built without CUDA.
 *
 * Compiled always; setup.py defines MPIDP_WITH_CUDA when it compiles
 * csrc/cuda/ (every .cu file) into the extension, and then this file is empty. Without
 * CUDA every call fails with MPIDP_ENOTSUP, so the glue reports a clear error
 * for a GPU tensor instead of failing to link or import. */
#ifndef MPIDP_WITH_CUDA

#include "mpidp/cuda.h"

#include "mpidp/status.h"
#include "fail.h"

static int no_cuda(void)
{
    return mpidp__fail(MPIDP_ENOTSUP, "mpidp was built without CUDA");
}

int mpidp_cuda_available(void) { return 0; }

int mpidp_cuda_pack_bf16(uint16_t *dst, const float *src, const float *ref, float s, size_t n,
                         void *stream)
{
    (void)dst, (void)src, (void)ref, (void)s, (void)n, (void)stream;
    return no_cuda();
}

int mpidp_cuda_pack_fp16(uint16_t *dst, const float *src, const float *ref, float s, size_t n,
                         void *stream)
{
    (void)dst, (void)src, (void)ref, (void)s, (void)n, (void)stream;
    return no_cuda();
}

int mpidp_cuda_unpack_bf16(float *dst, const uint16_t *src, const float *ref, float a, float b,
                           float c, size_t n, void *stream)
{
    (void)dst, (void)src, (void)ref, (void)a, (void)b, (void)c, (void)n, (void)stream;
    return no_cuda();
}

int mpidp_cuda_unpack_fp16(float *dst, const uint16_t *src, const float *ref, float a, float b,
                           float c, size_t n, void *stream)
{
    (void)dst, (void)src, (void)ref, (void)a, (void)b, (void)c, (void)n, (void)stream;
    return no_cuda();
}

int mpidp_cuda_sum_bf16(uint16_t *inout, const uint16_t *in, size_t n, void *stream)
{
    (void)inout, (void)in, (void)n, (void)stream;
    return no_cuda();
}

int mpidp_cuda_sum_fp16(uint16_t *inout, const uint16_t *in, size_t n, void *stream)
{
    (void)inout, (void)in, (void)n, (void)stream;
    return no_cuda();
}

int mpidp_cuda_scale_f32(float *x, float s, size_t n, void *stream)
{
    (void)x, (void)s, (void)n, (void)stream;
    return no_cuda();
}

int mpidp_cuda_merge_f32(float *dst, const float *src, const float *ref, float a, float b,
                         float c, size_t n, void *stream)
{
    (void)dst, (void)src, (void)ref, (void)a, (void)b, (void)c, (void)n, (void)stream;
    return no_cuda();
}

int mpidp_cuda_q8_encode(uint8_t *dst, const float *src, float s, size_t n, void *stream)
{
    (void)dst, (void)src, (void)s, (void)n, (void)stream;
    return no_cuda();
}

int mpidp_cuda_q8_decode(float *dst, const uint8_t *src, int accumulate, size_t n, void *stream)
{
    (void)dst, (void)src, (void)accumulate, (void)n, (void)stream;
    return no_cuda();
}

#else

/* ISO C wants at least one declaration in a translation unit. */
typedef int mpidp__cuda_stub_unused;

#endif /* MPIDP_WITH_CUDA */
