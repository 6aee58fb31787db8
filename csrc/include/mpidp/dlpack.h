/* The DLPack C ABI, as far as mpidp reads it.
 *
 * DLPack (https://dmlc.github.io/dlpack/) is the C ABI through which PyTorch,
 * NumPy and CuPy share tensors without copying. mpidp declares the structs it
 * needs here instead of vendoring the whole header: the layout is fixed by the
 * ABI (v0.8 legacy capsules named "dltensor", v1.x versioned capsules named
 * "dltensor_versioned" with a flags word). */
#ifndef MPIDP_DLPACK_H
#define MPIDP_DLPACK_H

#include <stdint.h>

#define MPIDP_DLPACK_FLAG_READ_ONLY (UINT64_C(1) << 0)

typedef enum {
    MPIDP_DL_CPU = 1,
    MPIDP_DL_CUDA = 2,
    MPIDP_DL_CUDA_HOST = 3,
    MPIDP_DL_ROCM = 10,
    MPIDP_DL_CUDA_MANAGED = 13,
} mpidp_dl_device_type_t;

typedef enum {
    MPIDP_DL_INT = 0,
    MPIDP_DL_UINT = 1,
    MPIDP_DL_FLOAT = 2,
    MPIDP_DL_OPAQUE_HANDLE = 3,
    MPIDP_DL_BFLOAT = 4,
    MPIDP_DL_COMPLEX = 5,
    MPIDP_DL_BOOL = 6,
} mpidp_dl_type_code_t;

typedef struct {
    int32_t device_type;
    int32_t device_id;
} mpidp_dl_device_t;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} mpidp_dl_dtype_t;

typedef struct {
    void *data;
    mpidp_dl_device_t device;
    int32_t ndim;
    mpidp_dl_dtype_t dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} mpidp_dl_tensor_t;

/* Legacy (unversioned) managed tensor, capsule name "dltensor". */
typedef struct mpidp_dl_managed_tensor {
    mpidp_dl_tensor_t dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct mpidp_dl_managed_tensor *self);
} mpidp_dl_managed_tensor_t;

typedef struct {
    uint32_t major;
    uint32_t minor;
} mpidp_dl_version_t;

/* Versioned managed tensor (DLPack >= 1.0), capsule name "dltensor_versioned". */
typedef struct mpidp_dl_managed_tensor_versioned {
    mpidp_dl_version_t version;
    void *manager_ctx;
    void (*deleter)(struct mpidp_dl_managed_tensor_versioned *self);
    uint64_t flags;
    mpidp_dl_tensor_t dl_tensor;
} mpidp_dl_managed_tensor_versioned_t;

#endif /* MPIDP_DLPACK_H */
