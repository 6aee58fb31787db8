/* The conversion kernels on CUDA devices.
 *
 * The same kernels as mpidp/pack.h, on device pointers, with the same results
 * bit for bit: the same integer rounding to bf16 and fp16 (round to nearest
 * even, subnormals kept, canonical NaNs 0x7FC0 / 0x7E00 / 0x7FC00000), and the
 * same fp32 operations in the same order, each rounded on its own (__fmul_rn,
 * __fadd_rn: never contracted into an FMA), with denormals kept (the kernels
 * must not be built with -ftz=true or --use_fast_math). A GPU rank and a CPU
 * rank therefore produce identical wire data and identical merged parameters.
 *
 * Every function enqueues its work on `stream` (a cudaStream_t passed as
 * void *: the tensor's current stream, torch.cuda.current_stream().cuda_stream;
 * NULL is the legacy default stream) and returns without waiting. The device
 * is the caller's current device, which must own the pointers. n == 0 launches
 * nothing. Arrays may be the very same array (in place) but must not otherwise
 * overlap.
 *
 * Returns MPIDP_OK once the kernel is launched; MPIDP_ECUDA with
 * cudaGetErrorString in mpidp_error_detail when the launch fails. Faults while
 * the kernel runs surface at the next synchronisation of the stream, as with
 * any CUDA kernel. Built without CUDA, every function returns MPIDP_ENOTSUP
 * with the detail "mpidp was built without CUDA" (csrc/core/cuda_stub.c). */
#ifndef MPIDP_CUDA_H
#define MPIDP_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when mpidp was built with CUDA and at least one device is usable, else 0.
 * Never fails. */
int mpidp_cuda_available(void);

/* dst[i] = bf16 / fp16 of t, with t = src[i]; t = t - ref[i] when ref != NULL;
 * t = t * s when s != 1.0f (as pack_bf16 in mpidp/pack.h). */
int mpidp_cuda_pack_bf16(uint16_t *dst, const float *src, const float *ref, float s, size_t n,
                         void *stream);
int mpidp_cuda_pack_fp16(uint16_t *dst, const float *src, const float *ref, float s, size_t n,
                         void *stream);

/* dst[i] = ((a * dst[i]) + (b * widen(src[i]))) + (c * ref[i]), where the dst
 * term is left out (dst not read) when a == 0.0f and the ref term when ref is
 * NULL (as unpack_bf16 in mpidp/pack.h). */
int mpidp_cuda_unpack_bf16(float *dst, const uint16_t *src, const float *ref, float a, float b,
                           float c, size_t n, void *stream);
int mpidp_cuda_unpack_fp16(float *dst, const uint16_t *src, const float *ref, float a, float b,
                           float c, size_t n, void *stream);

/* inout[i] = half(widen(in[i]) + widen(inout[i])), rounded once. */
int mpidp_cuda_sum_bf16(uint16_t *inout, const uint16_t *in, size_t n, void *stream);
int mpidp_cuda_sum_fp16(uint16_t *inout, const uint16_t *in, size_t n, void *stream);

/* x[i] = x[i] * s, and unpack's formula with an fp32 source. */
int mpidp_cuda_scale_f32(float *x, float s, size_t n, void *stream);
int mpidp_cuda_merge_f32(float *dst, const float *src, const float *ref, float a, float b,
                         float c, size_t n, void *stream);

/* The 8-bit block quantizer of mpidp/quant8.h: dst (mpidp_q8_bytes(n)
 * bytes) = the records of src[i] (* s); and dst[i] = the decoded values (with
 * accumulate: dst[i] + them). The same bytes and values as the host paths. */
int mpidp_cuda_q8_encode(uint8_t *dst, const float *src, float s, size_t n, void *stream);
int mpidp_cuda_q8_decode(float *dst, const uint8_t *src, int accumulate, size_t n, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MPIDP_CUDA_H */
