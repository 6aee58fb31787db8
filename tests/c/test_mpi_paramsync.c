/* The parameter-sync engine across real ranks (rank-agnostic; run at 2, 3 and
 * 4 ranks): each rank moves its parameters differently away from a shared
 * reference; merge, grad_into and restore are compared with a scalar
 * reference computed here from every rank's values (the wire rounding done by
 * the reference conversions of mpidp/pack.h), and the state rules and the
 * merge weights are checked. */
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/mpiops.h"
#include "mpidp/pack.h"
#include "mpidp/paramsync.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "test.h"

#define NP 3
static const size_t NUMEL[NP] = {5, 0, 37}; /* an empty parameter in the middle */
#define TOTAL 42

static int rank_, size_;

static float ref_value(size_t k) { return 0.5f * (float)((int)(k % 11) - 5); }
/* Rank r's parameter k after "training": the reference plus a small step. */
static float moved(int r, size_t k) { return ref_value(k) + 0.01f * (float)((int)(k % 5) - 2 + r); }

/* The difference as it travels: fp32, or rounded to bf16/fp16 (the pack
 * kernels round p - ref computed in fp32 to nearest even). */
static double on_wire(float d, int wire)
{
    if (wire == MPIDP_BF16) return mpidp_f32_from_bf16(mpidp_bf16_from_f32(d));
    if (wire == MPIDP_F16) return mpidp_f32_from_fp16(mpidp_fp16_from_f32(d));
    return d;
}

static double sum_of_differences(size_t k, int wire)
{
    double s = 0.0;
    for (int r = 0; r < size_; r++) s += on_wire(moved(r, k) - ref_value(k), wire);
    return s;
}

typedef struct {
    float data[TOTAL];
    float *p[NP];
    mpidp_reqtable_t *reqs;
    mpidp_paramsync_t *s;
} fixture_t;

static int make(fixture_t *f, int wire)
{
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    mpidp_mpiops_init();
    size_t off = 0;
    for (int i = 0; i < NP; i++) {
        f->p[i] = f->data + off;
        off += NUMEL[i];
    }
    for (size_t k = 0; k < TOTAL; k++) f->data[k] = ref_value(k);
    mpidp_reqtable_create(16, &f->reqs);
    mpidp_paramsync_config_t cfg = {.comm = MPI_COMM_WORLD, .reqs = f->reqs, .n_params = NP,
                                    .params = f->p, .numel = NUMEL, .wire = wire,
                                    .chunk_elems = 8, .drain_timeout_s = 10.0, .what = "test sync"};
    int rc = mpidp_paramsync_create(&cfg, &f->s);   /* ref = the values now */
    for (size_t k = 0; k < TOTAL; k++) f->data[k] = moved(rank_, k);
    return rc;
}

static int done(fixture_t *f)
{
    int rc = mpidp_paramsync_free(f->s);
    if (rc == MPIDP_OK) rc = mpidp_reqtable_destroy(f->reqs);
    return rc;
}

/* Each wire's worst rounding of one summed difference: size * half an ulp of
 * the largest difference (0.04), plus the fp32 arithmetic of the merge. */
static double tolerance(int wire)
{
    double u = wire == MPIDP_BF16 ? 0x1p-8 : wire == MPIDP_F16 ? 0x1p-11 : 0x1p-23;
    return size_ * 0.04 * u + 1e-6;
}

TEST(merge_matches_the_formula_for_every_wire)
{
    static const int wires[] = {MPIDP_F32, MPIDP_BF16, MPIDP_F16};
    for (int w = 0; w < 3; w++) {
        fixture_t f;
        ASSERT_OK(make(&f, wires[w]));
        ASSERT_EQ_INT(mpidp_paramsync_numel(f.s), TOTAL);
        ASSERT_EQ_INT(mpidp_paramsync_wire_bytes(f.s), TOTAL * mpidp_dtype_size(wires[w]));
        ASSERT_OK(mpidp_paramsync_send(f.s, 0));
        ASSERT_TRUE(mpidp_paramsync_pending(f.s));
        ASSERT_OK(mpidp_paramsync_wait(f.s, 10.0));
        const float a = 0.25f, b = 0.5f, c = 0.75f;
        ASSERT_OK(mpidp_paramsync_merge(f.s, a, b, c));
        for (size_t k = 0; k < TOTAL; k++) {
            double want = a * (double)moved(rank_, k) + b * sum_of_differences(k, wires[w]) +
                          c * (double)ref_value(k);
            ASSERT_NEAR(f.data[k], want, tolerance(wires[w]));
        }
        ASSERT_OK(done(&f));
    }
}

