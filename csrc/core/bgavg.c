/* Background model averaging (see mpidp/bgavg.h). */
#include "mpidp/bgavg.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpi_util.h"
#include "post.h"
#include "mpidp/ft.h"
#include "mpidp/mpiops.h"
#include "mpidp/reqtable.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "fail.h"

#define DETAIL_LEN 1024

struct mpidp_bgavg {
    MPI_Comm comm;             /* the thread's own duplicate */
    int size, rank;
    mpidp_reqtable_t *reqs;    /* the thread's own request table */
    float **segs;
    size_t *lens;
    size_t n_segs, total;
    float *snapshot, *sum;     /* total elements each */
    int *agreed;               /* fault-tolerant mode: each round's agreement (kept with them) */
    double interval_s, timeout_s;
    int abort_on_timeout;
    char what[64];

    pthread_mutex_t weights;   /* the weight lock */
    atomic_int thread_waiting; /* the thread wants the weight lock: training lets it have it */
    pthread_mutex_t mu;        /* guards the fields below */
    pthread_cond_t wake;       /* stop requested: cut the pause short */
    int stop_requested;
    int running;               /* the thread was started and not joined */
    int status;                /* how the thread ended (MPIDP_OK while it runs) */
    char detail[DETAIL_LEN];
    int leak_buffers;          /* a timed-out request may still write into them */
    pthread_t thread;
    _Atomic int64_t rounds;
};

/* Waits for one request of the thread's table, polling every 200 us: the
 * thread is in no hurry, and spinning would take a core from training. */
