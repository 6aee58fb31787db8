/* The allgather, reduce-scatter and small allreduce the core runs as point-to-point messages
 * on communicators of up to MPIDP_LINEAR_MAX_RANKS ranks (linear.h), run at
 * 2, 3, 4 and 9 ranks (9: MPI's own collectives, which must give the same
 * values): the largest tag is refused to the core's send and receive; two
 * allgathers and a reduce-scatter of blocks past the eager limit in flight
 * together with a user's messages on the same communicator, waited for in
 * reverse order; a reduce-scatter's float32 sum folded in rank order, the
 * same bits as that fold done here; bfloat16, int64 max and average; a
 * small in-place allreduce (mpidp/allreduce.h's engine) folded in rank
 * order the same way, on every rank, and its other dtypes and ops. */
#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/allreduce.h"
#include "mpidp/collectives.h"
#include "mpidp/convert.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "linear.h"
#include "mpi_world.h"
#include "test.h"

static mpidp_tensor_t T(void *data, size_t numel, int dtype)
{
    return (mpidp_tensor_t){.data = data, .numel = numel, .dtype = dtype, .device = MPIDP_DEV_CPU};
}

static int finish(int rc, mpidp_coll_t **x)
{
    if (rc != MPIDP_OK) return rc;
    rc = mpidp_coll_wait(*x, 10.0);
    if (rc == MPIDP_OK) rc = mpidp_coll_free(*x);
    return rc;
}

