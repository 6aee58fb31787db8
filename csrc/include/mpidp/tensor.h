/* What the core knows of a tensor: a checked, flat, contiguous view.
 *
 * The glue turns a DLPack tensor into an mpidp_tensor_t with
 * mpidp_tensor_from_dlpack(), which is pure C (so it can be fuzzed and unit
 * tested without Python): it checks dtype, device, contiguity, the read-only
 * flag and the byte offset, and computes the element count. */
#ifndef MPIDP_TENSOR_H
#define MPIDP_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "mpidp/dlpack.h"

/* Element types the core knows. The numbers are stable: the Python layer and
 * saved state use them. The floating-point ones are what the engines reduce
 * and convert; the integer and bool ones travel through the collectives
 * only (a tensor of them is accepted with MPIDP_TENSOR_ANY_DTYPE). */
typedef enum {
    MPIDP_F32 = 0,
    MPIDP_F64 = 1,
    MPIDP_BF16 = 2,
    MPIDP_F16 = 3,
    MPIDP_I8 = 4,
    MPIDP_U8 = 5,
    MPIDP_I16 = 6,
    MPIDP_I32 = 7,
    MPIDP_I64 = 8,
    MPIDP_BOOL = 9,
} mpidp_dtype_t;

#define MPIDP_N_DTYPES 10

typedef enum {
    MPIDP_DEV_CPU = 0,
    MPIDP_DEV_CUDA = 1,
} mpidp_device_t;

typedef struct {
    void *data;          /* first element (byte_offset already applied) */
    size_t numel;
    mpidp_dtype_t dtype;
    mpidp_device_t device;
    int device_id;
    int read_only;
} mpidp_tensor_t;

/* Size in bytes of one element of `dtype`, 0 for an unknown dtype. */
size_t mpidp_dtype_size(int dtype);
/* "float32", "float64", "bfloat16", "float16", "int8", ..., "bool", or "unknown". */
const char *mpidp_dtype_name(int dtype);
/* 1 for the four floating-point dtypes. */
int mpidp_dtype_is_float(int dtype);

/* Requirements a caller can put on a tensor. */
#define MPIDP_TENSOR_WRITABLE   1u  /* refuse read-only tensors */
#define MPIDP_TENSOR_CPU_ONLY   2u  /* refuse device memory */
#define MPIDP_TENSOR_ANY_DTYPE  4u  /* accept the integer and bool dtypes too */

/* Checks `dl` and fills `out`.
 *
 * Accepts float32/float64/bfloat16/float16 with one lane (with
 * MPIDP_TENSOR_ANY_DTYPE also int8/uint8/int16/int32/int64/bool), on the CPU, pinned
 * host memory or CUDA (unless MPIDP_TENSOR_CPU_ONLY), C-contiguous (strides
 * NULL, or compact row-major where dimensions of extent 1 may carry any
 * stride), any byte_offset that keeps the element pointer aligned to the
 * element size. `read_only` is the DLPack >= 1.0 read-only flag (0 for legacy
 * capsules). On failure returns MPIDP_EDTYPE, MPIDP_EDEVICE or MPIDP_EINVAL
 * with a detail naming the problem, and leaves `out` untouched. */
int mpidp_tensor_from_dlpack(const mpidp_dl_tensor_t *dl, int read_only,
                             unsigned requirements, mpidp_tensor_t *out);

#endif /* MPIDP_TENSOR_H */
