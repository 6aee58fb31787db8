/* The 8-bit quantized allreduce across real ranks (2, 3 and 4): every rank
 * reduces different data; each rank computes the expected bits from all
 * ranks' inputs with a model of the algorithm written here (quantize each
 * rank's chunk, decode and sum in rank order, scale, requantize, decode) on
 * the reference kernels, and checks the exact error bound against a float64
 * sum. Segmenting and in-flight limits, odd lengths, a NaN on one rank,
 * identical bits on every rank, the mpidp_allreduce_start(wire = U8) entry
 * and bad tensors. */
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/allreduce.h"
#include "mpidp/mpiops.h"
#include "mpidp/qallreduce.h"
#include "mpidp/quant8.h"
#include "mpidp/status.h"
#include "mpi_world.h"
#include "test.h"
#include "quant8_internal.h"

/* Rank r's input: smooth values of a different scale per rank, plus noise. */
static float input(int r, size_t i)
{
    uint32_t h = (uint32_t)(i * 2654435761u) ^ (uint32_t)(r * 40503u);
    h ^= h >> 13;
    float noise = (float)(h % 1000) / 1000.0f - 0.5f;
    return sinf((float)i * 0.01f) * (float)(r + 1) + noise;
}

/* The expected result of element range [start, start + len) of a segment of
 * the inputs shifted by `shift` elements: the model of qallreduce.h's three
 * steps, on the reference kernels. */
static void model_segment(float *out, size_t start, size_t len, int average, size_t shift)
{
    size_t per = (len + (size_t)size_ - 1) / (size_t)size_;
    size_t chunk = (per + MPIDP_Q8_BLOCK - 1) / MPIDP_Q8_BLOCK * MPIDP_Q8_BLOCK;
    float *in = malloc((chunk ? chunk : 1) * sizeof *in), *acc = malloc((chunk ? chunk : 1) * sizeof *acc);
    uint8_t *q = malloc(mpidp_q8_bytes(chunk) + 1);
    for (int c = 0; c < size_; c++) {
        size_t from = (size_t)c * chunk;
        size_t n = from >= len ? 0 : (len - from < chunk ? len - from : chunk);
        for (int r = 0; r < size_ && n > 0; r++) {
            for (size_t i = 0; i < n; i++) in[i] = input(r, start + from + i + shift);
            mpidp__q8_ref.encode(q, in, 1.0f, n);
            mpidp__q8_ref.decode(acc, q, r > 0, n);
        }
        if (n == 0) continue;
        mpidp__q8_ref.encode(q, acc, average ? 1.0f / (float)size_ : 1.0f, n);
        mpidp__q8_ref.decode(out + from, q, 0, n);
    }
    free(in), free(acc), free(q);
}

static void model_shifted(float *out, size_t n, size_t seg, int average, size_t shift)
{
    for (size_t s = 0; s < n; s += seg)
        model_segment(out + s, s, n - s < seg ? n - s : seg, average, shift);
}

static void model(float *out, size_t n, size_t seg, int average)
{
    model_shifted(out, n, seg, average, 0);
}

static int qreduce(float *data, size_t n, int average, size_t seg, size_t in_flight,
                   mpidp_reqtable_t *reqs)
{
    mpidp_tensor_t t = {.data = data, .numel = n, .dtype = MPIDP_F32, .device = MPIDP_DEV_CPU};
    mpidp_qallreduce_opts_t o = {.average = average, .segment_elems = seg,
                                 .max_in_flight = in_flight, .drain_timeout_s = 10.0, .what = "t"};
    mpidp_qallreduce_t *x = NULL;
    int rc = mpidp_qallreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &x);
    if (rc != MPIDP_OK) return rc;
    /* Half the time progress by polling, as hooks do, before waiting. */
    int done = 0;
    for (int k = 0; k < 50 && !done && rc == MPIDP_OK && (n & 1); k++) rc = mpidp_qallreduce_test(x, &done);
    if (rc == MPIDP_OK) rc = mpidp_qallreduce_wait(x, 10.0);
    if (rc == MPIDP_OK) rc = mpidp_qallreduce_free(x);
    return rc;
}

/* 1 when every rank holds the same bytes. */
static int same_everywhere(const float *x, size_t n)
{
    unsigned long long h = 1469598103934665603ull;
    const unsigned char *b = (const unsigned char *)x;
    for (size_t i = 0; i < n * sizeof *x; i++) h = (h ^ b[i]) * 1099511628211ull;
    unsigned long long lo = h, hi = h;
    MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
    return lo == hi;
}