TEST(the_largest_tag_is_the_cores_own)
{
    mpidp_reqtable_t *reqs = table(8);
    int reserved = mpidp__linear_tag(MPI_COMM_WORLD);
    ASSERT_TRUE(reserved >= 32767);
    if (size_ > 1) {
        int32_t v = 0;
        mpidp_tensor_t t = T(&v, 1, MPIDP_I32);
        mpidp_coll_t *x = NULL;
        int peer = (rank_ + 1) % size_;
        ASSERT_EQ_INT(mpidp_send_start(MPI_COMM_WORLD, &t, peer, reserved, reqs, &x), MPIDP_EINVAL);
        ASSERT_TRUE(strstr(mpidp_error_detail(), "is mpidp's own") != NULL);
        ASSERT_EQ_INT(mpidp_recv_start(MPI_COMM_WORLD, &t, peer, reserved, NULL, reqs, &x),
                      MPIDP_EINVAL);
        /* One below is the user's. */
        int32_t got = -1;
        mpidp_tensor_t g = T(&got, 1, MPIDP_I32);
        mpidp_coll_t *s = NULL, *r = NULL;
        v = rank_;
        ASSERT_OK(mpidp_recv_start(MPI_COMM_WORLD, &g, (rank_ + size_ - 1) % size_, reserved - 1,
                                   NULL, reqs, &r));
        ASSERT_OK(mpidp_send_start(MPI_COMM_WORLD, &t, peer, reserved - 1, reqs, &s));
        ASSERT_OK(finish(MPIDP_OK, &s));
        ASSERT_OK(finish(MPIDP_OK, &r));
        ASSERT_EQ_INT(got, (rank_ + size_ - 1) % size_);
    }
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

/* Past Open MPI's eager limits, so each block goes by rendezvous. */
#define BIG 20000

TEST(collectives_and_user_messages_in_flight_together)
{
    mpidp_reqtable_t *reqs = table(256);
    float *a_in = malloc(BIG * sizeof *a_in), *a_out = malloc((size_t)size_ * BIG * sizeof *a_out);
    float *rs_in = malloc((size_t)size_ * BIG * sizeof *rs_in), *rs_out = malloc(BIG * sizeof *rs_out);
    int64_t c_in[5], *c_out = malloc((size_t)size_ * 5 * sizeof *c_out);
    for (size_t i = 0; i < BIG; i++) a_in[i] = (float)(rank_ * BIG + (int)i);
    for (size_t i = 0; i < (size_t)size_ * BIG; i++) rs_in[i] = (float)((int)(i % 97) * (rank_ + 1));
    for (int i = 0; i < 5; i++) c_in[i] = (int64_t)rank_ << 40 | i;
    size_t counts[16];
    for (int r = 0; r < size_; r++) counts[r] = BIG;
    mpidp_tensor_t ta = T(a_in, BIG, MPIDP_F32), toa = T(a_out, (size_t)size_ * BIG, MPIDP_F32);
    mpidp_tensor_t tr = T(rs_in, (size_t)size_ * BIG, MPIDP_F32), tor = T(rs_out, BIG, MPIDP_F32);
    mpidp_tensor_t tc = T(c_in, 5, MPIDP_I64), toc = T(c_out, (size_t)size_ * 5, MPIDP_I64);
    mpidp_coll_t *a = NULL, *rs = NULL, *c = NULL, *snd = NULL, *rcv = NULL;
    int32_t note[3] = {rank_, 7, -rank_}, heard[3] = {0};
    mpidp_tensor_t tn = T(note, 3, MPIDP_I32), th = T(heard, 3, MPIDP_I32);
    int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
    ASSERT_OK(mpidp_allgather_start(MPI_COMM_WORLD, &ta, &toa, reqs, &a));
    if (size_ > 1) {
        ASSERT_OK(mpidp_recv_start(MPI_COMM_WORLD, &th, left, 0, NULL, reqs, &rcv));
        ASSERT_OK(mpidp_send_start(MPI_COMM_WORLD, &tn, right, 0, reqs, &snd));
    }
    ASSERT_OK(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &tr, &tor, counts, MPIDP_OP_SUM, reqs, &rs));
    ASSERT_OK(mpidp_allgather_start(MPI_COMM_WORLD, &tc, &toc, reqs, &c));
    ASSERT_OK(finish(MPIDP_OK, &c));
    if (size_ > 1) {
        ASSERT_OK(finish(MPIDP_OK, &rcv));
        ASSERT_OK(finish(MPIDP_OK, &snd));
        ASSERT_EQ_INT(heard[0], left);
        ASSERT_EQ_INT(heard[1], 7);
        ASSERT_EQ_INT(heard[2], -left);
    }
    ASSERT_OK(finish(MPIDP_OK, &rs));
    ASSERT_OK(finish(MPIDP_OK, &a));
    for (int r = 0; r < size_; r++) {
        for (size_t i = 0; i < BIG; i++) ASSERT_TRUE(a_out[(size_t)r * BIG + i] == (float)(r * BIG + (int)i));
        for (int i = 0; i < 5; i++) ASSERT_TRUE(c_out[r * 5 + i] == ((int64_t)r << 40 | i));
    }
    float ranks_sum = (float)(size_ * (size_ + 1) / 2);
    for (size_t i = 0; i < BIG; i++)
        ASSERT_TRUE(rs_out[i] == (float)((int)(((size_t)rank_ * BIG + i) % 97)) * ranks_sum);
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    free(a_in), free(a_out), free(rs_in), free(rs_out), free(c_out);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

/* Rank r's value at i: large and small by turns, so that the order of the
 * additions shows in the float32 sum's bits. */
static float mixed(int r, size_t i)
{
    float big = (r + (int)i) % 2 ? 3.0e7f : -1.7e7f;
    return big * (float)(r + 1) + 0.37f * (float)(i + 1) / (float)(r + 3);
}

/* Whether `got` is every rank's mixed(r, at) summed in rank order: the
 * same bits where the core folds (linear.h), within float32's rounding of
 * the terms in MPI's own order past its ranks. */
static int folded_in_rank_order(float got, size_t at)
{
    float fold = mixed(0, at);
    double magnitude = 0;
    for (int r = 1; r < size_; r++) fold = mixed(r, at) + fold;
    for (int r = 0; r < size_; r++) magnitude += mixed(r, at) < 0 ? -mixed(r, at) : mixed(r, at);
    if (mpidp__linear_fits(size_)) return memcmp(&fold, &got, sizeof fold) == 0;
    double d = (double)got - (double)fold;
    return (d < 0 ? -d : d) <= 1e-6 * magnitude;
}

TEST(reduce_scatter_folds_blocks_in_rank_order)
{
    mpidp_reqtable_t *reqs = table(64);
    enum { M = 33 };
    float in[16 * M], out[M];
    size_t counts[16];
    for (int r = 0; r < size_; r++) counts[r] = M;
    for (size_t i = 0; i < (size_t)size_ * M; i++) in[i] = mixed(rank_, i);
    mpidp_tensor_t ti = T(in, (size_t)size_ * M, MPIDP_F32), to = T(out, M, MPIDP_F32);
    mpidp_coll_t *x = NULL;
    ASSERT_OK(finish(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &ti, &to, counts, MPIDP_OP_SUM, reqs, &x), &x));
    for (size_t i = 0; i < M; i++) ASSERT_TRUE(folded_in_rank_order(out[i], (size_t)rank_ * M + i));
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

/* Rank r's values at i for the other dtypes: small integers (exact in
 * bfloat16), integers around zero, and doubles. */
static float small_of(int r, size_t i) { return (float)(i % 7) + (float)r; }
static int64_t int_of(int r, size_t i) { return (int64_t)((i * 31 + (size_t)r * 17) % 23) - 11; }
static double double_of(int r, size_t i) { return (double)r * 0.25 + (double)i; }

/* Whether h, v and d are, at index `at`, every rank's small_of summed, its
 * int_of's max (want_max) or min, and its double_of's mean. */
static int reduced_right(uint16_t h, int64_t v, double d, size_t at, int want_max)
{
    float sum = 0;
    int64_t extreme = want_max ? INT64_MIN : INT64_MAX;
    double mean = 0;
    for (int r = 0; r < size_; r++) {
        sum += small_of(r, at);
        int64_t x = int_of(r, at);
        extreme = (want_max ? x > extreme : x < extreme) ? x : extreme;
        mean += double_of(r, at) / size_;
    }
    double off = d - mean;
    return mpidp_f32_from_bf16(h) == sum && v == extreme && (off < 0 ? -off : off) < 1e-12;
}

TEST(reduce_scatter_of_bfloat16_int64_max_and_average)
{
    mpidp_reqtable_t *reqs = table(64);
    enum { M = 6 };
    uint16_t h_in[16 * M], h_out[M];
    int64_t i_in[16 * M], i_out[M];
    double d_in[16 * M], d_out[M];
    size_t counts[16];
    for (int r = 0; r < size_; r++) counts[r] = M;
    for (size_t i = 0; i < (size_t)size_ * M; i++) {
        h_in[i] = mpidp_bf16_from_f32(small_of(rank_, i));
        i_in[i] = int_of(rank_, i);
        d_in[i] = double_of(rank_, i);
    }
    mpidp_tensor_t th = T(h_in, (size_t)size_ * M, MPIDP_BF16), toh = T(h_out, M, MPIDP_BF16);
    mpidp_tensor_t ti = T(i_in, (size_t)size_ * M, MPIDP_I64), toi = T(i_out, M, MPIDP_I64);
    mpidp_tensor_t td = T(d_in, (size_t)size_ * M, MPIDP_F64), tod = T(d_out, M, MPIDP_F64);
    mpidp_coll_t *x = NULL;
    ASSERT_OK(finish(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &th, &toh, counts, MPIDP_OP_SUM, reqs, &x), &x));
    ASSERT_OK(finish(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &ti, &toi, counts, MPIDP_OP_MAX, reqs, &x), &x));
    ASSERT_OK(finish(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &td, &tod, counts, MPIDP_OP_AVG, reqs, &x), &x));
    for (size_t i = 0; i < M; i++)
        ASSERT_TRUE(reduced_right(h_out[i], i_out[i], d_out[i], (size_t)rank_ * M + i, 1));
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