TEST(heat_weights_make_the_staleness_weighted_average)
{
    float a, b, c;
    ASSERT_OK(mpidp_paramsync_merge_weights(4, 0, &a, &b, &c));   /* plain average */
    ASSERT_NEAR(a, 0.0, 0.0);
    ASSERT_NEAR(b, 0.25, 0.0);
    ASSERT_NEAR(c, 1.0, 0.0);
    ASSERT_OK(mpidp_paramsync_merge_weights(2, 3, &a, &b, &c));   /* w = 6 */
    ASSERT_NEAR(a, 6.0 / 8, 1e-7);
    ASSERT_NEAR(b, 1.0 / 8, 1e-7);
    ASSERT_NEAR(c, 2.0 / 8, 1e-7);
    ASSERT_EQ_INT(mpidp_paramsync_merge_weights(0, 1, &a, &b, &c), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_paramsync_merge_weights(2, -1, &a, &b, &c), MPIDP_EINVAL);
    /* With batches_waited 0 every rank ends on the mean of the moved parameters. */
    fixture_t f;
    ASSERT_OK(make(&f, MPIDP_F32));
    ASSERT_OK(mpidp_paramsync_merge_weights(size_, 0, &a, &b, &c));
    ASSERT_OK(mpidp_paramsync_send(f.s, 0));
    int fin = 0;
    while (!fin) ASSERT_OK(mpidp_paramsync_test(f.s, &fin));
    ASSERT_OK(mpidp_paramsync_merge(f.s, a, b, c));
    for (size_t k = 0; k < TOTAL; k++) {
        double mean = 0.0;
        for (int r = 0; r < size_; r++) mean += moved(r, k);
        ASSERT_NEAR(f.data[k], mean / size_, 1e-6);
    }
    ASSERT_OK(done(&f));
}

TEST(grad_into_restore_and_zero_contributions)
{
    fixture_t f;
    ASSERT_OK(make(&f, MPIDP_BF16));
    /* Rank 0 answers with zeros (a finished node during join): only the others count. */
    ASSERT_OK(mpidp_paramsync_send(f.s, rank_ == 0));
    float grad_data[TOTAL];
    for (size_t k = 0; k < TOTAL; k++) grad_data[k] = NAN;   /* never read */
    float *g[NP] = {grad_data, grad_data + 5, grad_data + 5};
    ASSERT_OK(mpidp_paramsync_wait(f.s, 10.0));
    /* Gradients that do not match the parameters are refused, naming them,
     * and leave the received sum unread. */
    size_t short_numel[NP] = {5, 0, 36};
    ASSERT_EQ_INT(mpidp_paramsync_grad_into(f.s, NP - 1, g, NUMEL, 1.0f), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "grads: expected 3 tensors, got 2") != NULL);
    ASSERT_EQ_INT(mpidp_paramsync_grad_into(f.s, NP, g, short_numel, 1.0f), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "grads[2]: expected 37 elements, got 36") != NULL);
    ASSERT_OK(mpidp_paramsync_grad_into(f.s, NP, g, NUMEL, -1.0f / (float)size_));
    for (size_t k = 0; k < TOTAL; k++) {
        double s = sum_of_differences(k, MPIDP_BF16) - on_wire(moved(0, k) - ref_value(k), MPIDP_BF16);
        ASSERT_NEAR(grad_data[k], -s / size_, tolerance(MPIDP_BF16));
    }
    ASSERT_OK(mpidp_paramsync_restore(f.s));
    for (size_t k = 0; k < TOTAL; k++) ASSERT_NEAR(f.data[k], ref_value(k), 0.0);
    ASSERT_OK(done(&f));
}

TEST(state_rules)
{
    fixture_t f;
    ASSERT_OK(make(&f, MPIDP_F16));
    ASSERT_EQ_INT(mpidp_paramsync_merge(f.s, 1, 1, 1), MPIDP_ESTATE);      /* nothing received */
    ASSERT_OK(mpidp_paramsync_send(f.s, 0));
    ASSERT_EQ_INT(mpidp_paramsync_send(f.s, 0), MPIDP_ESTATE);             /* one in flight */
    ASSERT_EQ_INT(mpidp_paramsync_free(f.s), MPIDP_ESTATE);
    ASSERT_EQ_INT(mpidp_paramsync_restore(f.s), MPIDP_ESTATE);
    ASSERT_EQ_INT(mpidp_paramsync_merge(f.s, 1, 1, 1), MPIDP_ESTATE);      /* wait first */
    ASSERT_TRUE(strstr(mpidp_error_detail(), "wait first") != NULL);
    ASSERT_OK(mpidp_paramsync_wait(f.s, 10.0));
    ASSERT_OK(mpidp_paramsync_merge(f.s, 1, 0, 0));
    ASSERT_EQ_INT(mpidp_paramsync_merge(f.s, 1, 0, 0), MPIDP_ESTATE);      /* read once */
    /* set_reference, move a parameter, restore: back to ref */
    ASSERT_OK(mpidp_paramsync_set_reference(f.s));
    f.data[41] = 41.0f;
    ASSERT_OK(mpidp_paramsync_restore(f.s));
    ASSERT_NEAR(f.data[41], moved(rank_, 41), 0.0);
    ASSERT_OK(done(&f));
}