TEST(matches_the_model_bit_for_bit_over_segments_and_lengths)
{
    mpidp_reqtable_t *reqs = table(64);
    static const size_t lengths[] = {1, 7, 255, 256, 1000, 5003, 40000};
    static const size_t segs[] = {0, 1000, 4096};
    static const size_t flights[] = {1, 2, 3};
    for (size_t li = 0; li < sizeof lengths / sizeof *lengths; li++) {
        size_t n = lengths[li];
        float *x = malloc(n * sizeof *x), *want = malloc(n * sizeof *want);
        for (size_t si = 0; si < 3; si++) {
            for (int average = 0; average < 2; average++) {
                size_t seg = segs[si], fl = flights[(li + si) % 3];
                for (size_t i = 0; i < n; i++) x[i] = input(rank_, i);
                ASSERT_OK(qreduce(x, n, average, seg, fl, reqs));
                model(want, n, seg ? seg : MPIDP_QALLREDUCE_SEGMENT, average);
                ASSERT_TRUE(memcmp(x, want, n * sizeof *x) == 0);
                ASSERT_TRUE(same_everywhere(x, n));
            }
        }
        free(x), free(want);
    }
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    mpidp_reqtable_destroy(reqs);
}

/* Against the exact float64 sum: each rank's input is off by at most half a
 * step of its block, the sum by half a step of the summed block. */
TEST(error_within_the_quantization_bound_of_the_exact_sum)
{
    mpidp_reqtable_t *reqs = table(64);
    enum { N = 3000 };
    float x[N];
    for (size_t i = 0; i < N; i++) x[i] = input(rank_, i);
    ASSERT_OK(qreduce(x, N, 0, 0, 0, reqs));
    double worst = 0.0;
    for (size_t blk = 0; blk * MPIDP_Q8_BLOCK < N; blk++) {
        /* Chunks are whole blocks from a segment's start, so the blocks of
         * both quantizations are exactly the 256-element blocks from 0. */
        size_t a = blk * MPIDP_Q8_BLOCK, b = a + MPIDP_Q8_BLOCK < N ? a + MPIDP_Q8_BLOCK : N;
        size_t wa = a, wb = b;
        double bound = 0.0, slo = 1e300, shi = -1e300;
        for (int r = 0; r < size_; r++) {
            double lo = 1e300, hi = -1e300;
            for (size_t i = wa; i < wb; i++) lo = fmin(lo, input(r, i)), hi = fmax(hi, input(r, i));
            bound += (hi - lo) / 510.0;
        }
        for (size_t i = wa; i < wb; i++) {
            double s = 0.0;
            for (int r = 0; r < size_; r++) s += input(r, i);
            slo = fmin(slo, s), shi = fmax(shi, s);
        }
        bound += (shi - slo + 2 * bound) / 510.0 + 1e-4;
        for (size_t i = a; i < b; i++) {
            double s = 0.0;
            for (int r = 0; r < size_; r++) s += input(r, i);
            double err = fabs(x[i] - s);
            worst = fmax(worst, err / bound);
            ASSERT_TRUE(err <= bound);
        }
    }
    if (rank_ == 0) printf("  worst error / bound: %.3f\n", worst);
    mpidp_reqtable_destroy(reqs);
}

TEST(a_nan_on_one_rank_poisons_its_block_everywhere)
{
    mpidp_reqtable_t *reqs = table(64);
    enum { N = 4 * 2 * MPIDP_Q8_BLOCK };
    static float x[N];
    for (size_t i = 0; i < N; i++) x[i] = input(rank_, i);
    if (rank_ == size_ - 1) x[MPIDP_Q8_BLOCK + 3] = NAN;
    ASSERT_OK(qreduce(x, N, 1, 0, 0, reqs));
    ASSERT_TRUE(same_everywhere(x, N));
    /* Chunks are whole blocks from 0, so element 259 shares a block with 256..511. */
    for (size_t i = 0; i < N; i++) {
        int poisoned = i >= MPIDP_Q8_BLOCK && i < 2 * MPIDP_Q8_BLOCK;
        ASSERT_TRUE(poisoned ? isnan(x[i]) : isfinite(x[i]));
    }
    mpidp_reqtable_destroy(reqs);
}