static int allreduce(void *data, size_t n, int dtype, int op, mpidp_reqtable_t *reqs)
{
    mpidp_tensor_t t = T(data, n, dtype);
    mpidp_allreduce_opts_t o = mpidp_allreduce_default_opts(dtype, op, -1, 10.0, "allreduce");
    mpidp_allreduce_t *x = NULL;
    int rc = mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &x);
    if (rc == MPIDP_OK) rc = mpidp_allreduce_wait(x, 10.0);
    if (rc == MPIDP_OK) rc = mpidp_allreduce_free(x);
    return rc;
}

TEST(a_small_allreduce_folds_in_rank_order_in_place)
{
    mpidp_reqtable_t *reqs = table(64);
    enum { M = 257 };
    float f[M];
    for (size_t i = 0; i < M; i++) f[i] = mixed(rank_, i);
    ASSERT_OK(allreduce(f, M, MPIDP_F32, MPIDP_OP_SUM, reqs));
    for (size_t i = 0; i < M; i++) ASSERT_TRUE(folded_in_rank_order(f[i], i));
    /* Every rank ends with the same bits. */
    float first[M];
    memcpy(first, f, sizeof f);
    MPI_Bcast(first, M, MPI_FLOAT, 0, MPI_COMM_WORLD);
    ASSERT_TRUE(memcmp(first, f, sizeof f) == 0);
    uint16_t h[M];
    int64_t iv[M];
    double d[M];
    for (size_t i = 0; i < M; i++) {
        h[i] = mpidp_bf16_from_f32(small_of(rank_, i));
        iv[i] = int_of(rank_, i);
        d[i] = double_of(rank_, i);
    }
    ASSERT_OK(allreduce(h, M, MPIDP_BF16, MPIDP_OP_SUM, reqs));
    ASSERT_OK(allreduce(iv, M, MPIDP_I64, MPIDP_OP_MIN, reqs));
    ASSERT_OK(allreduce(d, M, MPIDP_F64, MPIDP_OP_AVG, reqs));
    for (size_t i = 0; i < M; i++) ASSERT_TRUE(reduced_right(h[i], iv[i], d[i], i, 0));
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST_MAIN_MPI(the_largest_tag_is_the_cores_own, collectives_and_user_messages_in_flight_together,
              reduce_scatter_folds_blocks_in_rank_order, reduce_scatter_of_bfloat16_int64_max_and_average,
              a_small_allreduce_folds_in_rank_order_in_place)
