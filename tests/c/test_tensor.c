/* DLPack intake: dtypes, devices, contiguity, offsets, flags. */
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "test.h"

static mpidp_dl_tensor_t make(void *data, int32_t ndim, int64_t *shape, int64_t *strides,
                              uint8_t code, uint8_t bits)
{
    mpidp_dl_tensor_t t = {data, {MPIDP_DL_CPU, 0}, ndim, {code, bits, 1}, shape, strides, 0};
    return t;
}

TEST(accepts_contiguous_floats)
{
    float buf[12];
    int64_t shape[] = {3, 4};
    mpidp_dl_tensor_t dl = make(buf, 2, shape, NULL, MPIDP_DL_FLOAT, 32);
    mpidp_tensor_t t;
    ASSERT_OK(mpidp_tensor_from_dlpack(&dl, 0, MPIDP_TENSOR_WRITABLE, &t));
    ASSERT_EQ_INT(t.numel, 12);
    ASSERT_EQ_INT(t.dtype, MPIDP_F32);
    ASSERT_TRUE(t.data == buf);
    int64_t strides[] = {4, 1};
    dl.strides = strides;
    ASSERT_OK(mpidp_tensor_from_dlpack(&dl, 0, 0, &t));
    dl.dtype = (mpidp_dl_dtype_t){MPIDP_DL_BFLOAT, 16, 1};
    ASSERT_OK(mpidp_tensor_from_dlpack(&dl, 0, 0, &t));
    ASSERT_EQ_INT(t.dtype, MPIDP_BF16);
    dl.dtype = (mpidp_dl_dtype_t){MPIDP_DL_FLOAT, 64, 1};
    ASSERT_OK(mpidp_tensor_from_dlpack(&dl, 0, 0, &t));
    ASSERT_EQ_INT(t.dtype, MPIDP_F64);
}

TEST(byte_offset_is_applied_and_checked)
{
    float buf[8];
    int64_t shape[] = {4};
    mpidp_dl_tensor_t dl = make(buf, 1, shape, NULL, MPIDP_DL_FLOAT, 32);
    dl.byte_offset = 8;
    mpidp_tensor_t t;
    ASSERT_OK(mpidp_tensor_from_dlpack(&dl, 0, 0, &t));
    ASSERT_TRUE(t.data == buf + 2);
    dl.byte_offset = 2;
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, 0, &t), MPIDP_EINVAL);
}

TEST(refuses_non_contiguous_and_bad_dtypes)
{
    float buf[16];
    int64_t shape[] = {4, 2};
    int64_t strides[] = {1, 4}; /* a transpose */
    mpidp_dl_tensor_t dl = make(buf, 2, shape, strides, MPIDP_DL_FLOAT, 32);
    mpidp_tensor_t t;
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, 0, &t), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "contiguous") != NULL);
    /* Extent-1 dimensions may carry any stride. */
    int64_t shape1[] = {1, 8};
    int64_t strides1[] = {999, 1};
    dl = make(buf, 2, shape1, strides1, MPIDP_DL_FLOAT, 32);
    ASSERT_OK(mpidp_tensor_from_dlpack(&dl, 0, 0, &t));
    dl.dtype = (mpidp_dl_dtype_t){MPIDP_DL_INT, 64, 1};
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, 0, &t), MPIDP_EDTYPE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "int64") != NULL);
    dl.dtype = (mpidp_dl_dtype_t){MPIDP_DL_FLOAT, 32, 4};
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, 0, &t), MPIDP_EDTYPE);
    dl.dtype = (mpidp_dl_dtype_t){MPIDP_DL_COMPLEX, 64, 1};
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, 0, &t), MPIDP_EDTYPE);
    /* Integers and bool only on request (the collectives), each its own size. */
    static const struct { uint8_t code, bits; int dtype; size_t size; } ints[] = {
        {MPIDP_DL_INT, 8, MPIDP_I8, 1},   {MPIDP_DL_UINT, 8, MPIDP_U8, 1},
        {MPIDP_DL_INT, 16, MPIDP_I16, 2}, {MPIDP_DL_INT, 32, MPIDP_I32, 4},
        {MPIDP_DL_INT, 64, MPIDP_I64, 8}, {MPIDP_DL_BOOL, 8, MPIDP_BOOL, 1}};
    for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++) {
        dl.dtype = (mpidp_dl_dtype_t){ints[k].code, ints[k].bits, 1};
        ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, 0, &t), MPIDP_EDTYPE);
        ASSERT_OK(mpidp_tensor_from_dlpack(&dl, 0, MPIDP_TENSOR_ANY_DTYPE, &t));
        ASSERT_EQ_INT(t.dtype, ints[k].dtype);
        ASSERT_EQ_INT(mpidp_dtype_size(t.dtype), ints[k].size);
        ASSERT_EQ_INT(mpidp_dtype_is_float(t.dtype), 0);
    }
    dl.dtype = (mpidp_dl_dtype_t){MPIDP_DL_UINT, 16, 1};   /* no uint16 */
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, MPIDP_TENSOR_ANY_DTYPE, &t), MPIDP_EDTYPE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "int64, bool") != NULL);
    ASSERT_EQ_INT(mpidp_dtype_is_float(MPIDP_BF16), 1);
    ASSERT_TRUE(strcmp(mpidp_dtype_name(MPIDP_BOOL), "bool") == 0);
}

TEST(devices_flags_and_shapes)
{
    float buf[4];
    int64_t shape[] = {4};
    mpidp_dl_tensor_t dl = make(buf, 1, shape, NULL, MPIDP_DL_FLOAT, 32);
    mpidp_tensor_t t;
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 1, MPIDP_TENSOR_WRITABLE, &t), MPIDP_EINVAL);
    ASSERT_OK(mpidp_tensor_from_dlpack(&dl, 1, 0, &t));
    ASSERT_EQ_INT(t.read_only, 1);
    dl.device.device_type = MPIDP_DL_CUDA;
    ASSERT_OK(mpidp_tensor_from_dlpack(&dl, 0, 0, &t));
    ASSERT_EQ_INT(t.device, MPIDP_DEV_CUDA);
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, MPIDP_TENSOR_CPU_ONLY, &t), MPIDP_EDEVICE);
    dl.device.device_type = 7; /* Vulkan */
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, 0, &t), MPIDP_EDEVICE);
    dl.device.device_type = MPIDP_DL_CPU;
    int64_t neg[] = {-1};
    dl.shape = neg;
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, 0, &t), MPIDP_EINVAL);
    int64_t empty[] = {0, 5};
    int64_t any[] = {7, 3};
    dl = make(NULL, 2, empty, any, MPIDP_DL_FLOAT, 32);
    ASSERT_OK(mpidp_tensor_from_dlpack(&dl, 0, 0, &t));
    ASSERT_EQ_INT(t.numel, 0);
    dl = make(NULL, 0, NULL, NULL, MPIDP_DL_FLOAT, 32); /* a scalar needs data */
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, 0, &t), MPIDP_EINVAL);
    int64_t huge[] = {INT64_MAX / 2, INT64_MAX / 2};
    dl = make(buf, 2, huge, NULL, MPIDP_DL_FLOAT, 32);
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(&dl, 0, 0, &t), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_tensor_from_dlpack(NULL, 0, 0, &t), MPIDP_EINVAL);
}

TEST_MAIN(accepts_contiguous_floats, byte_offset_is_applied_and_checked,
          refuses_non_contiguous_and_bad_dtypes, devices_flags_and_shapes)