/* Dropping the engine with a sync in flight completes it first, so that
 * nothing is left posted into freed buffers. */
TEST(close_completes_the_sync_in_flight)
{
    fixture_t f;
    ASSERT_OK(make(&f, MPIDP_F32));
    ASSERT_OK(mpidp_paramsync_send(f.s, 0));
    ASSERT_EQ_INT(mpidp_paramsync_pending(f.s), 1);
    ASSERT_OK(mpidp_paramsync_close(f.s, 10.0));
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(f.reqs), 0);
    ASSERT_OK(mpidp_paramsync_close(NULL, 10.0));
    ASSERT_OK(mpidp_reqtable_destroy(f.reqs));
}

/* Fault-tolerant recovery ends every request of the table (here: they
 * complete); the sync they carried is then forgotten, never read, and the
 * engine sends again. */
TEST(abandon_forgets_a_sync_whose_requests_ended)
{
    fixture_t f;
    ASSERT_OK(make(&f, MPIDP_F32));
    ASSERT_OK(mpidp_paramsync_abandon(f.s));                               /* idle: a no-op */
    ASSERT_OK(mpidp_paramsync_send(f.s, 0));
    ASSERT_OK(mpidp_reqtable_wait_all(f.reqs, 10.0));
    ASSERT_EQ_INT(mpidp_paramsync_pending(f.s), 1);
    ASSERT_OK(mpidp_paramsync_abandon(f.s));
    ASSERT_EQ_INT(mpidp_paramsync_pending(f.s), 0);
    ASSERT_EQ_INT(mpidp_paramsync_merge(f.s, 1, 1, 1), MPIDP_ESTATE);      /* nothing to read */
    ASSERT_OK(mpidp_paramsync_restore(f.s));
    ASSERT_OK(mpidp_paramsync_send(f.s, 0));
    ASSERT_OK(mpidp_paramsync_wait(f.s, 10.0));
    ASSERT_OK(mpidp_paramsync_merge(f.s, 1, 0, 0));
    ASSERT_EQ_INT(mpidp_paramsync_abandon(NULL), MPIDP_EINVAL);
    ASSERT_OK(done(&f));
}

TEST(bad_configurations)
{
    mpidp_reqtable_t *reqs;
    ASSERT_OK(mpidp_reqtable_create(2, &reqs));
    float x[2] = {0};
    float *p[1] = {x};
    size_t n[1] = {2};
    mpidp_paramsync_config_t ok = {.comm = MPI_COMM_WORLD, .reqs = reqs, .n_params = 1,
                                   .params = p, .numel = n, .wire = MPIDP_F32, .chunk_elems = 4};
    mpidp_paramsync_config_t cfg;
    mpidp_paramsync_t *s = NULL;
    cfg = ok, cfg.wire = MPIDP_F64;
    ASSERT_EQ_INT(mpidp_paramsync_create(&cfg, &s), MPIDP_EINVAL);
    cfg = ok, cfg.chunk_elems = 0;
    ASSERT_EQ_INT(mpidp_paramsync_create(&cfg, &s), MPIDP_EINVAL);
    cfg = ok, cfg.reqs = NULL;
    ASSERT_EQ_INT(mpidp_paramsync_create(&cfg, &s), MPIDP_EINVAL);
    float *none[1] = {NULL};
    cfg = ok, cfg.params = none;
    ASSERT_EQ_INT(mpidp_paramsync_create(&cfg, &s), MPIDP_EINVAL);
    ASSERT_TRUE(s == NULL);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST_MAIN_MPI(merge_matches_the_formula_for_every_wire, heat_weights_make_the_staleness_weighted_average,
              grad_into_restore_and_zero_contributions, state_rules,
              close_completes_the_sync_in_flight, abandon_forgets_a_sync_whose_requests_ended,
              bad_configurations)
