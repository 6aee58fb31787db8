/* One entry point for the conversion kernels on any device.
 *
 * mpidp_convert runs one of the three public conversions on checked tensors
 * (mpidp/tensor.h), choosing the kernels by where the tensors live: host
 * memory (CPU or pinned) runs a SIMD table of mpidp/pack.h, CUDA memory the
 * kernels of mpidp/cuda.h on `stream`. The caller (the glue) only borrows the
 * tensors; which operand may have which dtype, that the sizes agree and that
 * every tensor is on one device are decided here, so every binding gets the
 * same rules and messages.
 *
 *   MPIDP_CONVERT_PACK    dst (bf16/fp16) = half(a * (src - ref)),   src, ref fp32
 *   MPIDP_CONVERT_UNPACK  dst (fp32) = a*dst + b*widen(src) + c*ref,  src bf16/fp16/fp32
 *   MPIDP_CONVERT_SUM16   dst = half(widen(dst) + widen(src)),       dst, src one half type
 *   MPIDP_CONVERT_Q8_ENCODE  dst (uint8, mpidp_q8_bytes(n) bytes) = the 8-bit
 *                         records of a * src (src fp32, n elements)
 *   MPIDP_CONVERT_Q8_DECODE  dst (fp32, n) = the decoded records in src
 *                         (uint8, mpidp_q8_bytes(n) bytes); a != 0: dst += them
 *
 * (pack's scale is `a`; sum16 ignores a, b, c; sum16 and the 8-bit ops take
 * no ref.) The formulas, rounding and operation order are those of
 * mpidp/pack.h and mpidp/quant8.h; a host path name selects both tables. */
#ifndef MPIDP_CONVERT_H
#define MPIDP_CONVERT_H

#include "mpidp/pack.h"
#include "mpidp/tensor.h"

typedef enum {
    MPIDP_CONVERT_PACK = 0,
    MPIDP_CONVERT_UNPACK = 1,
    MPIDP_CONVERT_SUM16 = 2,
    MPIDP_CONVERT_Q8_ENCODE = 3,
    MPIDP_CONVERT_Q8_DECODE = 4,
} mpidp_convert_op_t;

/* The operation's name ("pack", "unpack", "sum16", "quantize8", "dequantize8"),
 * or NULL for an unknown op. */
const char *mpidp_convert_name(int op);

/* Runs `op`. ref may be NULL (no reference term). host: the SIMD table for
 * host tensors (NULL: the chosen one, mpidp_pack_kernels()); it must be NULL
 * for CUDA tensors. stream: the cudaStream_t for CUDA tensors (NULL is the
 * legacy default stream); it must be NULL for host tensors. CUDA work is only
 * enqueued, on the caller's current device, which must be the tensors'.
 *
 * Fails, before touching any memory, with MPIDP_EDTYPE (an operand's dtype,
 * named: "dst: unexpected dtype float32"), MPIDP_EINVAL (sizes differ, dst
 * read-only, unknown op, a host table with CUDA tensors or a stream with host
 * ones), MPIDP_EDEVICE (tensors on different devices, both named); CUDA
 * launches fail as in mpidp/cuda.h (MPIDP_ECUDA, or MPIDP_ENOTSUP built
 * without CUDA). Thread-safe; takes no lock. */
int mpidp_convert(int op, const mpidp_tensor_t *dst, const mpidp_tensor_t *src,
                  const mpidp_tensor_t *ref, float a, float b, float c,
                  const mpidp_pack_kernels_t *host, void *stream);

/* float16 on the wire holds finite values up to 65504 only: larger ones
 * become infinite, and values below 2^-24 (6e-8) become zero. The engines
 * that pack to float16 (gradient buckets, allreduce chunks, DASO's syncs)
 * count, right after packing, the elements that were finite before and are
 * infinite on the wire (a second pass over the wire buffer, which is still in
 * cache), so the glue can warn once. bfloat16 has float32's range. */

/* The elements i < n with wire[i] = +-inf (float16) while src[i] (and ref[i],
 * when given) are finite; adds them to the process-wide count. */
size_t mpidp_fp16_count_overflow(const uint16_t *wire, const float *src, const float *ref, size_t n);
/* Elements that overflowed float16 on the wire since the process started. Thread-safe. */
size_t mpidp_fp16_overflow_total(void);

#endif /* MPIDP_CONVERT_H */
