/* Whether the ranks make the same calls, at no cost while they repeat a
 * sequence they agreed on (see mpidp/callcheck.h). */
#include "mpidp/callcheck.h"
#include "mpidp/ft.h"

#include <stdlib.h>
#include <string.h>

#include "fail.h"
#include "mpi_util.h"
#include "post.h"
#include "mpidp/status.h"

/* Predictions kept: the signature that followed each pair of signatures, in
 * an open-addressed table probed PROBES slots deep. A training step's
 * distinct calls are a few dozen (a bucket each, the loss, a metric); a
 * prediction lost to a full neighbourhood costs one exchange, never a
 * wrong answer (the whole signature is compared). */
#define TABLE_SIZE 1024
#define PROBES 8
#define NOTE_TAG 7

typedef struct {
    uint64_t key; /* 0: empty */
    int64_t sig[MPIDP_CALLCHECK_MAX_FIELDS];
} prediction_t;

struct mpidp_callcheck {
    MPI_Comm side; /* notifications and exchanges, apart from the calls' own traffic */
    int rank, size;
    size_t n;
    /* Calls so far on this communicator: the same on every rank. */
    int64_t seq;
    /* Hashes of the last two agreed signatures (0: none; after a
     * disagreement the ranks forget them together). */
    uint64_t last[2];
    prediction_t table[TABLE_SIZE];
    int64_t current[MPIDP_CALLCHECK_MAX_FIELDS];
    /* A receive of notifications from any rank, always posted. A rank can
     * be at most one call ahead of another (its call cannot complete until
     * every rank has joined the one before), so notifications count for
     * this call or the next. */
    MPI_Request note_recv;
    int64_t note_in, note_out;
    int notes_now, notes_next, notes_awaited;
    mpidp_req_t *sends; /* this rank's notifications of the current call */
    int64_t *rows;      /* size x MPIDP_CALLCHECK_ROW(n) */
    int64_t mine[MPIDP_CALLCHECK_ROW(MPIDP_CALLCHECK_MAX_FIELDS)]; /* this rank's row, sent */
    /* An exchange failed with its messages still posted: MPI may read and
     * write the buffers above whenever a late rank comes, so they outlive
     * the check (leaked by destroy). */
    int left_posted;
};

static uint64_t hash_sig(const int64_t *sig, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint64_t)sig[i];
        h *= 1099511628211ull;
        h ^= h >> 29;
    }
    return h | 1; /* never 0, which marks "none" */
}

/* The key of the context (the last two signatures): splitmix64's finalizer,
 * so that the low bits that pick a slot depend on every bit of both. */
static uint64_t context_key(const mpidp_callcheck_t *c)
{
    uint64_t z = c->last[0] * 0x9e3779b97f4a7c15ull + c->last[1];
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (z ^ (z >> 31)) | 1;
}

/* The slot of `key`, or the empty one where it would go; NULL when the
 * neighbourhood is full of other keys. */
static prediction_t *slot_of(mpidp_callcheck_t *c, uint64_t key)
{
    for (size_t i = 0; i < PROBES; i++) {
        prediction_t *p = &c->table[(key + i) % TABLE_SIZE];
        if (p->key == key || p->key == 0) return p;
    }
    return NULL;
}

/* A call every rank agreed on (by prediction or exchange): learn it as what
 * follows the two before it, and move on. */
static void remember(mpidp_callcheck_t *c)
{
    uint64_t key = context_key(c);
    prediction_t *p = slot_of(c, key);
    if (p == NULL) p = &c->table[key % TABLE_SIZE]; /* evict: the same choice on every rank */
    p->key = key;
    memcpy(p->sig, c->current, c->n * sizeof *c->current);
    c->last[0] = c->last[1];
    c->last[1] = hash_sig(c->current, c->n);
}

static void next_call(mpidp_callcheck_t *c)
{
    c->seq++;
    c->notes_now = c->notes_next;
    c->notes_next = 0;
}

