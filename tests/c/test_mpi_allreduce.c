/* The chunked allreduce engine across real ranks (mpirun -np 2, rank-agnostic):
 * every rank reduces different data, the expected result is computed here from
 * all ranks' inputs; chunking, the in-flight limit, "avg", bf16/fp16 wire
 * compression, keep_wire, bad options, and a full request table (refused with
 * a status, the chunks already posted drained, nothing left pending). */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/allreduce.h"
#include "mpidp/mpiops.h"
#include "mpidp/operation.h"
#include "mpidp/pack.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "mpi_world.h"
#include "test.h"

#define N 53 /* not a multiple of any chunk size below */

/* Small integers times a power of two: exact in fp32, bf16 and fp16, and so
 * are their sums over a few ranks and their halves. */
static float input(int rank, size_t i) { return (float)((int)(i % 7) - 3 + rank) * 0.25f; }

static float expected_sum(size_t i)
{
    float s = 0.0f;
    for (int r = 0; r < size_; r++) s += input(r, i);
    return s;
}

/* Waits for a started allreduce (each wait bounded by timeout_s), then frees
 * it; a failed wait leaves it allocated, as its requests may be in flight. */
static int finish(mpidp_allreduce_t *x, double timeout_s)
{
    int rc = mpidp_allreduce_wait(x, timeout_s);
    return rc == MPIDP_OK ? mpidp_allreduce_free(x) : rc;
}

static int reduce(float *data, size_t n, int op, int wire, size_t chunk, size_t in_flight,
                  mpidp_reqtable_t *reqs)
{
    mpidp_tensor_t t = {.data = data, .numel = n, .dtype = MPIDP_F32, .device = MPIDP_DEV_CPU};
    mpidp_allreduce_opts_t o = {.op = op, .wire = wire, .chunk_elems = chunk,
                                .max_in_flight = in_flight, .drain_timeout_s = 10.0, .what = "t"};
    mpidp_allreduce_t *x = NULL;
    int rc = mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &x);
    return rc == MPIDP_OK ? finish(x, 10.0) : rc;
}

/* Fills data[0..N) with this rank's inputs and starts an allreduce of them. */
static int start_on_inputs(float data[N], const mpidp_allreduce_opts_t *o, mpidp_reqtable_t *reqs,
                           mpidp_allreduce_t **x)
{
    for (size_t i = 0; i < N; i++) data[i] = input(rank_, i);
    mpidp_tensor_t t = {.data = data, .numel = N, .dtype = MPIDP_F32, .device = MPIDP_DEV_CPU};
    return mpidp_allreduce_start(MPI_COMM_WORLD, &t, o, reqs, x);
}

