/* The in-flight request table (see mpidp/reqtable.h). */
#include "mpidp/reqtable.h"

#include "mpidp/ft.h"

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpidp/departures.h"
#include "mpi_util.h"
#include "mpidp/status.h"
#include "fail.h"
#include "reqtable_internal.h"
#include "departures_internal.h"

typedef struct {
    MPI_Request req;
    MPI_Comm comm;   /* whose ranks it waits for (mpidp/departures.h) */
    uint32_t gen;
    int live;        /* a posted request is tracked here */
    uint32_t pos;    /* live: where live_idx names this slot */
    int claimed;     /* reserved for a request about to be posted */
    double posted_at;
    int *source;     /* NULL, or where completion writes the sender's rank */
    char what[MPIDP_REQ_WHAT_LEN];
} slot_t;

struct mpidp_reqtable {
    pthread_mutex_t lock;
    size_t capacity;
    size_t n_live;
    size_t n_claimed;
    size_t hint;      /* where to start looking for a free slot */
    uint32_t next_gen;
    slot_t *slots;
    /* live_idx[0..n_live): the live slots, so that progress, which the
     * gradient hooks call once per parameter, costs what is in flight and
     * not the table's capacity. */
    uint32_t *live_idx;
    double spin_s;    /* mpidp_reqtable_set_spin */
    size_t n_engines;
    struct {
        mpidp_reqtable_engine_fn fn;
        void *ctx;
    } engines[MPIDP_REQTABLE_ENGINES];
};

int mpidp_reqtable_engine_add(mpidp_reqtable_t *t, mpidp_reqtable_engine_fn fn, void *ctx)
{
    if (t == NULL || fn == NULL) return mpidp__fail(MPIDP_EINVAL, "request table: NULL argument");
    pthread_mutex_lock(&t->lock);
    int full = t->n_engines == MPIDP_REQTABLE_ENGINES;
    if (!full) {
        t->engines[t->n_engines].fn = fn;
        t->engines[t->n_engines].ctx = ctx;
        t->n_engines++;
    }
    pthread_mutex_unlock(&t->lock);
    if (full)
        return mpidp__fail(MPIDP_EFULL, "request table: %d multi-stage operations in flight at once",
                           MPIDP_REQTABLE_ENGINES);
    return MPIDP_OK;
}

void mpidp_reqtable_engine_remove(mpidp_reqtable_t *t, void *ctx)
{
    if (t == NULL) return;
    pthread_mutex_lock(&t->lock);
    for (size_t i = 0; i < t->n_engines; i++)
        if (t->engines[i].ctx == ctx) {
            t->engines[i] = t->engines[--t->n_engines];
            break;
        }
    pthread_mutex_unlock(&t->lock);
}

/* 1 when `ctx` is still registered (an engine's progress may free another's
 * operation: the reducer frees a bucket's quantized allreduce). Lock held. */
static int engine_live_locked(const mpidp_reqtable_t *t, void *ctx)
{
    for (size_t i = 0; i < t->n_engines; i++)
        if (t->engines[i].ctx == ctx) return 1;
    return 0;
}

/* Runs the engines' progress functions from a snapshot, each under the
 * (recursive) lock and only if still registered when its turn comes: an
 * engine may remove others, and a removal on another thread (its owner
 * freeing it) waits for the lock, so it cannot race with the call. */
static void run_engines(mpidp_reqtable_t *t)
{
    if (t->n_engines == 0) return; /* unlocked peek: a stale answer costs one round */
    size_t n;
    struct { mpidp_reqtable_engine_fn fn; void *ctx; } snap[MPIDP_REQTABLE_ENGINES];
    pthread_mutex_lock(&t->lock);
    n = t->n_engines;
    for (size_t i = 0; i < n; i++) snap[i].fn = t->engines[i].fn, snap[i].ctx = t->engines[i].ctx;
    pthread_mutex_unlock(&t->lock);
    for (size_t i = 0; i < n; i++) {
        pthread_mutex_lock(&t->lock);
        if (engine_live_locked(t, snap[i].ctx)) snap[i].fn(snap[i].ctx);
        pthread_mutex_unlock(&t->lock);
    }
}