static int post_note_recv(mpidp_callcheck_t *c)
{
    int rc = MPI_Irecv(&c->note_in, 1, MPI_INT64_T, MPI_ANY_SOURCE, NOTE_TAG, c->side,
                       &c->note_recv);
    if (rc != MPI_SUCCESS) {
        c->note_recv = MPI_REQUEST_NULL;
        return mpidp__mpi_fail(rc, "call check: MPI_Irecv of the ranks' notifications");
    }
    return MPIDP_OK;
}

/* Takes a notification that has arrived, if one has: counted for this call
 * or the next. */
static int take_note(mpidp_callcheck_t *c)
{
    int arrived = 0;
    int rc = MPI_Test(&c->note_recv, &arrived, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS)
        return mpidp__mpi_fail(rc, "call check: MPI_Test of the ranks' notifications");
    if (!arrived) return MPIDP_OK;
    if (c->note_in == c->seq)
        c->notes_now++;
    else if (c->note_in == c->seq + 1)
        c->notes_next++;
    else if (mpidp_ft_comm_broken(c->side))
        /* A revoke or a rank's death ended the receive without a new note:
         * the number is stale, and the failure is what happened. */
        return mpidp__fail(MPIDP_EPEERFAILED, "call check: the ranks' notifications: a rank "
                           "failed (or a survivor revoked the communicator)");
    else
        return mpidp__fail(MPIDP_ESTATE, "call check: a rank announced its call #%lld during "
                           "call #%lld (the ranks' sequences of calls have diverged)",
                           (long long)c->note_in, (long long)c->seq);
    return post_note_recv(c);
}

int mpidp_callcheck_create(MPI_Comm comm, size_t n_fields, mpidp_reqtable_t *reqs,
                           double timeout_s, mpidp_callcheck_t **out)
{
    if (out == NULL || reqs == NULL || n_fields == 0 || n_fields > MPIDP_CALLCHECK_MAX_FIELDS)
        return mpidp__fail(MPIDP_EINVAL, "call check: expected 1 .. %d fields, got %zu",
                           MPIDP_CALLCHECK_MAX_FIELDS, n_fields);
    *out = NULL;
    mpidp_callcheck_t *c = calloc(1, sizeof *c);
    if (c == NULL) return mpidp__fail(MPIDP_ENOMEM, "call check: out of memory");
    c->n = n_fields;
    c->side = MPI_COMM_NULL;
    c->note_recv = MPI_REQUEST_NULL;
    MPI_Comm_rank(comm, &c->rank);
    MPI_Comm_size(comm, &c->size);
    c->rows = calloc((size_t)c->size * MPIDP_CALLCHECK_ROW(n_fields), sizeof *c->rows);
    c->sends = calloc((size_t)c->size, sizeof *c->sends);
    if (c->rows == NULL || c->sends == NULL) {
        free(c->rows);
        free(c->sends);
        free(c);
        return mpidp__fail(MPIDP_ENOMEM, "call check: out of memory");
    }
    const char *what = "call check: the side communicator (MPI_Comm_idup)";
    mpidp_req_t slot, h;
    int rc = mpidp_reqtable_claim(reqs, what, &slot);
    if (rc == MPIDP_OK) {
        MPI_Request req;
        int mrc = MPI_Comm_idup(comm, &c->side, &req);
        rc = mpidp__post_done(reqs, slot, mrc, req, comm, what, &h);
    }
    if (rc == MPIDP_OK) rc = mpidp_reqtable_wait(reqs, h, timeout_s);
    /* Fault-tolerant mode: a rank going to recovery revokes it with the
     * calls' communicator, or a survivor whose check is under way would wait
     * for a peer that left the call (its notes and signatures) until the
     * deadline. */
    if (rc == MPIDP_OK) mpidp_ft_track(c->side);
    if (rc == MPIDP_OK) rc = post_note_recv(c);
    if (rc != MPIDP_OK) {
        /* A duplicate still being made is left to MPI: freeing it would race. */
        if (!mpidp_left_in_flight(rc)) mpidp_callcheck_destroy(c);
        return rc;
    }
    *out = c;
    return MPIDP_OK;
}