static int wait_gently(mpidp_bgavg_t *x, mpidp_req_t h, int64_t round, const char *stage)
{
    double start = mpidp_now();
    for (;;) {
        int done = 0;
        int rc = mpidp_reqtable_test(x->reqs, h, &done);
        if (rc != MPIDP_OK || done) return rc;
        double waited = mpidp_now() - start;
        if (x->timeout_s > 0 && waited > x->timeout_s)
            return mpidp__fail(MPIDP_ETIMEDOUT, "%s: background averaging round %lld (%s) made no "
                               "progress for %.1f s (MPIDP_TIMEOUT): a rank is stuck (holding its "
                               "weight lock: a forward without an optimizer step?), dead, or no "
                               "longer averaging", x->what, (long long)round, stage, waited);
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
}

/* An allreduce of `count` floats in place, waited for with the deadline. */
static int allreduce(mpidp_bgavg_t *x, float *buf, size_t count, int op, int64_t round,
                     const char *stage)
{
    mpidp_req_t h;
    int rc = mpidp__post_iallreduce(x->comm, x->reqs, buf, count, op, MPIDP_F32, stage, &h);
    if (rc != MPIDP_OK) return rc;
    return wait_gently(x, h, round, stage);
}

/* Fault-tolerant mode, at the end of every round, whatever happened in it:
 * 1 when every live rank agrees that its part of the round went well
 * (mine_ok), so that it may be applied; 0 otherwise, on every live rank
 * alike. Waited for with the deadline (a live rank stuck elsewhere). */
static int round_agreed(mpidp_bgavg_t *x, int64_t round, int mine_ok, int *rc)
{
    const char *what = "agreeing that every rank's round went well";
    mpidp_req_t slot, h;
    *rc = mpidp_reqtable_claim(x->reqs, what, &slot);
    if (*rc != MPIDP_OK) return 0;
    MPI_Request req;
    *x->agreed = mine_ok;
    int mrc = mpidp_ft_post_agree(x->comm, x->agreed, &req);
    *rc = mpidp__post_done(x->reqs, slot, mrc, req, x->comm, what, &h);
    if (*rc == MPIDP_OK) *rc = wait_gently(x, h, round, what);
    if (*rc == MPIDP_EPEERFAILED) *rc = MPIDP_OK;   /* a failure is a "no", the same everywhere */
    return *rc == MPIDP_OK && *x->agreed;
}

/* Every rank carries on unless one asked to stop: 1 to go on, 0 to stop. */
static int negotiate(mpidp_bgavg_t *x, int64_t round, int *go_on)
{
    pthread_mutex_lock(&x->mu);
    float flag = x->stop_requested ? 0.0f : 1.0f;
    pthread_mutex_unlock(&x->mu);
    int rc = allreduce(x, &flag, 1, MPIDP_OP_MIN, round, "negotiating whether to go on");
    *go_on = flag > 0.5f;
    return rc;
}

/* The thread's side of the weight lock. A training loop re-takes the lock
 * right after releasing it, and mutexes are not fair: without the flag the
 * thread could wait for many steps. */
static void lock_for_thread(mpidp_bgavg_t *x)
{
    atomic_store(&x->thread_waiting, 1);
    pthread_mutex_lock(&x->weights);
    atomic_store(&x->thread_waiting, 0);
}

/* A round's first half: the snapshot s, and S = the sum of the ranks'. */
static int sum_weights(mpidp_bgavg_t *x, int64_t round)
{
    lock_for_thread(x);
    size_t off = 0;
    for (size_t i = 0; i < x->n_segs; off += x->lens[i], i++)
        memcpy(x->snapshot + off, x->segs[i], x->lens[i] * sizeof(float));
    pthread_mutex_unlock(&x->weights);

    memcpy(x->sum, x->snapshot, x->total * sizeof(float));
    return allreduce(x, x->sum, x->total, MPIDP_OP_SUM, round, "summing the weights");
}

/* Its second half, once S is every rank's. */
static void apply_average(mpidp_bgavg_t *x)
{
    /* x <- (x - s) + S/n: with nothing changed since the snapshot, x - s is
     * exactly 0 and every rank gets exactly S/n. */
    const float inv_n = 1.0f / (float)x->size;
    lock_for_thread(x);
    size_t off = 0;
    for (size_t i = 0; i < x->n_segs; off += x->lens[i], i++) {
        float *w = x->segs[i];
        const float *s = x->snapshot + off, *S = x->sum + off;
        for (size_t j = 0; j < x->lens[i]; j++) w[j] = (w[j] - s[j]) + S[j] * inv_n;
    }
    pthread_mutex_unlock(&x->weights);
}

/* Pauses for the interval, or less when a stop is requested. */
static void pause_between_rounds(mpidp_bgavg_t *x)
{
    if (x->interval_s <= 0) return;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    double end = (double)until.tv_sec + until.tv_nsec * 1e-9 + x->interval_s;
    until.tv_sec = (time_t)end;
    until.tv_nsec = (long)((end - (double)until.tv_sec) * 1e9);
    pthread_mutex_lock(&x->mu);
    while (!x->stop_requested)
        if (pthread_cond_timedwait(&x->wake, &x->mu, &until) == ETIMEDOUT) break;
    pthread_mutex_unlock(&x->mu);
}

static void *thread_main(void *arg)
{
    mpidp_bgavg_t *x = arg;
    int rc = MPIDP_OK;
    for (int64_t round = 0;; round++) {
        int go_on = 0;
        rc = negotiate(x, round, &go_on);
        if (rc == MPIDP_OK && go_on) rc = sum_weights(x, round);
        /* Fault-tolerant mode: a rank may die with the sum reaching some
         * ranks and not others, so a round is applied only once every live
         * rank agrees that its own went well: none applies it otherwise, and
         * every thread ends with the loss, at the same round. (Every path of
         * a round comes here, so no live rank's agreement waits for one
         * that left.) */
        if (mpidp_ft_running() && !mpidp_left_in_flight(rc)) {
            int arc = MPIDP_OK;
            if (!round_agreed(x, round, rc == MPIDP_OK, &arc) && rc == MPIDP_OK)
                rc = arc != MPIDP_OK ? arc : mpidp__fail(
                    MPIDP_EPEERFAILED, "%s: background averaging round %lld: a rank failed, and "
                    "no rank applied the round", x->what, (long long)round);
        }
        if (rc != MPIDP_OK || !go_on) break;
        apply_average(x);
        atomic_fetch_add(&x->rounds, 1);
        pause_between_rounds(x);
    }
    if (mpidp_left_in_flight(rc) && x->abort_on_timeout) {
        /* The stalled rank cannot be waited for, and the training threads
         * would only find out at their next lock: end the job now, loudly. */
        fprintf(stderr, "mpidp: rank %d: %s\nmpidp: aborting the job (set MPIDP_ON_TIMEOUT=raise "
                        "to raise mpidp.CommTimeout in training instead)\n",
                x->rank, mpidp_error_detail());
        fflush(stderr);
        mpidp_abort_job(3);
    }
    pthread_mutex_lock(&x->mu);
    x->status = rc;
    if (rc != MPIDP_OK) snprintf(x->detail, sizeof x->detail, "%s", mpidp_error_detail());
    if (mpidp_left_in_flight(rc)) x->leak_buffers = 1;
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

static void free_all(mpidp_bgavg_t *x)
{
    if (!x->leak_buffers) {
        if (x->reqs) mpidp_reqtable_destroy(x->reqs);
        free(x->snapshot);
        free(x->sum);
        free(x->agreed);
    }
    if (x->comm != MPI_COMM_NULL) {
        mpidp_ft_untrack(x->comm);
        MPI_Comm_free(&x->comm);
    }
    free(x->segs);
    free(x->lens);
    pthread_mutex_destroy(&x->weights);
    pthread_mutex_destroy(&x->mu);
    pthread_cond_destroy(&x->wake);
    free(x);
}

static int check_opts(const mpidp_bgavg_opts_t *o)
{
    if (o == NULL) return mpidp__fail(MPIDP_EINVAL, "background averaging: NULL options");
    const char *what = o->what ? o->what : "background averaging";
    if (o->n_segs == 0 || o->segs == NULL || o->lens == NULL)
        return mpidp__fail(MPIDP_EINVAL, "%s: no weights to average", what);
    for (size_t i = 0; i < o->n_segs; i++)
        if (o->segs[i] == NULL && o->lens[i] > 0)
            return mpidp__fail(MPIDP_EINVAL, "%s: weight array %zu is NULL", what, i);
    if (!(o->interval_s >= 0) || o->interval_s > 1e6)
        return mpidp__fail(MPIDP_EINVAL, "%s: interval %g s, expected 0 .. 1e6", what,
                           o->interval_s);
    return MPIDP_OK;
}

int mpidp_bgavg_start(MPI_Comm comm, const mpidp_bgavg_opts_t *opts, mpidp_bgavg_t **out)
{
    if (out == NULL) return mpidp__fail(MPIDP_EINVAL, "background averaging: NULL out");
    *out = NULL;
    int rc = check_opts(opts);
    if (rc != MPIDP_OK) return rc;
    const char *what = opts->what ? opts->what : "background averaging";
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    if (level != MPI_THREAD_MULTIPLE)
        return mpidp__fail(MPIDP_ESTATE, "%s: MPI was initialized without MPI_THREAD_MULTIPLE "
                           "(level %d), which a background thread needs; initialize MPI with "
                           "it (mpi4py does unless mpi4py.rc.thread_level is changed)", what,
                           level);
    mpidp_bgavg_t *x = calloc(1, sizeof *x);
    if (x == NULL) return mpidp__fail(MPIDP_ENOMEM, "%s: out of memory", what);
    x->comm = MPI_COMM_NULL;
    pthread_mutex_init(&x->weights, NULL);
    pthread_mutex_init(&x->mu, NULL);
    pthread_cond_init(&x->wake, NULL);
    snprintf(x->what, sizeof x->what, "%s", what);
    x->interval_s = opts->interval_s;
    x->timeout_s = opts->timeout_s;
    x->abort_on_timeout = opts->abort_on_timeout;
    x->n_segs = opts->n_segs;
    x->segs = malloc(x->n_segs * sizeof *x->segs);
    x->lens = malloc(x->n_segs * sizeof *x->lens);
    if (x->segs == NULL || x->lens == NULL) goto nomem;
    for (size_t i = 0; i < x->n_segs; i++) {
        x->segs[i] = opts->segs[i];
        x->lens[i] = opts->lens[i];
        x->total += opts->lens[i];
    }
    x->snapshot = malloc((x->total ? x->total : 1) * sizeof(float));
    x->sum = malloc((x->total ? x->total : 1) * sizeof(float));
    x->agreed = malloc(sizeof *x->agreed);
    if (x->snapshot == NULL || x->sum == NULL || x->agreed == NULL) goto nomem;
    rc = mpidp_reqtable_create(4, &x->reqs);
    if (rc != MPIDP_OK) goto fail;
    int mrc = MPI_Comm_dup(comm, &x->comm);
    if (mrc != MPI_SUCCESS) {
        x->comm = MPI_COMM_NULL;
        rc = mpidp__mpi_fail(mrc, "%s: MPI_Comm_dup", what);
        goto fail;
    }
    MPI_Comm_set_errhandler(x->comm, MPI_ERRORS_RETURN);
    mpidp_ft_track(x->comm);     /* revoked with the others when a rank goes to recovery */
    MPI_Comm_size(x->comm, &x->size);
    MPI_Comm_rank(x->comm, &x->rank);
    if (pthread_create(&x->thread, NULL, thread_main, x) != 0) {
        rc = mpidp__fail(MPIDP_ENOMEM, "%s: cannot start the thread", what);
        goto fail;
    }
    x->running = 1;
    *out = x;
    return MPIDP_OK;
nomem:
    rc = mpidp__fail(MPIDP_ENOMEM, "%s: out of memory for %zu weights", what, x->total);
fail:
    free_all(x);
    return rc;
}

void mpidp_bgavg_lock(mpidp_bgavg_t *x)
{
    pthread_mutex_lock(&x->weights);
    while (atomic_load(&x->thread_waiting)) {   /* let the thread copy or update first */
        pthread_mutex_unlock(&x->weights);
        sched_yield();
        pthread_mutex_lock(&x->weights);
    }
}

void mpidp_bgavg_unlock(mpidp_bgavg_t *x)
{
    pthread_mutex_unlock(&x->weights);
}

int mpidp_bgavg_stop(mpidp_bgavg_t *x)
{
    if (x == NULL) return mpidp__fail(MPIDP_EINVAL, "background averaging: NULL averager");
    pthread_mutex_lock(&x->mu);
    x->stop_requested = 1;
    pthread_cond_broadcast(&x->wake);
    int running = x->running;
    x->running = 0;
    pthread_mutex_unlock(&x->mu);
    if (running) pthread_join(x->thread, NULL);
    return mpidp_bgavg_status(x);
}

int64_t mpidp_bgavg_rounds(mpidp_bgavg_t *x)
{
    return atomic_load(&x->rounds);
}

int mpidp_bgavg_status(mpidp_bgavg_t *x)
{
    pthread_mutex_lock(&x->mu);
    int rc = x->status;
    if (rc != MPIDP_OK) mpidp__fail(rc, "%s", x->detail);
    pthread_mutex_unlock(&x->mu);
    return rc;
}

int mpidp_bgavg_free(mpidp_bgavg_t *x)
{
    if (x == NULL) return MPIDP_OK;
    pthread_mutex_lock(&x->mu);
    int running = x->running;
    pthread_mutex_unlock(&x->mu);
    if (running)
        return mpidp__fail(MPIDP_ESTATE, "%s: stop the background thread before freeing it",
                           x->what);
    free_all(x);
    return MPIDP_OK;
}
