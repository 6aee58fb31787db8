/* The collectives on integer and bool tensors across real ranks (mpirun -np 2,
 * also 3 and 4; rank-agnostic): allreduce with sum, min, max and prod of every
 * integer dtype and min/max of bool against results computed here from all
 * ranks' inputs; the op/dtype combinations MPI has no meaning for refused
 * before anything is posted; allgather of equal blocks; a broadcast of int64;
 * reduce-scatter (sum and avg, float32 and float64) and allgatherv with
 * uneven counts, zero counts included, against values computed here; the
 * bitwise ops, reduce to every root, gatherv / scatterv / alltoallv with
 * uneven counts, an in-place allgather, and send / receive from a given
 * and from any rank (the sender reported), with their refusals. */
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
    /* One rank: a result one element past the input overlaps it without
     * being the in-place layout (input = this rank's block). */
    mpidp_tensor_t overlap = s;
    overlap.data = (char *)s.data + mpidp_dtype_size(s.dtype);
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
    ASSERT_EQ_INT(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &si, &s, counts, MPIDP_OP_AVG, reqs, &x),
                  MPIDP_EDTYPE);
    mpidp_tensor_t s64 = {.data = send64, .numel = total, .dtype = MPIDP_F64, .device = MPIDP_DEV_CPU};
    mpidp_tensor_t r64 = {.data = recv64, .numel = counts[rank_], .dtype = MPIDP_F64, .device = MPIDP_DEV_CPU};
    ASSERT_EQ_INT(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &s64, &r64, counts, MPIDP_OP_BAND, reqs, &x),
                  MPIDP_EDTYPE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "bitwise ops take integer") != NULL);
    s64.numel = total + 1;
    ASSERT_EQ_INT(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &s64, &r64, counts, MPIDP_OP_SUM, reqs, &x),
                  MPIDP_EINVAL);
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    mpidp_reqtable_destroy(reqs);
}

/* Waits for and frees *x once its start returned `rc` (read after the start
 * call: *x is what it set): the shared tail of the cases below. */
static int finish(int rc, mpidp_coll_t **x)
{
    if (rc != MPIDP_OK) return rc;
    rc = mpidp_coll_wait(*x, 10.0);
    return rc == MPIDP_OK ? mpidp_coll_free(*x) : rc;
}

#define T(ptr, n, dt) ((mpidp_tensor_t){.data = (ptr), .numel = (n), .dtype = (dt), .device = MPIDP_DEV_CPU})