int mpidp_reqtable_create(size_t capacity, mpidp_reqtable_t **out)
{
    if (out == NULL || capacity == 0 || capacity > UINT32_MAX)
        return mpidp__fail(MPIDP_EINVAL, "request table: capacity must be in 1..2^32-1");
    mpidp_reqtable_t *t = calloc(1, sizeof *t);
    slot_t *slots = calloc(capacity, sizeof *slots);
    uint32_t *live_idx = calloc(capacity, sizeof *live_idx);
    if (t == NULL || slots == NULL || live_idx == NULL) {
        free(t);
        free(slots);
        free(live_idx);
        return mpidp__fail(MPIDP_ENOMEM, "request table of %zu slots", capacity);
    }
    /* Recursive: engines run under it and post through it (run_engines). */
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&t->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    t->capacity = capacity;
    t->slots = slots;
    t->live_idx = live_idx;
    t->next_gen = 1;
    int mpi_up = 0;
    MPI_Initialized(&mpi_up);
    t->spin_s = mpi_up && !mpidp_mpi_finalized() && mpidp__mpi_yields_when_idle()
                    ? MPIDP_SPIN_SHARED_CORES_SECONDS
                    : MPIDP_SPIN_SECONDS;
    *out = t;
    return MPIDP_OK;
}

int mpidp_reqtable_destroy(mpidp_reqtable_t *t)
{
    if (t == NULL) return MPIDP_OK;
    pthread_mutex_lock(&t->lock);
    size_t live = t->n_live + t->n_claimed;
    pthread_mutex_unlock(&t->lock);
    if (live != 0)
        return mpidp__fail(MPIDP_ESTATE, "request table still has %zu requests in flight", live);
    pthread_mutex_destroy(&t->lock);
    free(t->slots);
    free(t->live_idx);
    free(t);
    return MPIDP_OK;
}

int mpidp_reqtable_claim(mpidp_reqtable_t *t, const char *what, mpidp_req_t *out)
{
    if (t == NULL || out == NULL) return mpidp__fail(MPIDP_EINVAL, "request table: NULL argument");
    pthread_mutex_lock(&t->lock);
    if (t->n_live + t->n_claimed == t->capacity) {
        pthread_mutex_unlock(&t->lock);
        return mpidp__fail(MPIDP_EFULL, "%zu requests already in flight, so %s was not posted; "
                           "wait for some of them first", t->capacity, what ? what : "a request");
    }
    size_t i = t->hint;
    while (t->slots[i].live || t->slots[i].claimed) i = (i + 1) % t->capacity;
    slot_t *s = &t->slots[i];
    s->claimed = 1;
    s->source = NULL;
    s->gen = t->next_gen++;
    if (t->next_gen == 0) t->next_gen = 1; /* 0 is reserved for "none" */
    t->n_claimed++;
    t->hint = (i + 1) % t->capacity;
    out->slot = (uint32_t)i;
    out->gen = s->gen;
    pthread_mutex_unlock(&t->lock);
    return MPIDP_OK;
}

/* The claimed slot `h` names, or NULL (a programming error inside mpidp). */
static slot_t *claimed_slot(mpidp_reqtable_t *t, mpidp_req_t h)
{
    if (t == NULL || h.slot >= t->capacity) return NULL;
    slot_t *s = &t->slots[h.slot];
    return s->claimed && s->gen == h.gen ? s : NULL;
}

void mpidp_reqtable_fill(mpidp_reqtable_t *t, mpidp_req_t h, MPI_Request req, MPI_Comm comm,
                         const char *what)
{
    if (t == NULL) return;
    pthread_mutex_lock(&t->lock);
    slot_t *s = claimed_slot(t, h);
    if (s != NULL) {
        s->claimed = 0;
        s->live = 1;
        s->pos = (uint32_t)t->n_live;
        t->live_idx[t->n_live] = h.slot;
        s->req = req;
        s->comm = comm;
        s->posted_at = mpidp_now();
        snprintf(s->what, sizeof s->what, "%s", what ? what : "request");
        t->n_claimed--;
        t->n_live++;
    }
    pthread_mutex_unlock(&t->lock);
}

void mpidp_reqtable_set_source(mpidp_reqtable_t *t, mpidp_req_t h, int *source)
{
    if (t == NULL) return;
    pthread_mutex_lock(&t->lock);
    slot_t *s = claimed_slot(t, h);
    if (s != NULL) s->source = source;
    pthread_mutex_unlock(&t->lock);
}

void mpidp_reqtable_unclaim(mpidp_reqtable_t *t, mpidp_req_t h)
{
    if (t == NULL) return;
    pthread_mutex_lock(&t->lock);
    slot_t *s = claimed_slot(t, h);
    if (s != NULL) {
        s->claimed = 0;
        t->n_claimed--;
    }
    pthread_mutex_unlock(&t->lock);
}

/* Tests slot `s` under the lock. Returns the MPI error code (MPI_SUCCESS when
 * fine) and sets *done; a completed or failed request frees its slot. */