TEST(sum_and_avg_over_chunks_and_in_flight_limits)
{
    mpidp_reqtable_t *reqs = table(64); /* room for all 53 one-element chunks at once */
    static const int wires[] = {-1, MPIDP_BF16, MPIDP_F16};
    for (int w = 0; w < 3; w++)
        for (int op = MPIDP_OP_SUM; op <= MPIDP_OP_AVG; op++)
            for (size_t chunk = 1; chunk <= 64; chunk *= 4)
                for (size_t in_flight = 0; in_flight <= 3; in_flight++) {
                    float data[N];
                    for (size_t i = 0; i < N; i++) data[i] = input(rank_, i);
                    ASSERT_OK(reduce(data, N, op, wires[w], chunk, in_flight, reqs));
                    /* 1/size is exact for a power of two; else "avg" rounds the
                     * scaled inputs (to the wire's 8 or 11 bits when compressed). */
                    double tol = op == MPIDP_OP_SUM || (size_ & (size_ - 1)) == 0 ? 0.0
                                 : wires[w] == -1 ? 1e-6 : 0.02;
                    for (size_t i = 0; i < N; i++) {
                        float want = expected_sum(i) / (op == MPIDP_OP_AVG ? (float)size_ : 1.0f);
                        ASSERT_NEAR(data[i], want, tol);
                    }
                }
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(float64_in_place)
{
    mpidp_reqtable_t *reqs = table(8);
    double data[N];
    for (size_t i = 0; i < N; i++) data[i] = 1e-3 * (double)(rank_ + 1) * (double)i;
    mpidp_tensor_t t = {.data = data, .numel = N, .dtype = MPIDP_F64, .device = MPIDP_DEV_CPU};
    mpidp_allreduce_opts_t o = {.op = MPIDP_OP_SUM, .wire = -1, .chunk_elems = 10,
                                .max_in_flight = 2, .what = "f64"};
    mpidp_allreduce_t *x;
    ASSERT_OK(mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &x));
    ASSERT_OK(finish(x, 10.0));
    for (size_t i = 0; i < N; i++)
        ASSERT_NEAR(data[i], 1e-3 * (double)i * size_ * (size_ + 1) / 2.0, 1e-12);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(keep_wire_leaves_the_summed_wire_buffer)
{
    mpidp_reqtable_t *reqs = table(16);
    float data[N];
    mpidp_allreduce_opts_t o = {.op = MPIDP_OP_SUM, .wire = MPIDP_BF16, .chunk_elems = 8,
                                .max_in_flight = 0, .keep_wire = 1, .what = "keep"};
    mpidp_allreduce_t *x;
    ASSERT_OK(start_on_inputs(data, &o, reqs, &x));
    ASSERT_OK(mpidp_allreduce_wait(x, 10.0));
    const uint16_t *w = mpidp_allreduce_wire(x);
    ASSERT_TRUE(w != NULL);
    for (size_t i = 0; i < N; i++) {
        ASSERT_NEAR(mpidp_f32_from_bf16(w[i]), expected_sum(i), 0.0);
        ASSERT_NEAR(data[i], input(rank_, i), 0.0); /* the tensor itself is untouched */
    }
    ASSERT_OK(mpidp_allreduce_free(x));
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(a_full_request_table_is_a_status_not_a_wait)
{
    /* Every chunk at once (7 chunks) into a table of 3 slots: the fourth post
     * is refused before it happens; the three posted are drained (every rank
     * posted the same three), and nothing stays pending. */
    mpidp_reqtable_t *reqs = table(3);
    float data[N];
    for (size_t i = 0; i < N; i++) data[i] = input(rank_, i);
    ASSERT_EQ_INT(reduce(data, N, MPIDP_OP_SUM, -1, 8, 0, reqs), MPIDP_EFULL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "3 requests already in flight") != NULL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "chunk 4/7") != NULL);
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
    for (size_t i = 0; i < 24; i++) ASSERT_NEAR(data[i], expected_sum(i), 0.0); /* chunks 1-3 landed */
    /* With at most 3 in flight the same reduction fits and completes. */
    for (size_t i = 0; i < N; i++) data[i] = input(rank_, i);
    ASSERT_OK(reduce(data, N, MPIDP_OP_SUM, -1, 8, 3, reqs));
    for (size_t i = 0; i < N; i++) ASSERT_NEAR(data[i], expected_sum(i), 0.0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(bad_options_are_refused_before_posting)
{
    mpidp_reqtable_t *reqs = table(4);
    float data[4] = {0};
    double d[4] = {0};
    mpidp_tensor_t t = {.data = data, .numel = 4, .dtype = MPIDP_F32, .device = MPIDP_DEV_CPU};
    mpidp_tensor_t t64 = {.data = d, .numel = 4, .dtype = MPIDP_F64, .device = MPIDP_DEV_CPU};
    mpidp_tensor_t gpu = t;
    gpu.device = MPIDP_DEV_CUDA;
    mpidp_allreduce_opts_t ok = {.op = MPIDP_OP_SUM, .wire = -1, .chunk_elems = 2};
    mpidp_allreduce_opts_t o;
    mpidp_allreduce_t *x = NULL;
    o = ok, o.op = MPIDP_OP_BXOR + 1;
    ASSERT_EQ_INT(mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &x), MPIDP_EINVAL);
    o = ok, o.op = MPIDP_OP_BXOR;   /* a bitwise op of floats */
    ASSERT_EQ_INT(mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &x), MPIDP_EDTYPE);
    o = ok, o.chunk_elems = 0;
    ASSERT_EQ_INT(mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &x), MPIDP_EINVAL);
    o = ok, o.wire = MPIDP_BF16;
    ASSERT_EQ_INT(mpidp_allreduce_start(MPI_COMM_WORLD, &t64, &o, reqs, &x), MPIDP_EDTYPE);
    o = ok, o.keep_wire = 1;
    ASSERT_EQ_INT(mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &x), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_allreduce_start(MPI_COMM_WORLD, &gpu, &ok, reqs, &x), MPIDP_EDEVICE);
    ASSERT_EQ_INT(mpidp_allreduce_start(MPI_COMM_WORLD, &t, &ok, NULL, &x), MPIDP_EINVAL);
    ASSERT_TRUE(x == NULL);
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST(default_options_bound_the_wire_copy_and_reduce_plain_tensors_in_place)
{
    mpidp_allreduce_opts_t c = mpidp_allreduce_default_opts(MPIDP_F32, MPIDP_OP_AVG, MPIDP_BF16,
                                                            5.0, "x");
    ASSERT_EQ_INT(c.op, MPIDP_OP_AVG);
    ASSERT_EQ_INT(c.wire, MPIDP_BF16);
    ASSERT_EQ_INT(c.chunk_elems, MPIDP_ALLREDUCE_WIRE_CHUNK);
    ASSERT_EQ_INT(c.max_in_flight, MPIDP_ALLREDUCE_WIRE_IN_FLIGHT);
    ASSERT_EQ_INT(c.keep_wire, 0);
    ASSERT_TRUE(c.drain_timeout_s == 5.0 && strcmp(c.what, "x") == 0);
    /* No wire dtype, or the tensor's own: in place, every chunk posted at once. */
    static const int plain_wires[] = {-1, MPIDP_BF16};
    for (int w = 0; w < 2; w++) {
        mpidp_allreduce_opts_t p =
            mpidp_allreduce_default_opts(MPIDP_BF16, MPIDP_OP_SUM, plain_wires[w], 0, "y");
        ASSERT_EQ_INT(p.chunk_elems, MPIDP_ALLREDUCE_PLAIN_CHUNK);
        ASSERT_EQ_INT(p.max_in_flight, 0);
    }
    /* And they work: a compressed average of N elements. */
    mpidp_reqtable_t *reqs = table(8);
    float data[N];
    mpidp_allreduce_t *x = NULL;
    ASSERT_OK(start_on_inputs(data, &c, reqs, &x));
    ASSERT_OK(finish(x, 60.0));
    double tol = (size_ & (size_ - 1)) == 0 ? 0.0 : 0.02; /* as in the test above */
    for (size_t i = 0; i < N; i++) ASSERT_NEAR(data[i], expected_sum(i) / (float)size_, tol);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

/* What mpidp._C.Work does with any engine's operation: test until done
 * (later chunks are posted by the tests), then free; a wait on a finished
 * one returns at once. */
TEST(the_operation_table_drives_an_allreduce_to_completion)
{
    mpidp_reqtable_t *reqs = table(8);
    float data[N];
    mpidp_allreduce_opts_t o = {.op = MPIDP_OP_SUM, .wire = MPIDP_BF16, .chunk_elems = 8,
                                .max_in_flight = 2, .drain_timeout_s = 10.0, .what = "op"};
    mpidp_allreduce_t *x = NULL;
    ASSERT_OK(start_on_inputs(data, &o, reqs, &x));
    const mpidp_operation_t *ops = &mpidp_allreduce_operation;
    int done = 0;
    for (long tests = 0; !done; tests++) {
        ASSERT_OK(ops->test(x, &done));
        ASSERT_TRUE(tests < 100000000L);
    }
    ASSERT_OK(ops->wait(x, 10.0));
    ASSERT_OK(ops->free(x));
    for (size_t i = 0; i < N; i++) ASSERT_NEAR(data[i], expected_sum(i), 0.0);
    ASSERT_EQ_INT(mpidp_reqtable_pending(reqs), 0);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST_MAIN_MPI(sum_and_avg_over_chunks_and_in_flight_limits, float64_in_place,
              keep_wire_leaves_the_summed_wire_buffer, a_full_request_table_is_a_status_not_a_wait,
              bad_options_are_refused_before_posting,
              default_options_bound_the_wire_copy_and_reduce_plain_tensors_in_place,
              the_operation_table_drives_an_allreduce_to_completion)
