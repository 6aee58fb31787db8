/* mpidp_convert: each op on host tensors gives exactly what the kernel table's
 * function gives (same path, same arguments), with a chosen or a named table;
 * every bad combination (dtype of each operand, sizes, read-only dst, mixed
 * devices, a stream for host tensors, a host table for CUDA ones, an unknown
 * op) is refused with its status and a detail naming the operand, before any
 * memory is touched; CUDA tensors reach the CUDA entry points (in this build,
 * the stub: MPIDP_ENOTSUP). */
#include "mpidp/convert.h"
#include "mpidp/quant8.h"
#include "mpidp/status.h"
#include "test.h"

#define N 37

static mpidp_tensor_t host(void *data, mpidp_dtype_t dt, size_t n)
{
    mpidp_tensor_t t = {.data = data, .numel = n, .dtype = dt, .device = MPIDP_DEV_CPU};
    return t;
}

static void fill(float *x, float base)
{
    for (int i = 0; i < N; i++) x[i] = base + 0.37f * (float)i - (float)(i % 5) * 1.5f;
}

TEST(ops_match_the_table_functions)
{
    const mpidp_pack_kernels_t *ref;
    ASSERT_OK(mpidp_pack_kernels_for("ref", &ref));
    const mpidp_pack_kernels_t *tables[] = {NULL, ref};
    for (int k = 0; k < 2; k++) {
        const mpidp_pack_kernels_t *want_k = tables[k] ? tables[k] : mpidp_pack_kernels();
        float src[N], r[N], got[N], want[N];
        uint16_t h_got[N], h_want[N], other[N];
        fill(src, -3.0f);
        fill(r, 1.25f);
        mpidp_tensor_t s = host(src, MPIDP_F32, N), rt = host(r, MPIDP_F32, N);
        mpidp_tensor_t hd = host(h_got, MPIDP_BF16, N);
        ASSERT_OK(mpidp_convert(MPIDP_CONVERT_PACK, &hd, &s, &rt, 0.5f, 0, 0, tables[k], NULL));
        want_k->pack_bf16(h_want, src, r, 0.5f, N);
        ASSERT_TRUE(memcmp(h_got, h_want, sizeof h_got) == 0);

        hd.dtype = MPIDP_F16;
        ASSERT_OK(mpidp_convert(MPIDP_CONVERT_PACK, &hd, &s, NULL, 2.0f, 0, 0, tables[k], NULL));
        want_k->pack_fp16(h_want, src, NULL, 2.0f, N);
        ASSERT_TRUE(memcmp(h_got, h_want, sizeof h_got) == 0);

        fill(got, 0.5f);
        memcpy(want, got, sizeof got);
        mpidp_tensor_t d = host(got, MPIDP_F32, N), hs = host(h_got, MPIDP_F16, N);
        ASSERT_OK(mpidp_convert(MPIDP_CONVERT_UNPACK, &d, &hs, &rt, 0.25f, 2.0f, -1.0f, tables[k], NULL));
        want_k->unpack_fp16(want, h_got, r, 0.25f, 2.0f, -1.0f, N);
        ASSERT_TRUE(memcmp(got, want, sizeof got) == 0);

        ASSERT_OK(mpidp_convert(MPIDP_CONVERT_UNPACK, &d, &s, &rt, 0.5f, 0.5f, 1.0f, tables[k], NULL));
        want_k->merge_f32(want, src, r, 0.5f, 0.5f, 1.0f, N);
        ASSERT_TRUE(memcmp(got, want, sizeof got) == 0);

        for (int i = 0; i < N; i++) other[i] = (uint16_t)(0x3C00 + 17 * i);
        memcpy(h_want, h_got, sizeof h_got);
        mpidp_tensor_t io = host(h_got, MPIDP_F16, N), o = host(other, MPIDP_F16, N);
        ASSERT_OK(mpidp_convert(MPIDP_CONVERT_SUM16, &io, &o, NULL, 0, 0, 0, tables[k], NULL));
        want_k->sum_fp16(h_want, other, N);
        ASSERT_TRUE(memcmp(h_got, h_want, sizeof h_got) == 0);
    }
}

/* Runs a call that must fail with `status` and a detail containing `needle`,
 * with dst (a canary) unchanged. */
