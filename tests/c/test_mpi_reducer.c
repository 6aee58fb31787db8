/* The reducer across real ranks (run under mpirun -np 2, rank-agnostic):
 * each rank holds different gradients, marks its parameters in a different
 * order and leaves different parameters without a gradient; the result must
 * be the mean over ranks, computed here independently, on every rank. */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/bucket.h"
#include "mpidp/mpiops.h"
#include "mpidp/pack.h"
#include "mpidp/qallreduce.h"
#include "mpidp/reducer.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "bucket_tensors.h"
#include "test.h"

#define NP 6
#define PN 5 /* elements per parameter */

static float grad_of(int rank, int param, int k) { return (float)(rank * 100 + param * 10 + k); }
/* Parameter 4 only has a gradient on rank 0; parameter 5 on no rank. */
static int has_grad(int rank, int param) { return param == 5 ? 0 : param == 4 ? rank == 0 : 1; }

TEST(mean_over_ranks_with_unused_parameters)
{
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    size_t numel[NP];
    int dtype[NP];
    for (int i = 0; i < NP; i++) {
        numel[i] = PN;
        dtype[i] = i % 2 ? MPIDP_F64 : MPIDP_F32; /* two dtypes: two bucket families */
    }
    uint32_t bucket[NP];
    size_t offset[NP], nb;
    mpidp_bucket_info_t info[NP];
    ASSERT_OK(mpidp_bucket_plan(numel, dtype, NP, 24, 48, bucket, offset, info, &nb));
    void *data[NP];
    for (size_t b = 0; b < nb; b++)
        data[b] = calloc(info[b].numel + info[b].n_params, mpidp_dtype_size(info[b].dtype));
    mpidp_tensor_t tensors[NP];
    bucket_tensors(tensors, data, info, nb);
    mpidp_reqtable_t *reqs;
    ASSERT_OK(mpidp_reqtable_create(16, &reqs));
    mpidp_reducer_config_t cfg = {
        .comm = MPI_COMM_WORLD, .reqs = reqs, .n_params = NP, .param_numel = numel,
        .param_dtype = dtype, .first_cap = 24, .cap = 48, .n_buckets = nb,
        .bucket_tensors = tensors, .wire_dtype = -1, .name = "test"};
    mpidp_reducer_t *r;
    ASSERT_OK(mpidp_reducer_create(&cfg, &r));

    for (int pass = 0; pass < 3; pass++) {
        for (int i = 0; i < NP; i++) {
            char *base = (char *)data[bucket[i]];
            for (int k = 0; k < PN; k++) {
                size_t at = offset[i] + (size_t)k;
                /* Stale values in unused slices must not leak into the sum. */
                float v = has_grad(rank, i) ? grad_of(rank, i, k) + (float)pass : 1e6f;
                if (dtype[i] == MPIDP_F32) ((float *)base)[at] = v;
                else ((double *)base)[at] = v;
            }
        }
        /* Even ranks mark in forward order, odd ranks in reverse. */
        for (int j = 0; j < NP; j++) {
            int i = rank % 2 ? NP - 1 - j : j;
            ASSERT_OK(mpidp_reducer_mark_ready(r, (size_t)i, has_grad(rank, i)));
        }
        ASSERT_OK(mpidp_reducer_wait_all(r, 30.0));
        for (int i = 0; i < NP; i++) {
            int used = -1;
            ASSERT_OK(mpidp_reducer_used_globally(r, (size_t)i, &used));
            ASSERT_EQ_INT(used, i != 5 || size == 0);
            for (int k = 0; k < PN; k++) {
                double expect = 0;
                for (int q = 0; q < size; q++)
                    if (has_grad(q, i)) expect += grad_of(q, i, k) + pass;
                expect /= size;
                size_t at = offset[i] + (size_t)k;
                const char *base = (const char *)data[bucket[i]];
                double got = dtype[i] == MPIDP_F32 ? ((const float *)base)[at]
                                                   : ((const double *)base)[at];
                ASSERT_NEAR(got, expect, 1e-4 * (1 + expect));
            }
        }
        ASSERT_OK(mpidp_reducer_reset(r));
    }
    ASSERT_OK(mpidp_reducer_destroy(r));
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
    for (size_t b = 0; b < nb; b++) free(data[b]);
}

