/* The collectives on integer and bool tensors across real ranks (mpirun -np 2,
 * also 3 and 4; rank-agnostic): allreduce with sum, min, max and prod of every
 * integer dtype and min/max of bool against results computed here from all
 * ranks' inputs; the op/dtype combinations MPI has no meaning for refused
 * before anything is posted; allgather of equal blocks; a broadcast of int64;
 * reduce-scatter (sum and avg, float32 and float64) and allgatherv with
 * uneven counts, zero counts included, against values computed here. */
#include <mpi.h>
#include <stdint.h>
#include <string.h>

#include "mpidp/allreduce.h"
#include "mpidp/collectives.h"
#include "mpidp/operation.h"
#include "mpidp/mpiops.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "mpi_world.h"
#include "test.h"

#define N 11

/* Rank r's value at i: small, signed, never 0 for prod (stays in int8 for 4 ranks). */
static int64_t input(int r, size_t i) { return (int64_t)((i + (size_t)r) % 5) - 2 + (((i + (size_t)r) % 5) == 2); }

static int64_t expected(int op, size_t i)
{
    int64_t acc = input(0, i);
    for (int r = 1; r < size_; r++) {
        int64_t v = input(r, i);
        if (op == MPIDP_OP_SUM) acc += v;
        else if (op == MPIDP_OP_MIN) acc = v < acc ? v : acc;
        else if (op == MPIDP_OP_MAX) acc = v > acc ? v : acc;
        else acc *= v;
    }
    return acc;
}

static int reduce(void *data, int dtype, int op, mpidp_reqtable_t *reqs)
{
    mpidp_tensor_t t = {.data = data, .numel = N, .dtype = dtype, .device = MPIDP_DEV_CPU};
    mpidp_allreduce_opts_t o = {.op = op, .wire = -1, .chunk_elems = 4, .max_in_flight = 2,
                                .drain_timeout_s = 10.0, .what = "t"};
    mpidp_allreduce_t *x = NULL;
    int rc = mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &x);
    if (rc != MPIDP_OK) return rc;
    rc = mpidp_allreduce_wait(x, 10.0);
    return rc == MPIDP_OK ? mpidp_allreduce_free(x) : rc;
}

/* Fills data (dtype) with this rank's inputs, reduces, and returns element i. */
#define CASE(ctype, dtype_code)                                                 \
    do {                                                                        \
        ctype v[N];                                                             \
        for (size_t i = 0; i < N; i++) v[i] = (ctype)input(rank_, i);          \
        ASSERT_OK(reduce(v, dtype_code, op, reqs));                             \
        for (size_t i = 0; i < N; i++) ASSERT_EQ_INT((int64_t)v[i], (ctype)expected(op, i)); \
    } while (0)

