/* libFuzzer harness: DLPack intake (mpidp_tensor_from_dlpack).
 *
 * The input describes one DLPack tensor, including nonsense ones: any ndim
 * (negative, huge), any extents (negative, zero, products that overflow), NULL
 * or arbitrary strides, every dtype code/bits/lanes, any device type, any data
 * pointer and byte_offset, any read-only flag and requirement bits, NULL
 * arguments. The harness decides on its own, from the contract in
 * mpidp/tensor.h and with 128-bit arithmetic, whether the tensor must be
 * accepted, must be refused (and with which status codes), or may go either
 * way, then checks the library's answer against that:
 *   - never a crash, an out-of-bounds read of shape/strides, or UB (ASan/UBSan);
 *   - acceptance exactly when the contract says so;
 *   - on success: numel == the product of the extents, data == base +
 *     byte_offset, aligned to the element size when non-empty, every dimension
 *     of extent > 1 has the compact row-major stride, the dtype/device/flags
 *     are the ones asked for;
 *   - on failure: a status the contract allows for one of the reasons that
 *     apply, a non-empty detail, `out` untouched;
 *   - the DLPack struct and its arrays are never written.
 *
 * Input layout (see fuzz_common.h for fz_int/fz_double; make_seeds.py writes it):
 *   u8 flags   bit0 dl=NULL, bit1 out=NULL, bit2 strides given, bit3 shape=NULL,
 *              bit4 data=NULL
 *   ndim       fz_int(0, 6), truncated to int32
 *   dtype      code fz_int(0, 6), bits from {16,32,64,8,1,128} or raw, lanes 1 or raw
 *   device     type fz_int(0, 15), id fz_int(-1, 3) (both truncated to int32)
 *   data       fz_int(0, 63) added to an aligned base, or a raw pointer value
 *   byte_offset fz_int(0, 63) as uint64
 *   read_only  fz_int(0, 1) as int;  requirements fz_int(0, 3) as unsigned
 *   shape      fz_int(0, 5) per dimension
 *   strides    per dimension: u8 < 0xA0 -> the compact stride, else fz_int(-2, 8)
 */
#include "mpidp/dlpack.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"

#include "fuzz_common.h"

/* Up to this many dimensions the shape and strides arrays hold exactly ndim
 * entries (so ASan sees any read past them). Beyond it the harness cannot
 * allocate ndim entries; it allocates MAX_DIMS and makes the last one
 * negative, so that a correct intake stops there. */
#define MAX_DIMS 1024

typedef unsigned __int128 u128;

/* Status-code sets as bit masks: bit i stands for status -i. */
#define CODE_BIT(status) (1u << (unsigned)(-(status)))

static int ref_dtype(mpidp_dl_dtype_t t, mpidp_dtype_t *out, size_t *esize)
{
    if (t.lanes != 1) return -1;
    if (t.code == MPIDP_DL_FLOAT && t.bits == 32) { *out = MPIDP_F32; *esize = 4; return 0; }
    if (t.code == MPIDP_DL_FLOAT && t.bits == 64) { *out = MPIDP_F64; *esize = 8; return 0; }
    if (t.code == MPIDP_DL_FLOAT && t.bits == 16) { *out = MPIDP_F16; *esize = 2; return 0; }
    if (t.code == MPIDP_DL_BFLOAT && t.bits == 16) { *out = MPIDP_BF16; *esize = 2; return 0; }
    return -1;
}

typedef struct {
    unsigned must;   /* reasons that apply: the call must fail with one of them */
    unsigned may;    /* conservative refusals the contract tolerates */
    mpidp_dtype_t dtype;
    mpidp_device_t device;
    size_t numel;
} expect_t;