#define REFUSED(status, needle, call)                                           \
    do {                                                                        \
        mpidp_error_clear();                                                    \
        ASSERT_EQ_INT((call), (status));                                        \
        ASSERT_TRUE(strstr(mpidp_error_detail(), (needle)) != NULL);            \
        for (int i_ = 0; i_ < N; i_++) ASSERT_EQ_INT(canary[i_], 0x5A5A);       \
    } while (0)

TEST(bad_combinations_are_refused_before_any_write)
{
    float f[N] = {0}, f2[N] = {0};
    uint16_t canary[N], h[N] = {0};
    for (int i = 0; i < N; i++) canary[i] = 0x5A5A;
    mpidp_tensor_t dst16 = host(canary, MPIDP_BF16, N), f32 = host(f, MPIDP_F32, N);
    mpidp_tensor_t bf = host(h, MPIDP_BF16, N), fp = host(h, MPIDP_F16, N);
    mpidp_tensor_t f64 = host(f2, MPIDP_F64, N / 2), short32 = host(f2, MPIDP_F32, N - 1);
    mpidp_tensor_t dst32 = host(canary, MPIDP_F32, N / 2), src16 = host(h, MPIDP_BF16, N / 2);
    REFUSED(MPIDP_EDTYPE, "dst: unexpected dtype float32",
            mpidp_convert(MPIDP_CONVERT_PACK, &dst32, &f32, NULL, 1, 0, 0, NULL, NULL));
    REFUSED(MPIDP_EDTYPE, "src: unexpected dtype bfloat16",
            mpidp_convert(MPIDP_CONVERT_PACK, &dst16, &bf, NULL, 1, 0, 0, NULL, NULL));
    REFUSED(MPIDP_EDTYPE, "ref: unexpected dtype float16",
            mpidp_convert(MPIDP_CONVERT_PACK, &dst16, &f32, &fp, 1, 0, 0, NULL, NULL));
    REFUSED(MPIDP_EDTYPE, "src: unexpected dtype float64",
            mpidp_convert(MPIDP_CONVERT_UNPACK, &dst32, &f64, NULL, 0, 1, 0, NULL, NULL));
    REFUSED(MPIDP_EDTYPE, "inout and src must have the same dtype",
            mpidp_convert(MPIDP_CONVERT_SUM16, &dst16, &fp, NULL, 0, 0, 0, NULL, NULL));
    REFUSED(MPIDP_EDTYPE, "inout: unexpected dtype float32",
            mpidp_convert(MPIDP_CONVERT_SUM16, &dst32, &f32, NULL, 0, 0, 0, NULL, NULL));
    REFUSED(MPIDP_EINVAL, "pack: tensors differ in size (37 vs 36 elements)",
            mpidp_convert(MPIDP_CONVERT_PACK, &dst16, &short32, NULL, 1, 0, 0, NULL, NULL));
    REFUSED(MPIDP_EINVAL, "unpack: tensors differ in size",
            mpidp_convert(MPIDP_CONVERT_UNPACK, &dst32, &src16, &f32, 0, 1, 1, NULL, NULL));
    REFUSED(MPIDP_EINVAL, "sum16 takes no ref",
            mpidp_convert(MPIDP_CONVERT_SUM16, &dst16, &bf, &bf, 0, 0, 0, NULL, NULL));
    mpidp_tensor_t ro = dst16;
    ro.read_only = 1;
    REFUSED(MPIDP_EINVAL, "dst: read-only",
            mpidp_convert(MPIDP_CONVERT_PACK, &ro, &f32, NULL, 1, 0, 0, NULL, NULL));
    REFUSED(MPIDP_EINVAL, "unknown conversion 7",
            mpidp_convert(7, &dst16, &f32, NULL, 1, 0, 0, NULL, NULL));
    REFUSED(MPIDP_EINVAL, "a CUDA stream was given for host tensors",
            mpidp_convert(MPIDP_CONVERT_PACK, &dst16, &f32, NULL, 1, 0, 0, NULL, (void *)1));
    mpidp_tensor_t on_gpu = f32;
    on_gpu.device = MPIDP_DEV_CUDA;
    on_gpu.device_id = 1;
    REFUSED(MPIDP_EDEVICE, "pack: dst is on cpu but ref is on cuda:1",
            mpidp_convert(MPIDP_CONVERT_PACK, &dst16, &f32, &on_gpu, 1, 0, 0, NULL, NULL));
    mpidp_tensor_t gpu_dst = dst16, gpu0_src = on_gpu;
    gpu_dst.device = MPIDP_DEV_CUDA;
    gpu0_src.device_id = 0;
    REFUSED(MPIDP_EDEVICE, "pack: dst is on cuda:0 but src is on cuda:1",
            mpidp_convert(MPIDP_CONVERT_PACK, &gpu_dst, &on_gpu, NULL, 1, 0, 0, NULL, NULL));
    REFUSED(MPIDP_EINVAL, "a host kernel path was given for CUDA tensors",
            mpidp_convert(MPIDP_CONVERT_PACK, &gpu_dst, &gpu0_src, NULL, 1, 0, 0,
                          mpidp_pack_kernels(), NULL));
    ASSERT_TRUE(mpidp_convert_name(5) == NULL && mpidp_convert_name(-1) == NULL);
    ASSERT_STREQ(mpidp_convert_name(MPIDP_CONVERT_SUM16), "sum16");
    ASSERT_STREQ(mpidp_convert_name(MPIDP_CONVERT_Q8_DECODE), "dequantize8");
    /* The 8-bit ops: records must be exactly the bytes the elements take. */
    static uint8_t rec[2 * MPIDP_Q8_RECORD];
    mpidp_tensor_t q = {.data = rec, .numel = MPIDP_Q8_RECORD - 1, .dtype = MPIDP_U8,
                        .device = MPIDP_DEV_CPU};
    REFUSED(MPIDP_EINVAL, "quantize8: dst holds 263 bytes, but",
            mpidp_convert(MPIDP_CONVERT_Q8_ENCODE, &q, &f32, NULL, 1, 0, 0, NULL, NULL));
    REFUSED(MPIDP_EDTYPE, "dst: unexpected dtype float32",
            mpidp_convert(MPIDP_CONVERT_Q8_ENCODE, &f32, &f32, NULL, 1, 0, 0, NULL, NULL));
    q.numel = mpidp_q8_bytes(N);
    REFUSED(MPIDP_EINVAL, "quantize8 takes no ref",
            mpidp_convert(MPIDP_CONVERT_Q8_ENCODE, &q, &f32, &f32, 1, 0, 0, NULL, NULL));
}