/* NP float32 parameters of PN elements in buckets of at most 80 bytes,
 * reduced over MPI_COMM_WORLD (this rank and the world's size with them). */
typedef struct {
    int rank, size;
    size_t numel[NP], offset[NP], nb;
    uint32_t bucket[NP];
    mpidp_bucket_info_t info[NP];
    void *data[NP];
    mpidp_reqtable_t *reqs;
    mpidp_reducer_t *r;
} f32_reducer_t;

/* hier: NULL (flat), or the node scatter, cross and node gather communicators. */
static int f32_reducer_hier(f32_reducer_t *f, int wire, int separate, const MPI_Comm *hier)
{
    MPI_Comm_rank(MPI_COMM_WORLD, &f->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &f->size);
    int dtype[NP], rc = mpidp_mpiops_init();
    for (int i = 0; i < NP; i++) {
        f->numel[i] = PN;
        dtype[i] = MPIDP_F32;
    }
    if (rc == MPIDP_OK)
        rc = mpidp_bucket_plan(f->numel, dtype, NP, 40, 80, f->bucket, f->offset, f->info, &f->nb);
    for (size_t b = 0; rc == MPIDP_OK && b < f->nb; b++)
        f->data[b] = calloc(f->info[b].numel + f->info[b].n_params, 4);
    if (rc == MPIDP_OK) rc = mpidp_reqtable_create(256, &f->reqs);
    mpidp_tensor_t tensors[NP];
    bucket_tensors(tensors, f->data, f->info, f->nb);
    mpidp_reducer_config_t cfg = {
        .comm = MPI_COMM_WORLD, .reqs = f->reqs, .n_params = NP, .param_numel = f->numel,
        .param_dtype = dtype, .first_cap = 40, .cap = 80, .n_buckets = f->nb,
        .bucket_tensors = tensors, .wire_dtype = wire, .separate = separate, .name = "test",
        .hierarchical = hier != NULL, .hier_node_scatter = hier ? hier[0] : MPI_COMM_NULL,
        .hier_cross = hier ? hier[1] : MPI_COMM_NULL,
        .hier_node_gather = hier ? hier[2] : MPI_COMM_NULL, .drain_timeout_s = 30.0};
    return rc == MPIDP_OK ? mpidp_reducer_create(&cfg, &f->r) : rc;
}

static int f32_reducer(f32_reducer_t *f, int wire, int separate)
{
    return f32_reducer_hier(f, wire, separate, NULL);
}

static int f32_reducer_free(f32_reducer_t *f)
{
    int rc = mpidp_reducer_destroy(f->r);
    if (rc == MPIDP_OK) rc = mpidp_reqtable_destroy(f->reqs);
    for (size_t b = 0; b < f->nb; b++) free(f->data[b]);
    return rc;
}

/* What a rank writes into element k of parameter i on pass `pass`. */
typedef float (*grad_fn)(int rank, int i, int k, int pass);

/* Writes this rank's gradients into every parameter's slice of the buckets. */
static void f32_fill(f32_reducer_t *f, grad_fn value, int pass)
{
    for (int i = 0; i < NP; i++)
        for (int k = 0; k < PN; k++)
            ((float *)f->data[f->bucket[i]])[f->offset[i] + (size_t)k] = value(f->rank, i, k, pass);
}

/* Marks every parameter, with a gradient where this rank has one, and waits
 * for every bucket. */
static int f32_mark_and_wait(f32_reducer_t *f)
{
    int rc = MPIDP_OK;
    for (int i = 0; rc == MPIDP_OK && i < NP; i++)
        rc = mpidp_reducer_mark_ready(f->r, (size_t)i, has_grad(f->rank, i));
    return rc == MPIDP_OK ? mpidp_reducer_wait_all(f->r, 30.0) : rc;
}

/* Parameter i's result after a pass, in *got (n elements): checks that it is
 * flagged as used exactly when some rank had its gradient (every parameter
 * but 5) and, in separate mode, delivers it first. *got stays NULL when a
 * check failed (the failure is reported). */
