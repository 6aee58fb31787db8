/* mpidp_convert: the conversion kernels' dispatch over dtypes and devices
 * (contract in mpidp/convert.h). */
#include "mpidp/convert.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "mpidp/cuda.h"
#include "mpidp/quant8.h"
#include "mpidp/status.h"
#include "fail.h"
#include "quant8_internal.h"

#define BIT(dt) (1u << (dt))
#define HALF (BIT(MPIDP_BF16) | BIT(MPIDP_F16))
#define F32 BIT(MPIDP_F32)
#define U8 BIT(MPIDP_U8)

/* The dtypes each operand of each op may have (the bits of mpidp_dtype_t). */
static const struct {
    const char *name;
    unsigned dst, src, ref;
} ops[] = {
    [MPIDP_CONVERT_PACK] = {"pack", HALF, F32, F32},
    [MPIDP_CONVERT_UNPACK] = {"unpack", F32, HALF | F32, F32},
    [MPIDP_CONVERT_SUM16] = {"sum16", HALF, HALF, 0},
    [MPIDP_CONVERT_Q8_ENCODE] = {"quantize8", U8, F32, 0},
    [MPIDP_CONVERT_Q8_DECODE] = {"dequantize8", F32, U8, 0},
};

static int is_q8(int op) { return op == MPIDP_CONVERT_Q8_ENCODE || op == MPIDP_CONVERT_Q8_DECODE; }

const char *mpidp_convert_name(int op)
{
    return op >= 0 && op < (int)(sizeof ops / sizeof ops[0]) ? ops[op].name : NULL;
}

static void where(const mpidp_tensor_t *t, char *buf, size_t len)
{
    if (t->device == MPIDP_DEV_CUDA) snprintf(buf, len, "cuda:%d", t->device_id);
    else snprintf(buf, len, "cpu");
}

static int same_device(const mpidp_tensor_t *a, const mpidp_tensor_t *b)
{
    return a->device == b->device && (a->device != MPIDP_DEV_CUDA || a->device_id == b->device_id);
}

/* Each operand: allowed dtype, on dst's device, dst's size (the 8-bit ops:
 * the records' bytes of the fp32 side's elements). */
static int check_operand(int op, const char *name, const mpidp_tensor_t *t, unsigned dtypes,
                         const char *dst_name, const mpidp_tensor_t *dst)
{
    const char *fname = ops[op].name;
    if (!(dtypes & BIT(t->dtype)))
        return mpidp__fail(MPIDP_EDTYPE, "%s: unexpected dtype %s", name, mpidp_dtype_name(t->dtype));
    if (!same_device(t, dst)) {
        char a[32], b[32];
        where(dst, a, sizeof a);
        where(t, b, sizeof b);
        return mpidp__fail(MPIDP_EDEVICE, "%s: %s is on %s but %s is on %s; all tensors of "
                           "one call must be on one device", fname, dst_name, a, name, b);
    }
    if (is_q8(op)) {
        int enc = op == MPIDP_CONVERT_Q8_ENCODE;
        size_t n = enc ? t->numel : dst->numel, bytes = enc ? dst->numel : t->numel;
        if (bytes != mpidp_q8_bytes(n))
            return mpidp__fail(MPIDP_EINVAL, "%s: %s holds %zu bytes, but %zu elements take %zu "
                               "(mpidp.kernels.quant8_bytes)", fname, enc ? dst_name : name, bytes, n,
                               mpidp_q8_bytes(n));
    } else if (t->numel != dst->numel) {
        return mpidp__fail(MPIDP_EINVAL, "%s: tensors differ in size (%zu vs %zu elements)",
                           fname, dst->numel, t->numel);
    }
    return MPIDP_OK;
}

static int check(int op, const mpidp_tensor_t *dst, const mpidp_tensor_t *src,
                 const mpidp_tensor_t *ref, const mpidp_pack_kernels_t *host, void *stream)
{
    const char *fname = mpidp_convert_name(op);
    if (fname == NULL) return mpidp__fail(MPIDP_EINVAL, "unknown conversion %d", op);
    if (dst == NULL || src == NULL) return mpidp__fail(MPIDP_EINVAL, "%s: dst and src are required", fname);
    const char *dst_name = op == MPIDP_CONVERT_SUM16 ? "inout" : "dst";
    if (!(ops[op].dst & BIT(dst->dtype)))
        return mpidp__fail(MPIDP_EDTYPE, "%s: unexpected dtype %s", dst_name, mpidp_dtype_name(dst->dtype));
    if (dst->read_only) return mpidp__fail(MPIDP_EINVAL, "%s: read-only, expected a writable tensor", dst_name);
    int rc = check_operand(op, "src", src, ops[op].src, dst_name, dst);
    if (rc == MPIDP_OK && ref != NULL) {
        if (ops[op].ref == 0) return mpidp__fail(MPIDP_EINVAL, "%s takes no ref", fname);
        rc = check_operand(op, "ref", ref, ops[op].ref, dst_name, dst);
    }
    if (rc != MPIDP_OK) return rc;
    if (op == MPIDP_CONVERT_SUM16 && src->dtype != dst->dtype)
        return mpidp__fail(MPIDP_EDTYPE, "sum16: inout and src must have the same dtype (got %s and %s)",
                           mpidp_dtype_name(dst->dtype), mpidp_dtype_name(src->dtype));
    if (dst->device == MPIDP_DEV_CUDA && host != NULL)
        return mpidp__fail(MPIDP_EINVAL, "a host kernel path was given for CUDA tensors");
    if (dst->device != MPIDP_DEV_CUDA && stream != NULL)
        return mpidp__fail(MPIDP_EINVAL, "a CUDA stream was given for host tensors");
    return MPIDP_OK;
}