void mpidp_callcheck_destroy(mpidp_callcheck_t *c)
{
    if (c == NULL) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
        if (c->note_recv != MPI_REQUEST_NULL) {
            MPI_Cancel(&c->note_recv);
            MPI_Request_free(&c->note_recv);
        }
        if (c->side != MPI_COMM_NULL) {
            mpidp_ft_untrack(c->side);
            MPI_Comm_free(&c->side);
        }
    }
    if (c->left_posted) return; /* MPI may still use them */
    free(c->rows);
    free(c->sends);
    free(c);
}

const int64_t *mpidp_callcheck_rows(const mpidp_callcheck_t *c) { return c->rows; }

static int notes_poll(void *arg, int *done)
{
    mpidp_callcheck_t *c = arg;
    int rc = take_note(c);
    *done = c->notes_now >= c->notes_awaited;
    return rc;
}

/* Receives the notifications of this call that have not come yet: one from
 * every other rank whose row says it told the others (each did, before it
 * joined the exchange). */
static int drain(mpidp_callcheck_t *c, mpidp_reqtable_t *reqs, double timeout_s)
{
    size_t row = MPIDP_CALLCHECK_ROW(c->n);
    c->notes_awaited = 0;
    for (int r = 0; r < c->size; r++)
        if (r != c->rank && c->rows[(size_t)r * row + MPIDP_CALLCHECK_TOLD(c->n)])
            c->notes_awaited++;
    return mpidp_reqtable_wait_until(reqs, notes_poll, c, timeout_s);
}

/* Every rank's signature, with whether it posted the prediction and whether
 * it told the others; then the verdict, the same on every rank. */
static int exchange(mpidp_callcheck_t *c, int64_t posted, int tell, mpidp_reqtable_t *reqs,
                    double timeout_s, int *outcome)
{
    size_t row = MPIDP_CALLCHECK_ROW(c->n);
    int n_sends = 0, rc = MPIDP_OK;
    c->note_out = c->seq;
    for (int r = 0; tell && r < c->size && rc == MPIDP_OK; r++) {
        if (r == c->rank) continue;
        mpidp_req_t slot;
        if ((rc = mpidp_reqtable_claim(reqs, "call check: a notification (MPI_Isend)", &slot)) !=
            MPIDP_OK)
            break;
        MPI_Request req;
        int mrc = MPI_Isend(&c->note_out, 1, MPI_INT64_T, r, NOTE_TAG, c->side, &req);
        rc = mpidp__post_done(reqs, slot, mrc, req, c->side,
                              "call check: a notification (MPI_Isend)", &c->sends[n_sends]);
        if (rc == MPIDP_OK) n_sends++;
    }
    int64_t *mine = c->mine;
    memcpy(mine, c->current, c->n * sizeof *mine);
    mine[MPIDP_CALLCHECK_POSTED(c->n)] = posted;
    mine[MPIDP_CALLCHECK_TOLD(c->n)] = tell;
    const char *what = "call check: the ranks' signatures (MPI_Iallgather)";
    mpidp_req_t slot, h;
    if (rc == MPIDP_OK) rc = mpidp_reqtable_claim(reqs, what, &slot);
    if (rc == MPIDP_OK) {
        MPI_Request req;
        int mrc = MPI_Iallgather(mine, (int)row, MPI_INT64_T, c->rows, (int)row, MPI_INT64_T,
                                 c->side, &req);
        rc = mpidp__post_done(reqs, slot, mrc, req, c->side, what, &h);
    }
    if (rc == MPIDP_OK) rc = mpidp_reqtable_wait(reqs, h, timeout_s);
    if (rc == MPIDP_OK) rc = drain(c, reqs, timeout_s);
    for (int i = 0; i < n_sends && rc == MPIDP_OK; i++)
        rc = mpidp_reqtable_wait(reqs, c->sends[i], timeout_s);
    if (rc != MPIDP_OK) {
        if (mpidp_left_in_flight(rc)) c->left_posted = 1;
        return rc;
    }
    int same = 1;
    for (int r = 0; r < c->size && same; r++) {
        const int64_t *other = c->rows + (size_t)r * row;
        same = memcmp(other, c->current, c->n * sizeof *other) == 0 &&
               !other[MPIDP_CALLCHECK_POSTED(c->n)];
    }
    *outcome = same ? MPIDP_CALL_AGREED : MPIDP_CALL_DIFFER;
    if (same)
        remember(c);
    else
        c->last[0] = c->last[1] = 0;
    next_call(c);
    return MPIDP_OK;
}