static void result_of(f32_reducer_t *f, int i, int separate, const float **got, size_t *n,
                      int *mpidp__test_failed)
{
    *got = NULL;
    int used = -1;
    ASSERT_OK(mpidp_reducer_used_globally(f->r, (size_t)i, &used));
    ASSERT_EQ_INT(used, i != 5);
    if (separate) ASSERT_OK(mpidp_reducer_deliver(f->r, (size_t)i, MPIDP_DELIVER_COPY));
    *got = mpidp_reducer_slice(f->r, (size_t)i, n);
}

/* A tenth of the gradient where the rank has one, 7 (which must not count)
 * where it has none. */
static float tenth_grad(int rank, int i, int k, int pass)
{
    (void)pass;
    return has_grad(rank, i) ? 0.1f * grad_of(rank, i, k) : 7.0f;
}

/* float32 buckets travelling as bf16 (and fp16): the mean of the 16-bit
 * values each rank sent, within the rounding of one sum per rank. */
static void compressed_pass(int wire, int *mpidp__test_failed)
{
    f32_reducer_t f;
    ASSERT_OK(f32_reducer(&f, wire, 0));
    f32_fill(&f, tenth_grad, 0);
    ASSERT_OK(f32_mark_and_wait(&f));
    for (int i = 0; i < NP; i++) {
        int used = -1;
        ASSERT_OK(mpidp_reducer_used_globally(f.r, (size_t)i, &used));
        ASSERT_EQ_INT(used, i != 5);
        for (int k = 0; k < PN; k++) {
            double expect = 0;
            for (int q = 0; q < f.size; q++)
                if (has_grad(q, i)) expect += 0.1 * grad_of(q, i, k);
            expect /= f.size;
            double got = ((const float *)f.data[f.bucket[i]])[f.offset[i] + (size_t)k];
            /* bf16 keeps 8 significant bits, fp16 11: one rounding per rank. */
            double rel = wire == MPIDP_BF16 ? 1.0 / 128 : 1.0 / 1024;
            ASSERT_NEAR(got, expect, rel * f.size * (1 + expect));
        }
    }
    ASSERT_OK(mpidp_reducer_reset(f.r));
    ASSERT_OK(f32_reducer_free(&f));
}

TEST(bf16_wire) { compressed_pass(MPIDP_BF16, mpidp__test_failed); }
TEST(fp16_wire) { compressed_pass(MPIDP_F16, mpidp__test_failed); }

/* (rank + 1) * (i + k): every rank has a gradient for every parameter. */
static float ranked_grad(int rank, int i, int k, int pass)
{
    (void)pass;
    return (float)(rank + 1) * (float)(i + k);
}

/* Separate communication buffers (non-blocking DataParallel): the bucket is
 * zeroed once posted, writes into it cannot disturb the collective, and
 * deliver() copies or adds the mean into each slice. */
static void separate_pass(int wire, int *mpidp__test_failed)
{
    f32_reducer_t f;
    ASSERT_OK(f32_reducer(&f, wire, 1));
    mpidp_reducer_t *r = f.r;
    int size = f.size;
    f32_fill(&f, ranked_grad, 0);
    for (int i = 0; i < NP; i++) ASSERT_OK(mpidp_reducer_mark_ready(r, (size_t)i, 1));
    /* Posted: the buckets are zero, and scribbling on them changes nothing. */
    for (int i = 0; i < NP; i++) {
        size_t n;
        float *slice = mpidp_reducer_slice(r, (size_t)i, &n);
        ASSERT_EQ_INT(n, PN);
        for (size_t k = 0; k < n; k++) {
            ASSERT_NEAR(slice[k], 0.0, 0);
            slice[k] = 1000.0f;
        }
    }
    ASSERT_OK(mpidp_reducer_wait_all(r, 30.0));
    double mean_factor = (size + 1) / 2.0; /* mean of (rank + 1) */
    double tol = wire == -1 ? 1e-5 : wire == MPIDP_BF16 ? 1.0 / 64 : 1.0 / 512;
    for (int i = 0; i < NP; i++) {
        int mode = i % 2 ? MPIDP_DELIVER_ADD : MPIDP_DELIVER_COPY;
        ASSERT_OK(mpidp_reducer_deliver(r, (size_t)i, mode));
        size_t n;
        float *slice = mpidp_reducer_slice(r, (size_t)i, &n);
        for (size_t k = 0; k < n; k++) {
            double expect = mean_factor * (double)(i + (int)k) + (mode == MPIDP_DELIVER_ADD ? 1000.0 : 0.0);
            ASSERT_NEAR(slice[k], expect, tol * (1 + expect));
        }
    }
    ASSERT_OK(mpidp_reducer_reset(r));
    ASSERT_OK(f32_reducer_free(&f));
}