TEST(cuda_tensors_reach_the_cuda_entry_points)
{
    uint16_t canary[N];
    float f[N] = {0};
    for (int i = 0; i < N; i++) canary[i] = 0x5A5A;
    mpidp_tensor_t d = host(canary, MPIDP_BF16, N), s = host(f, MPIDP_F32, N);
    d.device = s.device = MPIDP_DEV_CUDA;
    /* The tests link the stub (no MPIDP_WITH_CUDA): the call fails cleanly there. */
    REFUSED(MPIDP_ENOTSUP, "built without CUDA",
            mpidp_convert(MPIDP_CONVERT_PACK, &d, &s, NULL, 1, 0, 0, NULL, NULL));
}

TEST(fp16_overflows_are_counted_once_per_element)
{
    float src[N], ref[N];
    uint16_t wire[N];
    for (int i = 0; i < N; i++) {
        src[i] = (float)i;
        ref[i] = 0.0f;
    }
    src[3] = 7e4f;       /* beyond 65504: overflows */
    src[5] = -1e9f;      /* overflows */
    src[8] = INFINITY;   /* already infinite: not an overflow */
    ref[9] = NAN;        /* NaN reference: whatever comes out is not an overflow */
    src[9] = 1e6f;
    size_t before = mpidp_fp16_overflow_total();
    mpidp_pack_kernels()->pack_fp16(wire, src, NULL, 1.0f, N);
    ASSERT_EQ_INT(mpidp_fp16_count_overflow(wire, src, ref, N), 2);
    ASSERT_EQ_INT(mpidp_fp16_overflow_total(), before + 2);
    ASSERT_EQ_INT(mpidp_fp16_count_overflow(wire, src, NULL, N), 3); /* 9 counts without ref */
    for (int i = 0; i < N; i++) src[i] = 1.0f;
    mpidp_pack_kernels()->pack_fp16(wire, src, NULL, 65504.0f, N);   /* exactly the largest */
    ASSERT_EQ_INT(mpidp_fp16_count_overflow(wire, src, NULL, N), 0);
}

TEST_MAIN(ops_match_the_table_functions, bad_combinations_are_refused_before_any_write,
          cuda_tensors_reach_the_cuda_entry_points, fp16_overflows_are_counted_once_per_element)