int mpidp_callcheck_begin(mpidp_callcheck_t *c, const int64_t *sig, int exchange_anyway,
                          mpidp_reqtable_t *reqs, double timeout_s, int *outcome)
{
    if (c == NULL || sig == NULL || reqs == NULL || outcome == NULL)
        return mpidp__fail(MPIDP_EINVAL, "call check: NULL argument");
    memcpy(c->current, sig, c->n * sizeof *sig);
    uint64_t key = context_key(c);
    const prediction_t *p = slot_of(c, key);
    /* A notification that has come but is not yet taken is found by the
     * wait: testing for it here would cost every predicted call a round of
     * MPI's progress engine. */
    if (!exchange_anyway && c->notes_now == 0 && p != NULL && p->key == key &&
        memcmp(p->sig, sig, c->n * sizeof *sig) == 0) {
        *outcome = MPIDP_CALL_PREDICTED;
        return MPIDP_OK;
    }
    int rc = take_note(c);
    if (rc != MPIDP_OK) return rc;
    /* A rank that was told has nothing to tell: the teller told everyone. */
    return exchange(c, 0, c->notes_now == 0, reqs, timeout_s, outcome);
}

typedef struct {
    mpidp_callcheck_t *c;
    const mpidp_operation_t *ops;
    void *op;
    int completed;
    unsigned rounds;
} watch_t;

static int watch_poll(void *arg, int *done)
{
    watch_t *w = arg;
    int rc = w->ops->test(w->op, &w->completed);
    if (rc != MPIDP_OK || w->completed) {
        *done = 1;
        return rc;
    }
    /* The notification is looked for every 8th round only: a predicted
     * call usually completes within a few rounds, and each test of it is a
     * round of MPI's progress engine. */
    if ((w->rounds++ & 7) != 7) return MPIDP_OK;
    rc = take_note(w->c);
    *done = w->c->notes_now > 0;
    return rc;
}

/* The watch ended: the call completed (the prediction held) or a rank
 * said it exchanges (join the exchange, which says how the ranks differ). */
static int settle(mpidp_callcheck_t *c, const watch_t *w, mpidp_reqtable_t *reqs,
                  double timeout_s, int late, int *outcome)
{
    if (w->completed) {
        *outcome = MPIDP_CALL_PREDICTED;
        remember(c);
        next_call(c);
        return MPIDP_OK;
    }
    return exchange(c, late ? MPIDP_CALLCHECK_POSTED_LATE : MPIDP_CALLCHECK_POSTED_WAITING, 0,
                    reqs, timeout_s, outcome);
}

int mpidp_callcheck_wait(mpidp_callcheck_t *c, const mpidp_operation_t *ops, void *op,
                         mpidp_reqtable_t *reqs, double timeout_s, int late, int *outcome)
{
    if (c == NULL || ops == NULL || op == NULL || reqs == NULL || outcome == NULL)
        return mpidp__fail(MPIDP_EINVAL, "call check: NULL argument");
    watch_t w = {c, ops, op, 0, 0};
    int rc = mpidp_reqtable_wait_until(reqs, watch_poll, &w, timeout_s);
    if (rc != MPIDP_OK) return rc;
    return settle(c, &w, reqs, timeout_s, late, outcome);
}

int mpidp_callcheck_poll(mpidp_callcheck_t *c, const mpidp_operation_t *ops, void *op,
                         mpidp_reqtable_t *reqs, double timeout_s, int *resolved, int *outcome)
{
    if (c == NULL || ops == NULL || op == NULL || reqs == NULL || resolved == NULL ||
        outcome == NULL)
        return mpidp__fail(MPIDP_EINVAL, "call check: NULL argument");
    *resolved = 0;
    watch_t w = {c, ops, op, 0, 7}; /* round 7: this poll also looks for the notification */
    int done = 0;
    int rc = watch_poll(&w, &done);
    if (rc != MPIDP_OK || !done) return rc;
    *resolved = 1;
    return settle(c, &w, reqs, timeout_s, 0, outcome);
}
