/* Device communicators (mpidp/devcomm.h) and the reducer's device mode
 * across real ranks, without a GPU: the MPI stand-in, NCCL's set-up failing
 * on every rank together, aborts, and the flags-only reduction with
 * deliveries recorded for the caller. */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/bucket.h"
#include "mpidp/devcomm.h"
#include "mpidp/reducer.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "bucket_tensors.h"
#include "mpi_world.h"
#include "test.h"

#define N 1000

TEST(standin_sum_lands_only_when_waited_for)
{
    mpidp_reqtable_t *reqs = table(8);
    mpidp_devcomm_t *dc;
    ASSERT_OK(mpidp_devcomm_create_standin(MPI_COMM_WORLD, reqs, &dc));
    ASSERT_EQ_INT(mpidp_devcomm_kind(dc), MPIDP_DEVCOMM_STANDIN);
    float *buf = malloc(N * sizeof *buf);
    for (int pass = 0; pass < 3; pass++) {
        for (int k = 0; k < N; k++) buf[k] = (float)(rank_ + 1) * (float)(k + pass);
        mpidp_req_t h;
        ASSERT_OK(mpidp_devcomm_allreduce_start(dc, buf, N, MPIDP_F32, NULL, "test sum", &h));
        /* As a device sum is visible only to work ordered after it, the
         * caller's memory holds its own values until the wait. */
        int done = 0;
        ASSERT_OK(mpidp_reqtable_wait(reqs, h, 30.0)); /* MPI is done, the sum has not landed */
        (void)done;
        ASSERT_NEAR(buf[7], (float)(rank_ + 1) * (float)(7 + pass), 0);
        ASSERT_OK(mpidp_devcomm_wait(dc, h, 30.0));
        float ranks = (float)size_ * (float)(size_ + 1) / 2.0f;
        for (int k = 0; k < N; k += 97) ASSERT_NEAR(buf[k], ranks * (float)(k + pass), 0);
    }
    free(buf);
    mpidp_devcomm_destroy(dc, 30.0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

/* Every kind of device collective, on the stand-in and on MPI with host
 * pointers (the transport for a CUDA-aware MPI), against the values every
 * rank's data gives. Each rank's input: (rank + 1) * (k + 1). */
static void run_every_kind(int *mpidp__test_failed, mpidp_devcomm_t *dc, mpidp_reqtable_t *reqs)
{
    enum { C = 5 };
    double send[C * 8], recv[C * 8];
    float ranks = (float)size_ * (float)(size_ + 1) / 2.0f;
    mpidp_req_t h;
    /* allreduce, out of place: max */
    for (int k = 0; k < C; k++) send[k] = (rank_ + 1) * (k + 1.0), recv[k] = -1;
    mpidp_devop_t op = {.kind = MPIDP_DEVOP_ALLREDUCE, .send = send, .recv = recv, .count = C,
                        .dtype = MPIDP_F64, .op = MPIDP_OP_MAX};
    ASSERT_OK(mpidp_devcomm_start(dc, &op, NULL, "max", &h));
    ASSERT_OK(mpidp_devcomm_wait(dc, h, 30.0));
    for (int k = 0; k < C; k++) ASSERT_NEAR(recv[k], size_ * (k + 1.0), 0);
    ASSERT_NEAR(send[2], (rank_ + 1) * 3.0, 0); /* the input is only read */
    /* broadcast from the last rank, in place */
    for (int k = 0; k < C; k++) recv[k] = (rank_ + 1) * (k + 1.0);
    op = (mpidp_devop_t){.kind = MPIDP_DEVOP_BCAST, .recv = recv, .count = C,
                         .dtype = MPIDP_F64, .root = size_ - 1};
    ASSERT_OK(mpidp_devcomm_start(dc, &op, NULL, "bcast", &h));
    ASSERT_OK(mpidp_devcomm_wait(dc, h, 30.0));
    for (int k = 0; k < C; k++) ASSERT_NEAR(recv[k], size_ * (k + 1.0), 0);
    /* allgather: rank r's block at r * C */
    for (int k = 0; k < C; k++) send[k] = (rank_ + 1) * (k + 1.0);
    for (int k = 0; k < C * size_; k++) recv[k] = -1;
    op = (mpidp_devop_t){.kind = MPIDP_DEVOP_ALLGATHER, .send = send, .recv = recv, .count = C,
                         .dtype = MPIDP_F64};
    ASSERT_OK(mpidp_devcomm_start(dc, &op, NULL, "allgather", &h));
    ASSERT_OK(mpidp_devcomm_wait(dc, h, 30.0));
    for (int r = 0; r < size_; r++)
        for (int k = 0; k < C; k++) ASSERT_NEAR(recv[r * C + k], (r + 1) * (k + 1.0), 0);
    /* reduce-scatter of sums: this rank gets block `rank` summed */
    for (int k = 0; k < C * 8; k++) send[k] = (rank_ + 1) * (k + 1.0), recv[k] = -1;
    op = (mpidp_devop_t){.kind = MPIDP_DEVOP_REDUCE_SCATTER, .send = send, .recv = recv,
                         .count = C, .dtype = MPIDP_F64, .op = MPIDP_OP_SUM};
    ASSERT_OK(mpidp_devcomm_start(dc, &op, NULL, "reduce_scatter", &h));
    ASSERT_OK(mpidp_devcomm_wait(dc, h, 30.0));
    for (int k = 0; k < C; k++) ASSERT_NEAR(recv[k], ranks * (rank_ * C + k + 1.0), 0);
    ASSERT_NEAR(recv[C], -1, 0); /* nothing beyond the block */
    /* what no transport runs, refused before anything is posted */
    op = (mpidp_devop_t){.kind = MPIDP_DEVOP_BCAST, .recv = recv, .count = C,
                         .dtype = MPIDP_F64, .root = size_};
    ASSERT_EQ_INT(mpidp_devcomm_start(dc, &op, NULL, "bad root", &h), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "root") != NULL);
    op = (mpidp_devop_t){.kind = MPIDP_DEVOP_ALLREDUCE, .send = send, .recv = recv, .count = C,
                         .dtype = MPIDP_F64, .op = MPIDP_OP_BXOR};
    ASSERT_EQ_INT(mpidp_devcomm_start(dc, &op, NULL, "bad op", &h), MPIDP_EINVAL);
    op.kind = (mpidp_devop_kind_t)9;
    ASSERT_EQ_INT(mpidp_devcomm_start(dc, &op, NULL, "bad kind", &h), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
}

TEST(every_kind_of_collective_on_the_standin)
{
    if (size_ > 8) return;
    mpidp_reqtable_t *reqs = table(8);
    mpidp_devcomm_t *dc;
    ASSERT_OK(mpidp_devcomm_create_standin(MPI_COMM_WORLD, reqs, &dc));
    run_every_kind(mpidp__test_failed, dc, reqs);
    mpidp_devcomm_destroy(dc, 30.0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(every_kind_of_collective_on_mpi)
{
    if (size_ > 8) return;
    mpidp_reqtable_t *reqs = table(8);
    mpidp_devcomm_t *dc;
    ASSERT_OK(mpidp_devcomm_create_mpi(MPI_COMM_WORLD, reqs, &dc));
    ASSERT_EQ_INT(mpidp_devcomm_kind(dc), MPIDP_DEVCOMM_MPI);
    run_every_kind(mpidp__test_failed, dc, reqs);
    mpidp_devcomm_destroy(dc, 30.0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(an_aborted_communicator_refuses_new_sums)
{
    mpidp_reqtable_t *reqs = table(8);
    mpidp_devcomm_t *dc;
    ASSERT_OK(mpidp_devcomm_create_standin(MPI_COMM_WORLD, reqs, &dc));
    mpidp_devcomm_abort(dc);
    ASSERT_TRUE(mpidp_devcomm_aborted(dc));
    double x = 1.0;
    mpidp_req_t h;
    ASSERT_EQ_INT(mpidp_devcomm_allreduce_start(dc, &x, 1, MPIDP_F64, NULL, "after abort", &h),
                  MPIDP_ESTATE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "aborted") != NULL);
    mpidp_devcomm_destroy(dc, 30.0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(a_sum_nobody_waited_for_is_finished_by_destroy)
{
    mpidp_reqtable_t *reqs = table(8);
    mpidp_devcomm_t *dc;
    ASSERT_OK(mpidp_devcomm_create_standin(MPI_COMM_WORLD, reqs, &dc));
    int v[64] = {0};
    mpidp_req_t h;
    ASSERT_OK(mpidp_devcomm_allreduce_start(dc, v, 64, MPIDP_I32, NULL, "left behind", &h));
    mpidp_devcomm_destroy(dc, 30.0); /* ASan: its private copy is freed once MPI is done */
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(nccl_that_cannot_load_fails_on_every_rank_naming_the_library)
{
    mpidp_reqtable_t *reqs = table(8);
    mpidp_devcomm_t *dc = NULL;
    /* Rank 0 alone names a library that does not exist: every rank fails,
     * none waits inside NCCL's set-up for it. */
    const char *lib = rank_ == 0 ? "/nonexistent/libnccl.so.2" : "/nonexistent/other/libnccl.so.2";
    int rc = mpidp_devcomm_create_nccl(MPI_COMM_WORLD, reqs, lib, "/nonexistent/libcudart.so", 0,
                                       30.0, &dc);
    ASSERT_EQ_INT(rc, MPIDP_ENOTSUP);
    ASSERT_TRUE(dc == NULL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "cannot load NCCL") != NULL);
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

/* Device mode: the core sums each bucket's flags (which parameters any rank
 * had a gradient for), touches no gradient element, and records the
 * deliveries non-blocking mode's pass asks for instead of making them. */
TEST(device_mode_sums_flags_and_records_deliveries)
{
    mpidp_reqtable_t *reqs = table(16);
    enum { NP = 4, PN = 3 };
    size_t numel[NP] = {PN, PN, PN, PN};
    int dtype[NP] = {MPIDP_F32, MPIDP_F32, MPIDP_F32, MPIDP_F32};
    uint32_t bucket[NP];
    size_t offset[NP], nb;
    mpidp_bucket_info_t info[NP];
    ASSERT_OK(mpidp_bucket_plan(numel, dtype, NP, 24, 24, bucket, offset, info, &nb));
    void *data[NP];
    for (size_t b = 0; b < nb; b++) data[b] = calloc(info[b].numel + info[b].n_params, 4);
    mpidp_tensor_t tensors[NP];
    bucket_tensors(tensors, data, info, nb);
    mpidp_reducer_config_t cfg = {
        .comm = MPI_COMM_WORLD, .reqs = reqs, .n_params = NP, .param_numel = numel,
        .param_dtype = dtype, .first_cap = 24, .cap = 24, .n_buckets = nb,
        .bucket_tensors = tensors, .wire_dtype = -1, .name = "test", .separate = 1, .device = 1};
    mpidp_reducer_t *r;
    ASSERT_OK(mpidp_reducer_create(&cfg, &r));
    for (size_t b = 0; b < nb; b++)
        for (size_t k = 0; k < info[b].numel; k++) ((float *)data[b])[k] = 42.0f;
    /* Parameter 3 has a gradient on rank 0 only. */
    for (int i = 0; i < NP; i++) ASSERT_OK(mpidp_reducer_mark_ready(r, (size_t)i, i != 3 || rank_ == 0));
    size_t b;
    while (mpidp_reducer_next_to_stage(r, 0, &b)) ASSERT_OK(mpidp_reducer_staged(r, b));
    long long versions[NP] = {0};
    ASSERT_OK(mpidp_reducer_finalize(r, versions));
    ASSERT_OK(mpidp_reducer_wait_all(r, 30.0));
    for (int i = 0; i < NP; i++) {
        int used = 0;
        ASSERT_OK(mpidp_reducer_used_globally(r, (size_t)i, &used));
        ASSERT_TRUE(used);
    }
    for (size_t q = 0; q < nb; q++)
        for (size_t k = 0; k < info[q].numel; k++) ASSERT_NEAR(((float *)data[q])[k], 42.0f, 0);
    ASSERT_OK(mpidp_reducer_deliver(r, 0, MPIDP_DELIVER_COPY));
    ASSERT_OK(mpidp_reducer_deliver(r, 3, MPIDP_DELIVER_ADD));
    uint8_t modes[NP];
    ASSERT_OK(mpidp_reducer_device_deliveries(r, bucket[0], modes));
    ASSERT_EQ_INT(modes[0], 1 + MPIDP_DELIVER_COPY);
    ASSERT_OK(mpidp_reducer_device_deliveries(r, bucket[3], modes));
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r, bucket[3], &members);
    ASSERT_EQ_INT(modes[n - 1], 1 + MPIDP_DELIVER_ADD);
    ASSERT_OK(mpidp_reducer_device_deliveries(r, bucket[3], modes)); /* read once */
    ASSERT_EQ_INT(modes[n - 1], 0);
    ASSERT_OK(mpidp_reducer_reset(r));
    ASSERT_OK(mpidp_reducer_destroy(r));
    for (size_t q = 0; q < nb; q++) free(data[q]);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(device_mode_refuses_a_wire_dtype)
{
    mpidp_reqtable_t *reqs = table(4);
    size_t numel[1] = {4};
    int dtype[1] = {MPIDP_F32};
    uint32_t bucket[1];
    size_t offset[1], nb;
    mpidp_bucket_info_t info[1];
    ASSERT_OK(mpidp_bucket_plan(numel, dtype, 1, 64, 64, bucket, offset, info, &nb));
    float data[5] = {0};
    void *d[1] = {data};
    mpidp_tensor_t tensors[1];
    bucket_tensors(tensors, d, info, nb);
    mpidp_reducer_config_t cfg = {
        .comm = MPI_COMM_WORLD, .reqs = reqs, .n_params = 1, .param_numel = numel,
        .param_dtype = dtype, .first_cap = 64, .cap = 64, .n_buckets = nb,
        .bucket_tensors = tensors, .wire_dtype = MPIDP_BF16, .name = "test", .device = 1};
    mpidp_reducer_t *r = NULL;
    ASSERT_EQ_INT(mpidp_reducer_create(&cfg, &r), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "device-resident") != NULL);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST_MAIN_MPI(standin_sum_lands_only_when_waited_for, every_kind_of_collective_on_the_standin,
              every_kind_of_collective_on_mpi, an_aborted_communicator_refuses_new_sums,
              a_sum_nobody_waited_for_is_finished_by_destroy,
              nccl_that_cannot_load_fails_on_every_rank_naming_the_library,
              device_mode_sums_flags_and_records_deliveries, device_mode_refuses_a_wire_dtype)
