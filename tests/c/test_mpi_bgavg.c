/* Background model averaging across real ranks (2, 3 and 4), by invariants
 * that need no timing: rounds with nothing changing the weights give every
 * rank the mean of the ranks' weights; while the main thread keeps updating
 * its weights under the lock, the sum over the ranks of the weights is the
 * sum of the starting weights plus every update (averaging moves weight
 * between ranks, never creates or loses it); every rank's thread stops at
 * the same round; bad options are refused. */
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpidp/bgavg.h"
#include "mpidp/mpiops.h"
#include "mpidp/status.h"
#include "test.h"

#define LEN_A 1000
#define LEN_B 37

static int rank_, size_;

static void world(void)
{
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    mpidp_mpiops_init();
}

/* Rank r's starting weight i: different on every rank. */
static float start_value(int r, size_t i)
{
    return (float)(0.25 * r - 0.5) + (float)((i * 7 + (size_t)r * 13) % 17) * 0.125f;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void wait_for_rounds(mpidp_bgavg_t *x, int64_t n)
{
    while (mpidp_bgavg_rounds(x) < n) sleep_ms(1);
}

typedef struct {
    float a[LEN_A], b[LEN_B];
    float *segs[2];
    size_t lens[2];
} weights_t;

static void weights_init(weights_t *w)
{
    for (size_t i = 0; i < LEN_A; i++) w->a[i] = start_value(rank_, i);
    for (size_t i = 0; i < LEN_B; i++) w->b[i] = start_value(rank_, LEN_A + i);
    w->segs[0] = w->a;
    w->segs[1] = w->b;
    w->lens[0] = LEN_A;
    w->lens[1] = LEN_B;
}

static mpidp_bgavg_opts_t opts_of(weights_t *w, double interval_s)
{
    return (mpidp_bgavg_opts_t){.segs = w->segs, .lens = w->lens, .n_segs = 2,
                                .interval_s = interval_s, .timeout_s = 60,
                                .abort_on_timeout = 0, .what = "test averager"};
}

/* A running averager of this rank's starting weights in *w (NULL on failure). */
static mpidp_bgavg_t *started(weights_t *w, double interval_s)
{
    world();
    weights_init(w);
    mpidp_bgavg_opts_t o = opts_of(w, interval_s);
    mpidp_bgavg_t *x = NULL;
    return mpidp_bgavg_start(MPI_COMM_WORLD, &o, &x) == MPIDP_OK ? x : NULL;
}

static int rounds_agree(mpidp_bgavg_t *x)
{
    long long mine = (long long)mpidp_bgavg_rounds(x), lo = 0, hi = 0;
    MPI_Allreduce(&mine, &lo, 1, MPI_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&mine, &hi, 1, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
    return lo == hi;
}

TEST(rounds_without_updates_give_every_rank_the_mean)
{
    static weights_t w;
    mpidp_bgavg_t *x = started(&w, 0.0);
    ASSERT_TRUE(x != NULL);
    wait_for_rounds(x, 3);
    ASSERT_OK(mpidp_bgavg_stop(x));
    ASSERT_TRUE(rounds_agree(x));
    for (size_t i = 0; i < LEN_A + LEN_B; i++) {
        double mean = 0;
        for (int r = 0; r < size_; r++) mean += start_value(r, i);
        mean /= size_;
        float got = i < LEN_A ? w.a[i] : w.b[i - LEN_A];
        ASSERT_NEAR(got, mean, 1e-5 * (1 + fabs(mean)));
    }
    ASSERT_OK(mpidp_bgavg_free(x));
}

/* Rank r's update of weight i at step t. */
static float update(int r, int t, size_t i)
{
    return (float)(((size_t)t * 5 + i * 3 + (size_t)r) % 11) * 0.01f - 0.05f;
}

TEST(the_sum_over_ranks_is_kept_while_the_weights_are_updated)
{
    static weights_t w;
    static double applied[LEN_A + LEN_B];
    memset(applied, 0, sizeof applied);
    mpidp_bgavg_t *x = started(&w, 0.001);
    ASSERT_TRUE(x != NULL);
    /* Update until this rank's thread has averaged a few times meanwhile;
     * ranks take different numbers of steps, as training ranks do. */
    for (int t = 0; t < 50 || mpidp_bgavg_rounds(x) < 5; t++) {
        mpidp_bgavg_lock(x);
        for (size_t i = 0; i < LEN_A + LEN_B; i++) {
            float *p = i < LEN_A ? &w.a[i] : &w.b[i - LEN_A];
            float before = *p;
            *p += update(rank_, t, i);
            applied[i] += (double)*p - (double)before;   /* what float addition made of it */
        }
        mpidp_bgavg_unlock(x);
    }
    ASSERT_OK(mpidp_bgavg_stop(x));
    ASSERT_TRUE(rounds_agree(x));
    ASSERT_TRUE(mpidp_bgavg_rounds(x) >= 5);
    static double got[LEN_A + LEN_B], want[LEN_A + LEN_B];
    for (size_t i = 0; i < LEN_A + LEN_B; i++) {
        got[i] = i < LEN_A ? w.a[i] : w.b[i - LEN_A];
        want[i] = start_value(rank_, i) + applied[i];
    }
    MPI_Allreduce(MPI_IN_PLACE, got, LEN_A + LEN_B, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, want, LEN_A + LEN_B, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    for (size_t i = 0; i < LEN_A + LEN_B; i++)
        ASSERT_NEAR(got[i], want[i], 1e-4 * (1 + fabs(want[i])));
    ASSERT_OK(mpidp_bgavg_free(x));
}

TEST(one_rank_stopping_stops_every_rank_at_the_same_round)
{
    static weights_t w;
    mpidp_bgavg_t *x = started(&w, 0.0);
    ASSERT_TRUE(x != NULL);
    wait_for_rounds(x, 1);
    if (rank_ != 0) sleep_ms(50);      /* rank 0 asks first; the others' threads follow it */
    ASSERT_OK(mpidp_bgavg_stop(x));
    ASSERT_TRUE(rounds_agree(x));
    ASSERT_OK(mpidp_bgavg_free(x));
}

TEST(a_running_averager_is_not_freed)
{
    static weights_t w;
    mpidp_bgavg_t *x = started(&w, 0.0);
    ASSERT_TRUE(x != NULL);
    ASSERT_EQ_INT(mpidp_bgavg_free(x), MPIDP_ESTATE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "stop the background thread") != NULL);
    ASSERT_OK(mpidp_bgavg_stop(x));
    ASSERT_OK(mpidp_bgavg_stop(x));    /* a second stop is harmless */
    ASSERT_OK(mpidp_bgavg_free(x));
}

TEST(bad_options_are_refused_before_anything_starts)
{
    world();
    static weights_t w;
    weights_init(&w);
    mpidp_bgavg_t *x = NULL;
    mpidp_bgavg_opts_t o = opts_of(&w, 0.0);
    o.n_segs = 0;
    ASSERT_EQ_INT(mpidp_bgavg_start(MPI_COMM_WORLD, &o, &x), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "no weights") != NULL);
    o = opts_of(&w, -1.0);
    ASSERT_EQ_INT(mpidp_bgavg_start(MPI_COMM_WORLD, &o, &x), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "interval") != NULL);
    o = opts_of(&w, 0.0);
    float *null_seg[2] = {NULL, w.b};
    o.segs = null_seg;
    ASSERT_EQ_INT(mpidp_bgavg_start(MPI_COMM_WORLD, &o, &x), MPIDP_EINVAL);
    ASSERT_TRUE(x == NULL);
}

TEST_MAIN_MPI_THREADS(rounds_without_updates_give_every_rank_the_mean,
                      the_sum_over_ranks_is_kept_while_the_weights_are_updated,
                      one_rank_stopping_stops_every_rank_at_the_same_round,
                      a_running_averager_is_not_freed,
                      bad_options_are_refused_before_anything_starts)