TEST(bitwise_ops_and_reduce_to_every_root)
{
    mpidp_reqtable_t *reqs = table(8);
    static const int ops[] = {MPIDP_OP_BAND, MPIDP_OP_BOR, MPIDP_OP_BXOR};
    for (size_t k = 0; k < 3; k++) {
        int32_t v[N];
        for (size_t i = 0; i < N; i++) v[i] = (int32_t)((i * 7 + (size_t)rank_ * 13) & 0x3f);
        ASSERT_OK(reduce(v, MPIDP_I32, ops[k], reqs));
        for (size_t i = 0; i < N; i++) {
            int32_t want = (int32_t)(i * 7 & 0x3f);
            for (int r = 1; r < size_; r++) {
                int32_t o = (int32_t)((i * 7 + (size_t)r * 13) & 0x3f);
                want = k == 0 ? (want & o) : k == 1 ? (want | o) : (want ^ o);
            }
            ASSERT_EQ_INT(v[i], want);
        }
    }
    _Bool b[N];
    for (size_t i = 0; i < N; i++) b[i] = (i + (size_t)rank_) % 2;
    ASSERT_OK(reduce(b, MPIDP_BOOL, MPIDP_OP_BXOR, reqs));
    for (size_t i = 0; i < N; i++) {
        int want = 0;
        for (int r = 0; r < size_; r++) want ^= (int)((i + (size_t)r) % 2);
        ASSERT_EQ_INT(b[i], want);
    }
    for (int root = 0; root < size_; root++) {
        double d[N];
        for (size_t i = 0; i < N; i++) d[i] = (double)(rank_ + 1) * (double)i;
        mpidp_coll_t *x = NULL;
        mpidp_tensor_t t = T(d, N, MPIDP_F64);
        ASSERT_OK(finish(mpidp_reduce_start(MPI_COMM_WORLD, &t, MPIDP_OP_AVG, root, reqs, &x), &x));
        for (size_t i = 0; i < N; i++)
            ASSERT_TRUE(d[i] == (rank_ == root ? (double)i * (size_ + 1) / 2.0
                                               : (double)(rank_ + 1) * (double)i));
    }
    mpidp_coll_t *x = NULL;
    int32_t i32[N] = {0};
    mpidp_tensor_t t = T(i32, N, MPIDP_I32);
    ASSERT_EQ_INT(mpidp_reduce_start(MPI_COMM_WORLD, &t, MPIDP_OP_SUM, size_, reqs, &x), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_reduce_start(MPI_COMM_WORLD, &t, MPIDP_OP_AVG, 0, reqs, &x), MPIDP_EDTYPE);
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(gatherv_scatterv_alltoallv_and_in_place_allgather)
{
    mpidp_reqtable_t *reqs = table(8);
    size_t counts[8], total = 0;
    for (int r = 0; r < size_; r++) total += counts[r] = (size_t)r;   /* rank 0 sends nothing */
    int16_t mine[8], all[64];
    for (size_t i = 0; i < counts[rank_]; i++) mine[i] = (int16_t)(rank_ * 10 + (int)i);
    for (int root = 0; root < size_; root++) {
        memset(all, 0, sizeof all);
        mpidp_tensor_t s = T(mine, counts[rank_], MPIDP_I16), r = T(all, total, MPIDP_I16);
        mpidp_coll_t *x = NULL;
        ASSERT_OK(finish(mpidp_gatherv_start(MPI_COMM_WORLD, &s, rank_ == root ? &r : NULL, counts,
                                             root, reqs, &x), &x));
        if (rank_ == root) {
            size_t k = 0;
            for (int q = 0; q < size_; q++)
                for (size_t i = 0; i < counts[q]; i++) ASSERT_EQ_INT(all[k++], q * 10 + (int)i);
        }
        /* scatter back what root holds: rank q gets q*10 + i */
        int16_t back[8] = {0};
        mpidp_tensor_t b = T(back, counts[rank_], MPIDP_I16);
        ASSERT_OK(finish(mpidp_scatterv_start(MPI_COMM_WORLD, rank_ == root ? &r : NULL, &b, counts,
                                              root, reqs, &x), &x));
        for (size_t i = 0; i < counts[rank_]; i++) ASSERT_EQ_INT(back[i], rank_ * 10 + (int)i);
    }
    /* alltoallv: this rank sends q + 1 values (rank*100 + q) to rank q, and so
     * receives rank + 1 values from each. */
    int64_t send[64], recv[64];
    size_t sc[8], rc_[8], n_send = 0;
    for (int q = 0; q < size_; q++) {
        sc[q] = (size_t)q + 1;
        rc_[q] = (size_t)rank_ + 1;
        for (size_t i = 0; i < sc[q]; i++) send[n_send++] = rank_ * 100 + q;
    }
    mpidp_tensor_t s = T(send, n_send, MPIDP_I64), r = T(recv, (size_t)size_ * (rank_ + 1), MPIDP_I64);
    mpidp_coll_t *x = NULL;
    ASSERT_OK(finish(mpidp_alltoallv_start(MPI_COMM_WORLD, &s, &r, sc, rc_, reqs, &x), &x));
    for (int q = 0; q < size_; q++)
        for (int i = 0; i <= rank_; i++) ASSERT_EQ_INT(recv[q * (rank_ + 1) + i], q * 100 + rank_);
    r.numel--;
    ASSERT_EQ_INT(mpidp_alltoallv_start(MPI_COMM_WORLD, &s, &r, sc, rc_, reqs, &x), MPIDP_EINVAL);
    /* in-place allgather: the input is this rank's block of the output */
    float blocks[8 * 3];
    for (int i = 0; i < 3; i++) blocks[rank_ * 3 + i] = (float)(rank_ * 3 + i);
    mpidp_tensor_t in = T(blocks + rank_ * 3, 3, MPIDP_F32), out = T(blocks, (size_t)size_ * 3, MPIDP_F32);
    ASSERT_OK(finish(mpidp_allgather_start(MPI_COMM_WORLD, &in, &out, reqs, &x), &x));
    for (int i = 0; i < size_ * 3; i++) ASSERT_TRUE(blocks[i] == (float)i);
    if (size_ > 1) {   /* any other overlap is refused */
        in.data = blocks + (rank_ == 0 ? 1 : 0);
        ASSERT_EQ_INT(mpidp_allgather_start(MPI_COMM_WORLD, &in, &out, reqs, &x), MPIDP_EINVAL);
    }
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(send_and_receive_from_a_rank_and_from_any)
{
    mpidp_reqtable_t *reqs = table(8);
    mpidp_coll_t *x = NULL;
    float buf[4] = {0};
    mpidp_tensor_t t = T(buf, 4, MPIDP_F32);
    ASSERT_EQ_INT(mpidp_send_start(MPI_COMM_WORLD, &t, rank_, 0, reqs, &x), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_send_start(MPI_COMM_WORLD, &t, size_, 0, reqs, &x), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_recv_start(MPI_COMM_WORLD, &t, -1, -3, NULL, reqs, &x), MPIDP_EINVAL);
    if (size_ > 1) {
        /* a ring, two tags received in the other order */
        int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
        float a[4], b[4], ra[4] = {0}, rb[4] = {0};
        for (int i = 0; i < 4; i++) a[i] = (float)(rank_ * 10 + i), b[i] = -a[i];
        mpidp_tensor_t ta = T(a, 4, MPIDP_F32), tb = T(b, 4, MPIDP_F32);
        mpidp_tensor_t tra = T(ra, 4, MPIDP_F32), trb = T(rb, 4, MPIDP_F32);
        mpidp_coll_t *sa = NULL, *sb = NULL;
        ASSERT_OK(mpidp_send_start(MPI_COMM_WORLD, &ta, right, 1, reqs, &sa));
        ASSERT_OK(mpidp_send_start(MPI_COMM_WORLD, &tb, right, 2, reqs, &sb));
        int32_t from = -7;
        ASSERT_OK(finish(mpidp_recv_start(MPI_COMM_WORLD, &trb, left, 2, &from, reqs, &x), &x));
        ASSERT_EQ_INT(from, left);
        ASSERT_OK(finish(mpidp_recv_start(MPI_COMM_WORLD, &tra, left, 1, NULL, reqs, &x), &x));
        ASSERT_OK(finish(MPIDP_OK, &sa));
        ASSERT_OK(finish(MPIDP_OK, &sb));
        for (int i = 0; i < 4; i++) {
            ASSERT_TRUE(ra[i] == (float)(left * 10 + i));
            ASSERT_TRUE(rb[i] == -(float)(left * 10 + i));
        }
        /* every other rank sends its number to rank 0, which receives from any */
        int32_t v = rank_ * 11, got = 0;
        mpidp_tensor_t tv = T(&v, 1, MPIDP_I32), tg = T(&got, 1, MPIDP_I32);
        if (rank_ != 0) {
            ASSERT_OK(finish(mpidp_send_start(MPI_COMM_WORLD, &tv, 0, 5, reqs, &x), &x));
        } else {
            int seen = 0;
            for (int k = 1; k < size_; k++) {
                ASSERT_OK(finish(mpidp_recv_start(MPI_COMM_WORLD, &tg, -1, 5, &from, reqs, &x), &x));
                ASSERT_EQ_INT(got, from * 11);
                seen |= 1 << from;
            }
            ASSERT_EQ_INT(seen, ((1 << size_) - 1) & ~1);
        }
    }
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST_MAIN_MPI(integer_allreduce_sum_min_max_prod, bool_allreduce_is_all_and_any,
              meaningless_op_dtype_pairs_are_refused_before_posting,
              allgather_bcast_and_barrier_move_any_dtype, reduce_scatter_and_allgatherv_with_uneven_counts,
              bitwise_ops_and_reduce_to_every_root, gatherv_scatterv_alltoallv_and_in_place_allgather,
              send_and_receive_from_a_rank_and_from_any)