static int run_cuda(int op, const mpidp_tensor_t *dst, const mpidp_tensor_t *src, const float *r,
                    float a, float b, float c, void *s)
{
    size_t n = dst->numel;
    int bf16 = dst->dtype == MPIDP_BF16;
    switch (op) {
    case MPIDP_CONVERT_PACK:
        return bf16 ? mpidp_cuda_pack_bf16(dst->data, src->data, r, a, n, s)
                    : mpidp_cuda_pack_fp16(dst->data, src->data, r, a, n, s);
    case MPIDP_CONVERT_Q8_ENCODE: return mpidp_cuda_q8_encode(dst->data, src->data, a, src->numel, s);
    case MPIDP_CONVERT_Q8_DECODE: return mpidp_cuda_q8_decode(dst->data, src->data, a != 0.0f, n, s);
    case MPIDP_CONVERT_UNPACK:
        return src->dtype == MPIDP_F32    ? mpidp_cuda_merge_f32(dst->data, src->data, r, a, b, c, n, s)
               : src->dtype == MPIDP_BF16 ? mpidp_cuda_unpack_bf16(dst->data, src->data, r, a, b, c, n, s)
                                          : mpidp_cuda_unpack_fp16(dst->data, src->data, r, a, b, c, n, s);
    default:
        return bf16 ? mpidp_cuda_sum_bf16(dst->data, src->data, n, s)
                    : mpidp_cuda_sum_fp16(dst->data, src->data, n, s);
    }
}

/* The 8-bit kernels of the pack table `k`'s path ("avx512_bf16": "avx512"). */
static const mpidp_q8_kernels_t *q8_of(const mpidp_pack_kernels_t *k)
{
    const mpidp_q8_kernels_t *q = NULL;
    if (mpidp_q8_kernels_for(strncmp(k->name, "avx512", 6) == 0 ? "avx512" : k->name, &q) != MPIDP_OK)
        q = &mpidp__q8_ref; /* not reached: k's path runs on this CPU */
    return q;
}

static void run_host(int op, const mpidp_pack_kernels_t *k, const mpidp_tensor_t *dst,
                     const mpidp_tensor_t *src, const float *r, float a, float b, float c)
{
    size_t n = dst->numel;
    int bf16 = dst->dtype == MPIDP_BF16;
    switch (op) {
    case MPIDP_CONVERT_Q8_ENCODE:
        (k ? q8_of(k) : mpidp_q8_kernels())->encode(dst->data, src->data, a, src->numel);
        break;
    case MPIDP_CONVERT_Q8_DECODE:
        (k ? q8_of(k) : mpidp_q8_kernels())->decode(dst->data, src->data, a != 0.0f, n);
        break;
    case MPIDP_CONVERT_PACK:
        (bf16 ? k->pack_bf16 : k->pack_fp16)(dst->data, src->data, r, a, n);
        break;
    case MPIDP_CONVERT_UNPACK:
        if (src->dtype == MPIDP_F32) k->merge_f32(dst->data, src->data, r, a, b, c, n);
        else (src->dtype == MPIDP_BF16 ? k->unpack_bf16 : k->unpack_fp16)(dst->data, src->data, r, a, b, c, n);
        break;
    default:
        (bf16 ? k->sum_bf16 : k->sum_fp16)(dst->data, src->data, n);
    }
}

int mpidp_convert(int op, const mpidp_tensor_t *dst, const mpidp_tensor_t *src,
                  const mpidp_tensor_t *ref, float a, float b, float c,
                  const mpidp_pack_kernels_t *host, void *stream)
{
    int rc = check(op, dst, src, ref, host, stream);
    if (rc != MPIDP_OK) return rc;
    const float *r = ref ? ref->data : NULL;
    if (dst->device == MPIDP_DEV_CUDA) return run_cuda(op, dst, src, r, a, b, c, stream);
    if (host == NULL && !is_q8(op)) host = mpidp_pack_kernels();
    run_host(op, host, dst, src, r, a, b, c);
    return MPIDP_OK;
}

static _Atomic size_t fp16_overflows;

size_t mpidp_fp16_count_overflow(const uint16_t *wire, const float *src, const float *ref, size_t n)
{
    size_t inf = 0;
    for (size_t i = 0; i < n; i++) inf += (wire[i] & 0x7FFFu) == 0x7C00u; /* vectorises */
    if (inf == 0) return 0;
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        if ((wire[i] & 0x7FFFu) == 0x7C00u && isfinite(src[i]) && (ref == NULL || isfinite(ref[i])))
            count++;
    atomic_fetch_add(&fp16_overflows, count);
    return count;
}

size_t mpidp_fp16_overflow_total(void) { return atomic_load(&fp16_overflows); }