TEST(separate_buffers) { separate_pass(-1, mpidp__test_failed); }
TEST(separate_buffers_bf16_wire) { separate_pass(MPIDP_BF16, mpidp__test_failed); }

/* float32 buckets with a uint8 wire: each bucket's data equal, bit for bit,
 * a standalone quantized allreduce (tests/c/test_mpi_qallreduce.c checks
 * that one against a model) of the data scaled by 1/size, unused slices
 * zeroed; the flags stay exact. Blocking and separate buffers. */
static void quantized_pass(int separate, int *mpidp__test_failed)
{
    f32_reducer_t f;
    ASSERT_OK(f32_reducer(&f, MPIDP_U8, separate));
    int rank = f.rank, size = f.size;
    float *want[NP];
    f32_fill(&f, tenth_grad, 0);
    for (size_t b = 0; b < f.nb; b++) {
        want[b] = malloc(f.info[b].numel * sizeof(float));
        memcpy(want[b], f.data[b], f.info[b].numel * sizeof(float));
    }
    for (int i = 0; i < NP; i++)
        if (!has_grad(rank, i)) memset(want[f.bucket[i]] + f.offset[i], 0, PN * sizeof(float));
    for (size_t b = 0; b < f.nb; b++) {
        mpidp_pack_kernels()->scale_f32(want[b], (float)(1.0 / size), f.info[b].numel);
        mpidp_tensor_t t = {.data = want[b], .numel = f.info[b].numel, .dtype = MPIDP_F32,
                            .device = MPIDP_DEV_CPU};
        mpidp_qallreduce_opts_t o = {.what = "want"};
        mpidp_qallreduce_t *q = NULL;
        ASSERT_OK(mpidp_qallreduce_start(MPI_COMM_WORLD, &t, &o, f.reqs, &q));
        ASSERT_OK(mpidp_qallreduce_wait(q, 30.0));
        ASSERT_OK(mpidp_qallreduce_free(q));
    }
    ASSERT_OK(f32_mark_and_wait(&f));
    for (int i = 0; i < NP; i++) {
        const float *got;
        size_t n;
        result_of(&f, i, separate, &got, &n, mpidp__test_failed);
        if (!got) return;
        ASSERT_TRUE(memcmp(got, want[f.bucket[i]] + f.offset[i], n * sizeof(float)) == 0);
    }
    ASSERT_OK(mpidp_reducer_reset(f.r));
    for (size_t b = 0; b < f.nb; b++) free(want[b]);
    ASSERT_OK(f32_reducer_free(&f));
}

/* A quarter of (rank + 1) * (i + k + pass) where the rank has a gradient. */
static float pass_grad(int rank, int i, int k, int pass)
{
    return has_grad(rank, i) ? 0.25f * (float)((rank + 1) * (i + k + pass)) : 7.0f;
}

/* Hierarchical mode: nodes of 2 ranks (one node of all ranks for an odd
 * count). The mean of every rank's gradients, unused parameters flagged, for
 * float32, bf16 and uint8 wires, blocking and separate buffers; float32
 * within fp32 rounding (the sum is taken in another order than a flat
 * allreduce), the compressed wires within their quantization. */