static int test_slot_locked(mpidp_reqtable_t *t, slot_t *s, int *done, char *what_out)
{
    MPI_Status st;
    int flag = 0;
    int rc = MPI_Test(&s->req, &flag, &st);
    if (rc != MPI_SUCCESS) rc = mpidp_ft_classify(rc, s->comm);
    if (rc != MPI_SUCCESS || flag) {
        if (what_out) memcpy(what_out, s->what, MPIDP_REQ_WHAT_LEN);
        if (rc == MPI_SUCCESS && s->source != NULL) *s->source = st.MPI_SOURCE;
        /* The last live slot takes this one's place in live_idx. */
        uint32_t last = t->live_idx[--t->n_live];
        t->live_idx[s->pos] = last;
        t->slots[last].pos = s->pos;
        s->live = 0;
        *done = 1;
        return rc;
    }
    *done = 0;
    return MPI_SUCCESS;
}


int mpidp_reqtable_test(mpidp_reqtable_t *t, mpidp_req_t h, int *done)
{
    if (t == NULL || done == NULL) return mpidp__fail(MPIDP_EINVAL, "request table: NULL argument");
    if (h.gen == 0 || h.slot >= t->capacity) {
        *done = 1;
        return MPIDP_OK;
    }
    char what[MPIDP_REQ_WHAT_LEN];
    pthread_mutex_lock(&t->lock);
    slot_t *s = &t->slots[h.slot];
    int rc = MPI_SUCCESS;
    if (!s->live || s->gen != h.gen)
        *done = 1;
    else
        rc = test_slot_locked(t, s, done, what);
    pthread_mutex_unlock(&t->lock);
    return rc == MPI_SUCCESS ? MPIDP_OK : mpidp__mpi_fail(rc, "%s failed", what);
}

void mpidp_reqtable_set_spin(mpidp_reqtable_t *t, double seconds)
{
    if (t == NULL) return;
    pthread_mutex_lock(&t->lock);
    t->spin_s = seconds > 0 ? seconds : 0; /* NaN too reads as 0 */
    pthread_mutex_unlock(&t->lock);
}

double mpidp_reqtable_spin(mpidp_reqtable_t *t)
{
    if (t == NULL) return MPIDP_SPIN_SECONDS;
    pthread_mutex_lock(&t->lock);
    double s = t->spin_s;
    pthread_mutex_unlock(&t->lock);
    return s;
}

/* Back-off while waiting. Open MPI advances a non-blocking collective only
 * inside MPI calls, so a collective needs MPI_Test called continuously: spin,
 * yielding the core between tests (other ranks may share it), then, once the
 * wait has lasted `spin` seconds, sleep 100 us between tests so that a slow or
 * stuck peer does not cost a core or starve this rank's other threads. A wait
 * that long is for a slow peer or a large transfer, next to which 100 us of
 * extra latency at completion is small. */
mpidp__wait_step_t mpidp__wait_step(unsigned long iteration, double waited, double spin)
{
    if (iteration < 64) return MPIDP__WAIT_TEST;
    return waited < spin ? MPIDP__WAIT_YIELD : MPIDP__WAIT_SLEEP;
}

static void backoff(unsigned long iteration, double waited, double spin)
{
    switch (mpidp__wait_step(iteration, waited, spin)) {
    case MPIDP__WAIT_TEST: return;
    case MPIDP__WAIT_YIELD: sched_yield(); return;
    case MPIDP__WAIT_SLEEP: {
        struct timespec ts = {0, 100000}; /* 100 us */
        nanosleep(&ts, NULL);
        return;
    }
    }
}

static int timed_out(mpidp_reqtable_t *t, double timeout_s)
{
    char pending[1024];
    mpidp_reqtable_describe(t, pending, sizeof pending);
    /* A collective does not report which peers have joined it, so the
     * missing rank cannot be named here. */
    return mpidp__fail(MPIDP_ETIMEDOUT, "no progress for %.1f s (the timeout set by MPIDP_TIMEOUT, "
                       "or a torch.distributed group's where shorter; MPI cannot tell which rank "
                       "has not joined: look for one stuck elsewhere or gone); pending: %s",
                       timeout_s, pending);
}

/* MPIDP_EDEPARTED when a live request of `t` (only `h` unless it names
 * none) waits on a communicator holding a rank that has ended its program
 * (mpidp/departures.h); MPIDP_OK otherwise. */
static int departed(mpidp_reqtable_t *t, mpidp_req_t h, double start)
{
    double now = mpidp_now();
    int rc = MPIDP_OK;
    pthread_mutex_lock(&t->lock);
    for (size_t k = 0; k < t->n_live && rc == MPIDP_OK; k++) {
        slot_t *s = &t->slots[t->live_idx[k]];
        if (h.gen == 0 || (t->live_idx[k] == h.slot && s->gen == h.gen))
            rc = mpidp__departures_check(s->comm, start, now, s->what);
    }
    pthread_mutex_unlock(&t->lock);
    return rc;
}

