/* DLPack intake: the pure-C checks behind every tensor the core touches. */
#include "mpidp/tensor.h"

#include "mpidp/status.h"
#include "fail.h"

size_t mpidp_dtype_size(int dtype)
{
    switch (dtype) {
    case MPIDP_F32: return 4;
    case MPIDP_F64: return 8;
    case MPIDP_BF16:
    case MPIDP_F16:
    case MPIDP_I16: return 2;
    case MPIDP_I8:
    case MPIDP_U8:
    case MPIDP_BOOL: return 1;
    case MPIDP_I32: return 4;
    case MPIDP_I64: return 8;
    }
    return 0;
}

int mpidp_dtype_is_float(int dtype) { return dtype >= MPIDP_F32 && dtype <= MPIDP_F16; }

const char *mpidp_dtype_name(int dtype)
{
    switch (dtype) {
    case MPIDP_F32: return "float32";
    case MPIDP_F64: return "float64";
    case MPIDP_BF16: return "bfloat16";
    case MPIDP_F16: return "float16";
    case MPIDP_I8: return "int8";
    case MPIDP_U8: return "uint8";
    case MPIDP_I16: return "int16";
    case MPIDP_I32: return "int32";
    case MPIDP_I64: return "int64";
    case MPIDP_BOOL: return "bool";
    }
    return "unknown";
}

static int dtype_from_dl(mpidp_dl_dtype_t t, mpidp_dtype_t *out)
{
    if (t.lanes != 1) return -1;
    if (t.code == MPIDP_DL_FLOAT && t.bits == 32) { *out = MPIDP_F32; return 0; }
    if (t.code == MPIDP_DL_FLOAT && t.bits == 64) { *out = MPIDP_F64; return 0; }
    if (t.code == MPIDP_DL_FLOAT && t.bits == 16) { *out = MPIDP_F16; return 0; }
    if (t.code == MPIDP_DL_BFLOAT && t.bits == 16) { *out = MPIDP_BF16; return 0; }
    if (t.code == MPIDP_DL_INT && t.bits == 8) { *out = MPIDP_I8; return 0; }
    if (t.code == MPIDP_DL_UINT && t.bits == 8) { *out = MPIDP_U8; return 0; }
    if (t.code == MPIDP_DL_INT && t.bits == 16) { *out = MPIDP_I16; return 0; }
    if (t.code == MPIDP_DL_INT && t.bits == 32) { *out = MPIDP_I32; return 0; }
    if (t.code == MPIDP_DL_INT && t.bits == 64) { *out = MPIDP_I64; return 0; }
    if (t.code == MPIDP_DL_BOOL && t.bits == 8) { *out = MPIDP_BOOL; return 0; }
    return -1;
}

static const char *dl_code_name(uint8_t code)
{
    switch (code) {
    case MPIDP_DL_INT: return "int";
    case MPIDP_DL_UINT: return "uint";
    case MPIDP_DL_FLOAT: return "float";
    case MPIDP_DL_BFLOAT: return "bfloat";
    case MPIDP_DL_COMPLEX: return "complex";
    case MPIDP_DL_BOOL: return "bool";
    }
    return "opaque";
}

int mpidp_tensor_from_dlpack(const mpidp_dl_tensor_t *dl, int read_only,
                             unsigned requirements, mpidp_tensor_t *out)
{
    if (dl == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "tensor: NULL DLPack tensor");

    mpidp_dtype_t dtype;
    int any = (requirements & MPIDP_TENSOR_ANY_DTYPE) != 0;
    if (dtype_from_dl(dl->dtype, &dtype) != 0 || (!any && !mpidp_dtype_is_float(dtype)))
        return mpidp__fail(MPIDP_EDTYPE,
                           "expected a float32, float64, bfloat16 or float16 tensor%s, "
                           "got %s%u (lanes %u)",
                           any ? " (or int8, uint8, int16, int32, int64, bool)" : "",
                           dl_code_name(dl->dtype.code), (unsigned)dl->dtype.bits,
                           (unsigned)dl->dtype.lanes);

    mpidp_device_t device;
    switch (dl->device.device_type) {
    case MPIDP_DL_CPU:
    case MPIDP_DL_CUDA_HOST:
        device = MPIDP_DEV_CPU;
        break;
    case MPIDP_DL_CUDA:
    case MPIDP_DL_CUDA_MANAGED:
        device = MPIDP_DEV_CUDA;
        break;
    default:
        return mpidp__fail(MPIDP_EDEVICE,
                           "expected a CPU or CUDA tensor, got DLPack device type %d",
                           (int)dl->device.device_type);
    }
    if (device != MPIDP_DEV_CPU && (requirements & MPIDP_TENSOR_CPU_ONLY))
        return mpidp__fail(MPIDP_EDEVICE, "expected a CPU tensor, got a CUDA tensor");
    if (read_only && (requirements & MPIDP_TENSOR_WRITABLE))
        return mpidp__fail(MPIDP_EINVAL, "expected a writable tensor, got a read-only one");
    if (dl->ndim < 0 || (dl->ndim > 0 && dl->shape == NULL))
        return mpidp__fail(MPIDP_EINVAL, "tensor has ndim %d and no shape", (int)dl->ndim);

    /* Count elements with overflow checks; a zero extent makes the tensor empty,
     * and an empty tensor is contiguous whatever its strides say. */
    size_t esize = mpidp_dtype_size(dtype);
    size_t numel = 1;
    for (int32_t d = 0; d < dl->ndim; d++) {
        int64_t extent = dl->shape[d];
        if (extent < 0)
            return mpidp__fail(MPIDP_EINVAL, "tensor dimension %d has negative extent %lld",
                               (int)d, (long long)extent);
        if (extent != 0 && numel > SIZE_MAX / esize / (size_t)extent)
            return mpidp__fail(MPIDP_EINVAL, "tensor is too large to address");
        numel *= (size_t)extent;
    }
    if (numel != 0 && dl->strides != NULL) {
        int64_t expected = 1;
        for (int32_t d = dl->ndim - 1; d >= 0; d--) {
            if (dl->shape[d] != 1 && dl->strides[d] != expected)
                return mpidp__fail(MPIDP_EINVAL,
                                   "expected a contiguous tensor: dimension %d has stride %lld, "
                                   "contiguous would be %lld (call .contiguous() first)",
                                   (int)d, (long long)dl->strides[d], (long long)expected);
            expected *= dl->shape[d];
        }
    }
    if (numel != 0 && dl->data == NULL)
        return mpidp__fail(MPIDP_EINVAL, "tensor has %zu elements and a NULL data pointer", numel);

    uintptr_t addr = (uintptr_t)dl->data + (uintptr_t)dl->byte_offset;
    if (numel != 0 && addr % esize != 0)
        return mpidp__fail(MPIDP_EINVAL,
                           "tensor data (byte_offset %llu) is not aligned to its %zu-byte elements",
                           (unsigned long long)dl->byte_offset, esize);

    out->data = (void *)addr;
    out->numel = numel;
    out->dtype = dtype;
    out->device = device;
    out->device_id = dl->device.device_id;
    out->read_only = read_only != 0;
    return MPIDP_OK;
}