/* The contract of mpidp_tensor_from_dlpack(), recomputed independently. */
static expect_t reference(const mpidp_dl_tensor_t *dl, int dl_null, int out_null,
                          int read_only, unsigned req)
{
    expect_t e = {0, 0, MPIDP_F32, MPIDP_DEV_CPU, 0};
    if (dl_null || out_null) {
        e.must = CODE_BIT(MPIDP_EINVAL);
        return e;
    }
    size_t esize = 0;
    int dtype_ok = ref_dtype(dl->dtype, &e.dtype, &esize) == 0;
    if (!dtype_ok) e.must |= CODE_BIT(MPIDP_EDTYPE);

    switch (dl->device.device_type) {
    case MPIDP_DL_CPU:
    case MPIDP_DL_CUDA_HOST: e.device = MPIDP_DEV_CPU; break;
    case MPIDP_DL_CUDA:
    case MPIDP_DL_CUDA_MANAGED:
        e.device = MPIDP_DEV_CUDA;
        if (req & MPIDP_TENSOR_CPU_ONLY) e.must |= CODE_BIT(MPIDP_EDEVICE);
        break;
    default: e.must |= CODE_BIT(MPIDP_EDEVICE);
    }
    if (read_only && (req & MPIDP_TENSOR_WRITABLE)) e.must |= CODE_BIT(MPIDP_EINVAL);
    if (dl->ndim < 0 || (dl->ndim > 0 && dl->shape == NULL)) {
        e.must |= CODE_BIT(MPIDP_EINVAL);
        return e;
    }

    /* The exact element count, saturating at 2^127; and whether a prefix of the
     * extents (before a zero one) already overflows, which lets an
     * implementation refuse an empty tensor conservatively. */
    const u128 cap = (u128)1 << 127;
    u128 prod = 1;
    int negative = 0, prefix_overflow = 0, zero = 0;
    for (int32_t d = 0; d < dl->ndim; d++) {
        int64_t x = dl->shape[d];
        if (x < 0) { negative = 1; break; }
        if (x == 0) { zero = 1; continue; }
        if (!zero) {
            prod = prod > cap / (u128)x ? cap : prod * (u128)x;
            if (dtype_ok && prod * esize > SIZE_MAX) prefix_overflow = 1;
        }
    }
    if (negative) {
        e.must |= CODE_BIT(MPIDP_EINVAL);
        return e;
    }
    if (zero) prod = 0;
    if (!dtype_ok) {
        /* Without an element size the size/alignment checks are undefined; any
         * of them may also refuse. */
        e.may |= CODE_BIT(MPIDP_EINVAL);
        return e;
    }
    if (prod * esize > SIZE_MAX) {
        e.must |= CODE_BIT(MPIDP_EINVAL);
        return e;
    }
    if (prefix_overflow) e.may |= CODE_BIT(MPIDP_EINVAL);
    e.numel = (size_t)prod;

    if (prod != 0 && dl->strides != NULL) {
        u128 expected = 1;
        for (int32_t d = dl->ndim - 1; d >= 0; d--) {
            if (dl->shape[d] != 1 && (dl->strides[d] < 0 || (u128)dl->strides[d] != expected))
                e.must |= CODE_BIT(MPIDP_EINVAL);
            expected *= (u128)dl->shape[d]; /* <= prod <= SIZE_MAX: no overflow */
        }
    }
    if (prod != 0 && dl->data == NULL) e.must |= CODE_BIT(MPIDP_EINVAL);
    uint64_t addr = (uint64_t)(uintptr_t)dl->data + dl->byte_offset; /* mod 2^64 */
    if (prod != 0 && addr % esize != 0) e.must |= CODE_BIT(MPIDP_EINVAL);
    return e;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_t f = {data, size};
    uint8_t flags = fz_u8(&f);
    int dl_null = flags & 1, out_null = (flags >> 1) & 1, has_strides = (flags >> 2) & 1;
    int shape_null = (flags >> 3) & 1, data_null = (flags >> 4) & 1;

    mpidp_dl_tensor_t dl;
    memset(&dl, 0, sizeof dl);
    dl.ndim = (int32_t)(uint32_t)(uint64_t)fz_int(&f, 0, 6);
    dl.dtype.code = (uint8_t)fz_int(&f, 0, 6);
    {
        static const uint8_t bits[6] = {16, 32, 64, 8, 1, 128};
        uint8_t k = fz_u8(&f);
        dl.dtype.bits = k < 0xC0 ? bits[k % 6] : fz_u8(&f);
        k = fz_u8(&f);
        dl.dtype.lanes = k < 0xE0 ? 1 : (uint16_t)(fz_u8(&f) | fz_u8(&f) << 8);
    }
    dl.device.device_type = (int32_t)(uint32_t)(uint64_t)fz_int(&f, 0, 15);
    dl.device.device_id = (int32_t)(uint32_t)(uint64_t)fz_int(&f, -1, 3);
    {
        uint8_t k = fz_u8(&f);
        uint64_t p = k < 0xC0 ? UINT64_C(0x7f1234560000) + k % 64 : fz_u64(&f);
        dl.data = data_null ? NULL : (void *)(uintptr_t)p;
    }
    dl.byte_offset = (uint64_t)fz_int(&f, 0, 63);
    int read_only = (int)(uint32_t)(uint64_t)fz_int(&f, 0, 1);
    unsigned req = (unsigned)(uint64_t)fz_int(&f, 0, 3);

    /* Shape and strides, exactly ndim long (or MAX_DIMS with a stopper). */
    int32_t n_alloc = dl.ndim <= 0 ? 0 : dl.ndim > MAX_DIMS ? MAX_DIMS : dl.ndim;
    int64_t *shape = NULL, *strides = NULL, *shape_copy = NULL, *strides_copy = NULL;
    if (n_alloc > 0) {
        shape = malloc(sizeof *shape * (size_t)n_alloc);
        strides = malloc(sizeof *strides * (size_t)n_alloc);
        shape_copy = malloc(sizeof *shape * (size_t)n_alloc);
        strides_copy = malloc(sizeof *strides * (size_t)n_alloc);
        if (!shape || !strides || !shape_copy || !strides_copy) abort();
        for (int32_t d = 0; d < n_alloc; d++) shape[d] = fz_int(&f, 0, 5);
        if (dl.ndim > MAX_DIMS) shape[MAX_DIMS - 1] = -1;
        /* Per dimension, from the last: the compact row-major stride (the
         * product of the later extents, wrapping mod 2^64 the way a careless
         * producer's would) or anything. */
        uint64_t compact = 1;
        for (int32_t d = n_alloc - 1; d >= 0; d--) {
            uint8_t k = fz_u8(&f);
            strides[d] = k < 0xA0 ? (int64_t)compact : fz_int(&f, -2, 8);
            compact *= (uint64_t)shape[d];
        }
        memcpy(shape_copy, shape, sizeof *shape * (size_t)n_alloc);
        memcpy(strides_copy, strides, sizeof *strides * (size_t)n_alloc);
    }
    dl.shape = shape_null ? NULL : shape;
    /* Strides are only read for dimensions that exist. */
    dl.strides = has_strides && n_alloc > 0 ? strides : NULL;
    if (dl.ndim > MAX_DIMS && dl.strides != NULL) dl.strides = NULL; /* never reached */

    mpidp_dl_tensor_t dl_copy = dl;
    expect_t e = reference(&dl, dl_null, out_null, read_only, req);

    mpidp_tensor_t out, out_before;
    memset(&out, 0xA5, sizeof out);
    out_before = out;
    mpidp_error_clear();
    int rc = mpidp_tensor_from_dlpack(dl_null ? NULL : &dl, read_only, req,
                                      out_null ? NULL : &out);

    /* The input is const. */
    FZ_CHECK(memcmp(&dl, &dl_copy, sizeof dl) == 0, "dl struct written");
    if (n_alloc > 0) {
        FZ_CHECK(memcmp(shape, shape_copy, sizeof *shape * (size_t)n_alloc) == 0, "shape written");
        FZ_CHECK(memcmp(strides, strides_copy, sizeof *strides * (size_t)n_alloc) == 0,
                 "strides written");
    }

    if (rc == MPIDP_OK) {
        FZ_CHECK(e.must == 0, "accepted a tensor the contract refuses (reasons 0x%x): ndim %d "
                 "dtype %u/%u/%u device %d data %p off %llu ro %d req %u",
                 e.must, (int)dl.ndim, dl.dtype.code, dl.dtype.bits, dl.dtype.lanes,
                 (int)dl.device.device_type, dl.data, (unsigned long long)dl.byte_offset,
                 read_only, req);
        FZ_CHECK(out.numel == e.numel, "numel %zu, product of extents %zu", out.numel, e.numel);
        FZ_CHECK(out.data == (void *)((uintptr_t)dl.data + (uintptr_t)dl.byte_offset),
                 "data %p != base %p + offset %llu", out.data, dl.data,
                 (unsigned long long)dl.byte_offset);
        size_t esize = mpidp_dtype_size(out.dtype);
        FZ_CHECK(out.dtype == e.dtype && esize != 0, "dtype %d, expected %d", (int)out.dtype,
                 (int)e.dtype);
        FZ_CHECK(out.numel <= SIZE_MAX / esize, "numel %zu overflows bytes", out.numel);
        if (out.numel != 0) {
            FZ_CHECK(dl.data != NULL, "non-empty tensor with NULL data");
            FZ_CHECK((uintptr_t)out.data % esize == 0, "data %p not aligned to %zu", out.data,
                     esize);
            if (dl.strides != NULL) {
                int64_t want = 1;
                for (int32_t d = dl.ndim - 1; d >= 0; d--) {
                    FZ_CHECK(dl.shape[d] <= 1 || dl.strides[d] == want,
                             "dim %d extent %lld stride %lld, compact %lld", (int)d,
                             (long long)dl.shape[d], (long long)dl.strides[d], (long long)want);
                    want *= dl.shape[d];
                }
            }
        }
        FZ_CHECK(out.device == e.device, "device %d, expected %d", (int)out.device,
                 (int)e.device);
        FZ_CHECK(out.device_id == dl.device.device_id, "device_id");
        FZ_CHECK(out.read_only == (read_only != 0), "read_only %d for flag %d", out.read_only,
                 read_only);
        if (req & MPIDP_TENSOR_WRITABLE) FZ_CHECK(!out.read_only, "read-only accepted");
        if (req & MPIDP_TENSOR_CPU_ONLY) FZ_CHECK(out.device == MPIDP_DEV_CPU, "CUDA accepted");
    } else {
        FZ_CHECK(rc < 0 && rc >= -31, "status %d", rc);
        FZ_CHECK(e.must != 0 || e.may != 0,
                 "refused a valid tensor with %s (%s): ndim %d dtype %u/%u/%u device %d",
                 mpidp_status_name(rc), mpidp_error_detail(), (int)dl.ndim, dl.dtype.code,
                 dl.dtype.bits, dl.dtype.lanes, (int)dl.device.device_type);
        FZ_CHECK((e.must | e.may) & CODE_BIT(rc),
                 "status %s (%s) is none of the reasons 0x%x (may 0x%x)", mpidp_status_name(rc),
                 mpidp_error_detail(), e.must, e.may);
        FZ_CHECK(mpidp_error_detail()[0] != '\0', "no detail for %s", mpidp_status_name(rc));
        FZ_CHECK(strlen(mpidp_error_detail()) < 512, "detail not terminated");
        FZ_CHECK(memcmp(&out, &out_before, sizeof out) == 0, "out written on failure");
    }

    /* The small helpers take any int. */
    int any = (int)(uint32_t)(uint64_t)fz_int(&f, -2, 5);
    size_t sz = mpidp_dtype_size(any);
    const char *name = mpidp_dtype_name(any);
    FZ_CHECK((sz == 0) == (strcmp(name, "unknown") == 0), "dtype %d: size %zu name %s", any, sz,
             name);
    FZ_CHECK(mpidp_strerror(any) != NULL && mpidp_status_name(any) != NULL, "status names");

    free(shape);
    free(strides);
    free(shape_copy);
    free(strides_copy);
    return 0;
}