int mpidp_reqtable_wait(mpidp_reqtable_t *t, mpidp_req_t h, double timeout_s)
{
    double start = mpidp_now(), spin = mpidp_reqtable_spin(t);
    for (unsigned long it = 0;; it++) {
        int done = 0;
        int rc = mpidp_reqtable_test(t, h, &done);
        if (rc != MPIDP_OK || done) return rc;
        run_engines(t);
        double waited = mpidp_now() - start;
        if (timeout_s > 0 && waited > timeout_s) return timed_out(t, timeout_s);
        /* Every 64th round: notices are rare, and a grace is seconds long. */
        if ((it & 63) == 63 && (rc = departed(t, h, start)) != MPIDP_OK) return rc;
        backoff(it, waited, spin);
    }
}

int mpidp_reqtable_wait_until(mpidp_reqtable_t *t, mpidp_reqtable_poll_fn poll, void *arg,
                              double timeout_s)
{
    if (t == NULL || poll == NULL)
        return mpidp__fail(MPIDP_EINVAL, "request table: NULL argument");
    double start = mpidp_now(), spin = mpidp_reqtable_spin(t);
    for (unsigned long it = 0;; it++) {
        int done = 0;
        int rc = poll(arg, &done);
        if (rc != MPIDP_OK || done) return rc;
        run_engines(t);
        double waited = mpidp_now() - start;
        if (timeout_s > 0 && waited > timeout_s) return timed_out(t, timeout_s);
        if ((it & 63) == 63 && (rc = departed(t, MPIDP_REQ_NONE, start)) != MPIDP_OK) return rc;
        backoff(it, waited, spin);
    }
}

int mpidp_reqtable_progress(mpidp_reqtable_t *t, size_t *n_done)
{
    if (t == NULL) return mpidp__fail(MPIDP_EINVAL, "request table: NULL argument");
    size_t completed = 0;
    int rc = MPI_SUCCESS;
    char what[MPIDP_REQ_WHAT_LEN];
    pthread_mutex_lock(&t->lock);
    /* Backwards: a completed slot is replaced by the last one, already tested. */
    for (size_t k = t->n_live; k-- > 0 && rc == MPI_SUCCESS;) {
        slot_t *s = &t->slots[t->live_idx[k]];
        int done = 0;
        rc = test_slot_locked(t, s, &done, what);
        completed += (size_t)done;
    }
    pthread_mutex_unlock(&t->lock);
    if (n_done) *n_done = completed;
    if (rc != MPI_SUCCESS) return mpidp__mpi_fail(rc, "%s failed", what);
    run_engines(t);
    return MPIDP_OK;
}

int mpidp_reqtable_wait_all(mpidp_reqtable_t *t, double timeout_s)
{
    double start = mpidp_now(), spin = mpidp_reqtable_spin(t);
    for (unsigned long it = 0;; it++) {
        int rc = mpidp_reqtable_progress(t, NULL);
        if (rc != MPIDP_OK) return rc;
        if (mpidp_reqtable_pending(t) == 0) return MPIDP_OK;
        double waited = mpidp_now() - start;
        if (timeout_s > 0 && waited > timeout_s) return timed_out(t, timeout_s);
        if ((it & 63) == 63 && (rc = departed(t, MPIDP_REQ_NONE, start)) != MPIDP_OK) return rc;
        backoff(it, waited, spin);
    }
}

size_t mpidp_reqtable_pending(mpidp_reqtable_t *t)
{
    if (t == NULL) return 0;
    pthread_mutex_lock(&t->lock);
    size_t n = t->n_live;
    pthread_mutex_unlock(&t->lock);
    return n;
}

void mpidp_reqtable_describe(mpidp_reqtable_t *t, char *buf, size_t len)
{
    if (buf == NULL || len == 0) return;
    buf[0] = '\0';
    if (t == NULL) return;
    double now = mpidp_now();
    size_t used = 0, shown = 0;
    pthread_mutex_lock(&t->lock);
    for (size_t k = 0; k < t->n_live; k++) {
        slot_t *s = &t->slots[t->live_idx[k]];
        int n = snprintf(buf + used, len - used, "%s%s (%.1f s)", shown ? "; " : "", s->what,
                         now - s->posted_at);
        shown++;
        if (n < 0 || (size_t)n >= len - used) break;
        used += (size_t)n;
    }
    if (shown == 0) snprintf(buf, len, "nothing");
    pthread_mutex_unlock(&t->lock);
}