TEST(allreduce_with_uint8_wire_runs_the_quantized_engine)
{
    mpidp_reqtable_t *reqs = table(64);
    enum { N = 2000 };
    float x[N], want[N];
    for (size_t i = 0; i < N; i++) x[i] = input(rank_, i);
    mpidp_tensor_t t = {.data = x, .numel = N, .dtype = MPIDP_F32, .device = MPIDP_DEV_CPU};
    mpidp_allreduce_opts_t o = mpidp_allreduce_default_opts(MPIDP_F32, MPIDP_OP_AVG, MPIDP_U8, 10.0, "t");
    mpidp_allreduce_t *a = NULL;
    ASSERT_OK(mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &a));
    ASSERT_OK(mpidp_allreduce_wait(a, 10.0));
    ASSERT_OK(mpidp_allreduce_free(a));
    model(want, N, MPIDP_QALLREDUCE_SEGMENT, 1);
    ASSERT_TRUE(memcmp(x, want, sizeof x) == 0);
    /* Refused: other ops, other dtypes, keep_wire. */
    o.op = MPIDP_OP_MAX;
    ASSERT_EQ_INT(mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &a), MPIDP_EINVAL);
    o.op = MPIDP_OP_SUM;
    o.keep_wire = 1;
    ASSERT_EQ_INT(mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, reqs, &a), MPIDP_EINVAL);
    o.keep_wire = 0;
    double d[4] = {0};
    mpidp_tensor_t td = {.data = d, .numel = 4, .dtype = MPIDP_F64, .device = MPIDP_DEV_CPU};
    ASSERT_EQ_INT(mpidp_allreduce_start(MPI_COMM_WORLD, &td, &o, reqs, &a), MPIDP_EDTYPE);
    t.read_only = 1;
    mpidp_qallreduce_opts_t qo = {.what = "t"};
    mpidp_qallreduce_t *q = NULL;
    ASSERT_EQ_INT(mpidp_qallreduce_start(MPI_COMM_WORLD, &t, &qo, reqs, &q), MPIDP_EINVAL);
    t.read_only = 0, t.device = MPIDP_DEV_CUDA;
    ASSERT_EQ_INT(mpidp_qallreduce_start(MPI_COMM_WORLD, &t, &qo, reqs, &q), MPIDP_EDEVICE);
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    mpidp_reqtable_destroy(reqs);
}

/* Two quantized allreduces and a plain MPI_Iallreduce in flight on one
 * communicator at once, completed in a different order on odd and even
 * ranks: the point-to-point exchanges with per-operation tags keep them
 * apart (dependent collectives would have started in different orders). */
TEST(concurrent_operations_on_one_communicator_complete_in_any_order)
{
    mpidp_reqtable_t *reqs = table(64);
    enum { N = 3 * MPIDP_Q8_BLOCK + 5 };
    static float a[N], b[N], wa[N], wb[N];
    for (int round = 0; round < 3; round++) {
        for (size_t i = 0; i < N; i++) a[i] = input(rank_, i), b[i] = input(rank_, i + 17);
        mpidp_tensor_t ta = {.data = a, .numel = N, .dtype = MPIDP_F32, .device = MPIDP_DEV_CPU};
        mpidp_tensor_t tb = ta;
        tb.data = b;
        mpidp_qallreduce_opts_t o = {.segment_elems = 300, .max_in_flight = 2,
                                     .drain_timeout_s = 10.0, .what = "t"};
        mpidp_qallreduce_t *qa = NULL, *qb = NULL;
        ASSERT_OK(mpidp_qallreduce_start(MPI_COMM_WORLD, &ta, &o, reqs, &qa));
        int plain = rank_ + 1;
        MPI_Request pr;
        MPI_Iallreduce(MPI_IN_PLACE, &plain, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD, &pr);
        o.average = 1;
        ASSERT_OK(mpidp_qallreduce_start(MPI_COMM_WORLD, &tb, &o, reqs, &qb));
        if ((rank_ + round) % 2) {
            ASSERT_OK(mpidp_qallreduce_wait(qb, 10.0));
            ASSERT_OK(mpidp_qallreduce_wait(qa, 10.0));
        } else {
            MPI_Wait(&pr, MPI_STATUS_IGNORE);
            ASSERT_OK(mpidp_qallreduce_wait(qa, 10.0));
            ASSERT_OK(mpidp_qallreduce_wait(qb, 10.0));
        }
        MPI_Wait(&pr, MPI_STATUS_IGNORE);
        ASSERT_EQ_INT(plain, size_ * (size_ + 1) / 2);
        ASSERT_OK(mpidp_qallreduce_free(qa));
        ASSERT_OK(mpidp_qallreduce_free(qb));
        model(wa, N, 300, 0);
        model_shifted(wb, N, 300, 1, 17);
        ASSERT_TRUE(memcmp(a, wa, sizeof a) == 0);
        ASSERT_TRUE(memcmp(b, wb, sizeof b) == 0);
    }
    mpidp_reqtable_destroy(reqs);
}

TEST(empty_tensor_is_done_at_once)
{
    mpidp_reqtable_t *reqs = table(64);
    float x[1] = {5.0f};
    ASSERT_OK(qreduce(x, 0, 0, 0, 0, reqs));
    ASSERT_TRUE(x[0] == 5.0f);
    ASSERT_TRUE(mpidp_qallreduce_bytes_per_elem(1) == 0.0);
    ASSERT_TRUE(fabs(mpidp_qallreduce_bytes_per_elem(4) - 1.5 * 264 / 256) < 1e-12);
    mpidp_reqtable_destroy(reqs);
}

TEST_MAIN_MPI(matches_the_model_bit_for_bit_over_segments_and_lengths,
              error_within_the_quantization_bound_of_the_exact_sum,
              a_nan_on_one_rank_poisons_its_block_everywhere,
              allreduce_with_uint8_wire_runs_the_quantized_engine,
              concurrent_operations_on_one_communicator_complete_in_any_order,
              empty_tensor_is_done_at_once)