static void hierarchical_pass(int wire, int separate, int *mpidp__test_failed)
{
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int L = size % 2 == 0 ? 2 : size;
    MPI_Comm comms[3];
    MPI_Comm_split(MPI_COMM_WORLD, rank / L, rank, &comms[0]);
    MPI_Comm_split(MPI_COMM_WORLD, rank % L, rank, &comms[1]);
    MPI_Comm_split(MPI_COMM_WORLD, rank / L, rank, &comms[2]);
    f32_reducer_t f;
    ASSERT_OK(f32_reducer_hier(&f, wire, separate, comms));
    for (int pass = 0; pass < 2; pass++) {
        f32_fill(&f, pass_grad, pass);
        ASSERT_OK(f32_mark_and_wait(&f));
        double top = 0.25 * size * (NP + PN + 1); /* above every mean */
        double tol = wire == -1 ? 1e-6 * top : wire == MPIDP_BF16 ? top / 64 : 4 * top / 255;
        for (int i = 0; i < NP; i++) {
            const float *got;
            size_t n;
            result_of(&f, i, separate, &got, &n, mpidp__test_failed);
            if (!got) return;
            for (size_t k = 0; k < n; k++) {
                double want = 0;
                for (int q = 0; q < size; q++)
                    if (has_grad(q, i)) want += 0.25 * (q + 1) * (i + (int)k + pass);
                ASSERT_NEAR(got[k], want / size, tol);
            }
        }
        ASSERT_OK(mpidp_reducer_reset(f.r));
    }
    ASSERT_OK(f32_reducer_free(&f));
    for (int c = 0; c < 3; c++) MPI_Comm_free(&comms[c]);
}

TEST(hierarchical) { hierarchical_pass(-1, 0, mpidp__test_failed); }
TEST(hierarchical_bf16_separate) { hierarchical_pass(MPIDP_BF16, 1, mpidp__test_failed); }
TEST(hierarchical_uint8) { hierarchical_pass(MPIDP_U8, 0, mpidp__test_failed); }
TEST(hierarchical_uint8_separate) { hierarchical_pass(MPIDP_U8, 1, mpidp__test_failed); }

TEST(uint8_wire) { quantized_pass(0, mpidp__test_failed); }
TEST(separate_buffers_uint8_wire) { quantized_pass(1, mpidp__test_failed); }

/* What a dropped reducer does: a pass whose buckets are all posted lands
 * before it is freed (nothing left in flight); a half-posted one (backward
 * raised) is refused, nothing freed, so its buffers can be kept. */
TEST(close_lands_a_posted_pass_and_refuses_a_half_posted_one)
{
    f32_reducer_t f;
    ASSERT_OK(f32_reducer(&f, -1, 0));
    for (size_t i = 0; i < NP; i++) ASSERT_OK(mpidp_reducer_mark_ready(f.r, i, 1));
    ASSERT_OK(mpidp_reducer_finalize(f.r, NULL));
    ASSERT_OK(mpidp_reducer_close(f.r, 30.0));
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(f.reqs), 0);
    f.r = NULL;
    ASSERT_OK(f32_reducer_free(&f));

    ASSERT_OK(f32_reducer(&f, -1, 0));
    ASSERT_TRUE(f.nb > 1);
    for (size_t i = 0; i < NP; i++)
        if (f.bucket[i] == 0) ASSERT_OK(mpidp_reducer_mark_ready(f.r, i, 1));
    ASSERT_EQ_INT(mpidp_reducer_bucket_state(f.r, 0), MPIDP_BUCKET_POSTED);
    ASSERT_EQ_INT(mpidp_reducer_close(f.r, 30.0), MPIDP_ESTATE);
    for (size_t i = 0; i < NP; i++)
        if (f.bucket[i] != 0) ASSERT_OK(mpidp_reducer_mark_ready(f.r, i, 1));
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 30.0));
    ASSERT_OK(f32_reducer_free(&f));
}

TEST_MAIN_MPI(mean_over_ranks_with_unused_parameters, bf16_wire, fp16_wire, separate_buffers,
              separate_buffers_bf16_wire, uint8_wire, separate_buffers_uint8_wire, hierarchical,
              hierarchical_bf16_separate, hierarchical_uint8, hierarchical_uint8_separate,
              close_lands_a_posted_pass_and_refuses_a_half_posted_one)