TEST(integer_allreduce_sum_min_max_prod)
{
    mpidp_reqtable_t *reqs = table(8);
    static const int ops[] = {MPIDP_OP_SUM, MPIDP_OP_MIN, MPIDP_OP_MAX, MPIDP_OP_PROD};
    for (size_t k = 0; k < 4; k++) {
        int op = ops[k];
        CASE(int8_t, MPIDP_I8);
        CASE(int16_t, MPIDP_I16);
        CASE(int32_t, MPIDP_I32);
        CASE(int64_t, MPIDP_I64);
        if (op != MPIDP_OP_PROD && op != MPIDP_OP_SUM) {
            uint8_t u[N];
            for (size_t i = 0; i < N; i++) u[i] = (uint8_t)(input(rank_, i) + 2);
            ASSERT_OK(reduce(u, MPIDP_U8, op, reqs));
            for (size_t i = 0; i < N; i++) ASSERT_EQ_INT(u[i], expected(op, i) + 2);
        }
    }
    /* float32 min/max/prod too (exact for these values) */
    float f[N];
    for (size_t i = 0; i < N; i++) f[i] = (float)input(rank_, i);
    ASSERT_OK(reduce(f, MPIDP_F32, MPIDP_OP_MAX, reqs));
    for (size_t i = 0; i < N; i++) ASSERT_NEAR(f[i], (double)expected(MPIDP_OP_MAX, i), 0);
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(bool_allreduce_is_all_and_any)
{
    mpidp_reqtable_t *reqs = table(8);
    _Bool all[N], any[N];
    for (size_t i = 0; i < N; i++) all[i] = any[i] = (i + (size_t)rank_) % 3 != 0;
    ASSERT_OK(reduce(all, MPIDP_BOOL, MPIDP_OP_MIN, reqs));
    ASSERT_OK(reduce(any, MPIDP_BOOL, MPIDP_OP_MAX, reqs));
    for (size_t i = 0; i < N; i++) {
        int want_all = 1, want_any = 0;
        for (int r = 0; r < size_; r++) {
            int v = (i + (size_t)r) % 3 != 0;
            want_all &= v;
            want_any |= v;
        }
        ASSERT_EQ_INT(all[i], want_all);
        ASSERT_EQ_INT(any[i], want_any);
    }
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(meaningless_op_dtype_pairs_are_refused_before_posting)
{
    mpidp_reqtable_t *reqs = table(8);
    int32_t i32[N] = {0};
    uint16_t h[N] = {0};
    _Bool b[N] = {0};
    ASSERT_EQ_INT(reduce(i32, MPIDP_I32, MPIDP_OP_AVG, reqs), MPIDP_EDTYPE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "avg needs a floating-point tensor") != NULL);
    ASSERT_EQ_INT(reduce(h, MPIDP_BF16, MPIDP_OP_MIN, reqs), MPIDP_EDTYPE);
    ASSERT_EQ_INT(reduce(b, MPIDP_BOOL, MPIDP_OP_SUM, reqs), MPIDP_EDTYPE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "max = any") != NULL);
    ASSERT_EQ_INT(reduce(i32, MPIDP_I32, 9, reqs), MPIDP_EINVAL);
    float f[N] = {0};
    mpidp_tensor_t t = {.data = f, .numel = N, .dtype = MPIDP_F32, .device = MPIDP_DEV_CPU};
    mpidp_allreduce_opts_t o = {.op = MPIDP_OP_MAX, .wire = MPIDP_BF16, .chunk_elems = 4};
    mpidp_allreduce_t *x = NULL;
    ASSERT_EQ_INT(mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &x), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "cannot be compressed") != NULL);
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
    ASSERT_TRUE(strcmp(mpidp_op_name(MPIDP_OP_PROD), "prod") == 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(allgather_bcast_and_barrier_move_any_dtype)
{
    mpidp_reqtable_t *reqs = table(8);
    int64_t mine[3], all[4 * 3];
    for (int k = 0; k < 3; k++) mine[k] = 100 * rank_ + k;
    mpidp_tensor_t s = {.data = mine, .numel = 3, .dtype = MPIDP_I64, .device = MPIDP_DEV_CPU};
    mpidp_tensor_t r = {.data = all, .numel = (size_t)size_ * 3, .dtype = MPIDP_I64,
                        .device = MPIDP_DEV_CPU};
    mpidp_coll_t *x = NULL;
    ASSERT_OK(mpidp_allgather_start(MPI_COMM_WORLD, &s, &r, reqs, &x));
    ASSERT_OK(mpidp_coll_wait(x, 10.0));
    ASSERT_OK(mpidp_coll_free(x));
    for (int q = 0; q < size_; q++)
        for (int k = 0; k < 3; k++) ASSERT_EQ_INT(all[q * 3 + k], 100 * q + k);
    mpidp_tensor_t small = r;
    small.numel = 2;
    ASSERT_EQ_INT(mpidp_allgather_start(MPI_COMM_WORLD, &s, &small, reqs, &x), MPIDP_EINVAL);
    mpidp_tensor_t overlap = s;
    overlap.numel = (size_t)size_ * 3;
    if (size_ == 1) ASSERT_EQ_INT(mpidp_allgather_start(MPI_COMM_WORLD, &s, &overlap, reqs, &x), MPIDP_EINVAL);
    /* bcast and barrier through the operation table, as an async Work runs
     * them: polled, then finished (one rank: nothing posted, done at once). */
    for (int k = 0; k < 3; k++) mine[k] = rank_ == size_ - 1 ? -7 * k : 0;
    ASSERT_OK(mpidp_bcast_start(MPI_COMM_WORLD, &s, size_ - 1, reqs, &x));
    for (int done = 0; !done;) ASSERT_OK(mpidp_coll_operation.test(x, &done));
    int ended = 0;
    ASSERT_OK(mpidp_operation_finish(&mpidp_coll_operation, x, 10.0, &ended));
    ASSERT_EQ_INT(ended, 1);
    for (int k = 0; k < 3; k++) ASSERT_EQ_INT(mine[k], -7 * k);
    ASSERT_EQ_INT(mpidp_bcast_start(MPI_COMM_WORLD, &s, size_, reqs, &x), MPIDP_EINVAL);
    ASSERT_OK(mpidp_barrier_start(MPI_COMM_WORLD, reqs, &x));
    ASSERT_OK(mpidp_operation_finish(&mpidp_coll_operation, x, 10.0, &ended));
    ASSERT_EQ_INT(ended, 1);
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

/* Counts per rank: uneven, with a zero for rank 1 (when there is one). */
static size_t count_of(int r) { return r == 1 ? 0 : (size_t)(3 + 2 * r); }

TEST(reduce_scatter_and_allgatherv_with_uneven_counts)
{
    mpidp_reqtable_t *reqs = table(8);
    size_t counts[8], total = 0, at = 0;
    for (int r = 0; r < size_; r++) counts[r] = count_of(r), total += counts[r];
    for (int r = 0; r < rank_; r++) at += counts[r];
    double send64[64], recv64[64], want;
    float send32[64], recv32[64];
    for (size_t i = 0; i < total; i++) send64[i] = (double)(i * (size_t)(rank_ + 1)) * 0.5, send32[i] = (float)send64[i];
    static const int ops[] = {MPIDP_OP_SUM, MPIDP_OP_AVG};
    for (int oi = 0; oi < 2; oi++) {
        int op = ops[oi];
        mpidp_tensor_t s64 = {.data = send64, .numel = total, .dtype = MPIDP_F64, .device = MPIDP_DEV_CPU};
        mpidp_tensor_t r64 = {.data = recv64, .numel = counts[rank_], .dtype = MPIDP_F64, .device = MPIDP_DEV_CPU};
        mpidp_tensor_t s32 = s64, r32 = r64;
        s32.data = send32, s32.dtype = MPIDP_F32, r32.data = recv32, r32.dtype = MPIDP_F32;
        mpidp_coll_t *x = NULL;
        ASSERT_OK(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &s64, &r64, counts, op, reqs, &x));
        ASSERT_OK(mpidp_coll_wait(x, 10.0));
        ASSERT_OK(mpidp_coll_free(x));
        /* float32 through the operation table: polled to completion, then
         * finished; the mean's scaling must happen exactly once. */
        ASSERT_OK(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &s32, &r32, counts, op, reqs, &x));
        for (int done = 0; !done;) ASSERT_OK(mpidp_coll_operation.test(x, &done));
        int ended = 0;
        ASSERT_OK(mpidp_operation_finish(&mpidp_coll_operation, x, 10.0, &ended));
        ASSERT_EQ_INT(ended, 1);
        for (size_t i = 0; i < counts[rank_]; i++) {
            /* The sum over r of (at + i) * (r + 1) * 0.5 is exact in both
             * dtypes; avg multiplies it by the dtype's 1/size. */
            want = (double)(at + i) * 0.5 * (double)(size_ * (size_ + 1) / 2);
            int avg = op == MPIDP_OP_AVG;
            ASSERT_TRUE(recv64[i] == (avg ? want * (1.0 / size_) : want));
            ASSERT_TRUE(recv32[i] == (avg ? (float)want * (float)(1.0 / size_) : (float)want));
        }
    }
    /* allgatherv: rank r sends counts[r] int32 values r*100 + i. */
    int32_t mine[64], all[64];
    for (size_t i = 0; i < counts[rank_]; i++) mine[i] = rank_ * 100 + (int32_t)i;
    mpidp_tensor_t s = {.data = mine, .numel = counts[rank_], .dtype = MPIDP_I32, .device = MPIDP_DEV_CPU};
    mpidp_tensor_t r = {.data = all, .numel = total, .dtype = MPIDP_I32, .device = MPIDP_DEV_CPU};
    mpidp_coll_t *x = NULL;
    ASSERT_OK(mpidp_allgatherv_start(MPI_COMM_WORLD, &s, &r, counts, reqs, &x));
    ASSERT_OK(mpidp_coll_wait(x, 10.0));
    ASSERT_OK(mpidp_coll_free(x));
    size_t k = 0;
    for (int q = 0; q < size_; q++)
        for (size_t i = 0; i < counts[q]; i++) ASSERT_EQ_INT(all[k++], q * 100 + (int)i);
    /* Refused before anything is posted. */
    r.numel = total - 1;
    ASSERT_EQ_INT(mpidp_allgatherv_start(MPI_COMM_WORLD, &s, &r, counts, reqs, &x), MPIDP_EINVAL);
    r.numel = total;
    mpidp_tensor_t si = s;
    si.numel = total;
    ASSERT_EQ_INT(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &si, &s, counts, MPIDP_OP_SUM, reqs, &x),
                  MPIDP_EDTYPE);
    mpidp_tensor_t s64 = {.data = send64, .numel = total, .dtype = MPIDP_F64, .device = MPIDP_DEV_CPU};
    mpidp_tensor_t r64 = {.data = recv64, .numel = counts[rank_], .dtype = MPIDP_F64, .device = MPIDP_DEV_CPU};
    ASSERT_EQ_INT(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &s64, &r64, counts, MPIDP_OP_MAX, reqs, &x),
                  MPIDP_EINVAL);
    s64.numel = total + 1;
    ASSERT_EQ_INT(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &s64, &r64, counts, MPIDP_OP_SUM, reqs, &x),
                  MPIDP_EINVAL);
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    mpidp_reqtable_destroy(reqs);
}

TEST_MAIN_MPI(integer_allreduce_sum_min_max_prod, bool_allreduce_is_all_and_any,
              meaningless_op_dtype_pairs_are_refused_before_posting,
              allgather_bcast_and_barrier_move_any_dtype, reduce_scatter_and_allgatherv_with_uneven_counts)
