/* Allgather, reduce-scatter and small allreduce of a few ranks as
 * point-to-point messages (see linear.h). */
#include "linear.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fail.h"
#include "mpi_util.h"
#include "post.h"
#include "mpidp/status.h"

struct mpidp__linear {
    mpidp_reqtable_t *reqs;
    int rank, size;
    mpidp_req_t *recvs, *sends; /* by peer; MPIDP_REQ_NONE at this rank */
    int completed;
    /* Reduce-scatter and allreduce: peers' blocks land in `scratch` (one
     * block per rank; this rank's holds its own input for an allreduce) and
     * fold into `recv` in rank order. */
    int reducing;
    char *scratch;
    const char *own; /* this rank's block of the input */
    void *recv;
    int count;
    size_t block_bytes;
    MPI_Datatype type;
    MPI_Op op;
    int next_fold; /* ranks below this have been folded into recv */
    /* Allgather only: this rank's own block, still to copy into the result. */
    const char *copy_from;
    char *copy_to;
    size_t copy_left;
};

/* The own block is copied this much per test, between tests of the
 * messages: Open MPI moves a large message only inside MPI calls, so one
 * 64 MB memcpy before the first test stalled the peers' blocks for its whole
 * length (0.84x the blocking call at 64 MB per rank; measured with
 * benchmarks/c/bench_collectives.c). */
#define COPY_STEP ((size_t)1 << 18)

int mpidp__linear_tag(MPI_Comm comm)
{
    void *ub = NULL;
    int flag = 0;
    MPI_Comm_get_attr(comm, MPI_TAG_UB, &ub, &flag);
    return flag && ub ? *(int *)ub : 32767; /* the least MPI_TAG_UB MPI allows */
}

static int linear_new(mpidp_reqtable_t *reqs, int rank, int size, const char *what,
                      mpidp__linear_t **out)
{
    mpidp__linear_t *x = calloc(1, sizeof *x);
    if (x != NULL) {
        x->recvs = calloc((size_t)size, sizeof *x->recvs);
        x->sends = calloc((size_t)size, sizeof *x->sends);
    }
    if (x == NULL || x->recvs == NULL || x->sends == NULL) {
        if (x != NULL) {
            free(x->recvs);
            free(x->sends);
            free(x);
        }
        return mpidp__fail(MPIDP_ENOMEM, "%s: out of memory", what);
    }
    x->reqs = reqs;
    x->rank = rank;
    x->size = size;
    *out = x;
    return MPIDP_OK;
}

/* One message of `count` elements of `type`: MPI counts are ints, so a
 * reduce-scatter's blocks go in its own elements, not in bytes. */
static int post_one(mpidp__linear_t *x, int send, void *buf, int count, MPI_Datatype type,
                    int peer, int tag, MPI_Comm comm, const char *what, mpidp_req_t *out)
{
    char detail[MPIDP_REQ_WHAT_LEN];
    snprintf(detail, sizeof detail, "%s: MPI_I%s of %d elements %s rank %d", what,
             send ? "send" : "recv", count, send ? "to" : "from", peer);
    mpidp_req_t slot;
    int rc = mpidp_reqtable_claim(x->reqs, detail, &slot);
    if (rc != MPIDP_OK) return rc;
    MPI_Request req;
    int mrc = send ? MPI_Isend(buf, count, type, peer, tag, comm, &req)
                   : MPI_Irecv(buf, count, type, peer, tag, comm, &req);
    return mpidp__post_done(x->reqs, slot, mrc, req, comm, detail, out);
}

/* Whether a message of x is still in flight. */
static int in_flight(mpidp__linear_t *x)
{
    for (int r = 0; r < x->size; r++) {
        int a = 1, b = 1;
        mpidp_reqtable_test(x->reqs, x->recvs[r], &a);
        mpidp_reqtable_test(x->reqs, x->sends[r], &b);
        if (!a || !b) return 1;
    }
    return 0;
}

/* Posts every receive (recv_at[peer], recv_count elements of `type` each),
 * then every send (send_at[peer], send_counts[peer]): the receives first, so that blocks
 * find their buffers rather than wait as unexpected messages. Peers go
 * round from this rank, so no rank is everyone's first. On failure x is
 * freed, or, where some messages were posted, left to them (leaked, as an
 * operation that timed out is). */
static int post_exchange(mpidp__linear_t *x, MPI_Comm comm, const char *what, MPI_Datatype type,
                         char *const *recv_at, int recv_count, char *const *send_at,
                         const int *send_counts, mpidp__linear_t **out)
{
    int tag = mpidp__linear_tag(comm), rc = MPIDP_OK;
    for (int k = 1; k < x->size && rc == MPIDP_OK; k++) {
        int peer = (x->rank - k + x->size) % x->size;
        rc = post_one(x, 0, recv_at[peer], recv_count, type, peer, tag, comm, what,
                      &x->recvs[peer]);
    }
    for (int k = 1; k < x->size && rc == MPIDP_OK; k++) {
        int peer = (x->rank + k) % x->size;
        rc = post_one(x, 1, send_at[peer], send_counts[peer], type, peer, tag, comm, what,
                      &x->sends[peer]);
    }
    if (rc != MPIDP_OK) {
        if (!in_flight(x)) mpidp__linear_free(x);
        return rc;
    }
    *out = x;
    return MPIDP_OK;
}

int mpidp__linear_allgather_start(MPI_Comm comm, int rank, int size, const void *send, void *recv,
                                  size_t bytes, mpidp_reqtable_t *reqs, const char *what,
                                  mpidp__linear_t **out)
{
    mpidp__linear_t *x = NULL;
    int rc = linear_new(reqs, rank, size, what, &x);
    if (rc != MPIDP_OK) return rc;
    char *recv_at[MPIDP_LINEAR_MAX_RANKS], *send_at[MPIDP_LINEAR_MAX_RANKS];
    int send_counts[MPIDP_LINEAR_MAX_RANKS];
    for (int r = 0; r < size; r++) {
        recv_at[r] = (char *)recv + (size_t)r * bytes;
        send_at[r] = (char *)send;
        send_counts[r] = (int)bytes;
    }
    rc = post_exchange(x, comm, what, MPI_BYTE, recv_at, (int)bytes, send_at, send_counts, out);
    if (rc != MPIDP_OK) return rc;
    /* This rank's own block: copied by the tests, a step at a time, while
     * the messages move. */
    if ((const char *)send != recv_at[rank]) {
        x->copy_from = send;
        x->copy_to = recv_at[rank];
        x->copy_left = bytes;
    }
    return MPIDP_OK;
}

/* A reducing operation (reduce-scatter, allreduce): blocks of `count`
 * elements land in a scratch of one block per rank and fold into `recv`. */
static int reducing_new(mpidp_reqtable_t *reqs, int rank, int size, void *recv, int count,
                        MPI_Datatype type, size_t esize, MPI_Op op, const char *what,
                        mpidp__linear_t **out)
{
    size_t bytes = (size_t)count * esize;
    mpidp__linear_t *x = NULL;
    int rc = linear_new(reqs, rank, size, what, &x);
    if (rc != MPIDP_OK) return rc;
    x->reducing = 1;
    x->scratch = malloc((size_t)size * bytes + 1);
    if (x->scratch == NULL) {
        mpidp__linear_free(x);
        return mpidp__fail(MPIDP_ENOMEM, "%s: out of memory for %d blocks of %zu bytes", what,
                           size, bytes);
    }
    x->recv = recv;
    x->count = count;
    x->block_bytes = bytes;
    x->type = type;
    x->op = op;
    *out = x;
    return MPIDP_OK;
}

int mpidp__linear_reduce_scatter_start(MPI_Comm comm, int rank, int size, const void *send,
                                       void *recv, const int *counts, MPI_Datatype type,
                                       size_t esize, MPI_Op op, mpidp_reqtable_t *reqs,
                                       const char *what, mpidp__linear_t **out)
{
    mpidp__linear_t *x = NULL;
    int rc = reducing_new(reqs, rank, size, recv, counts[rank], type, esize, op, what, &x);
    if (rc != MPIDP_OK) return rc;
    /* Each peer gets its block of the input, at the displacement of the
     * counts before it; its block lands in this rank's scratch. */
    char *recv_at[MPIDP_LINEAR_MAX_RANKS], *send_at[MPIDP_LINEAR_MAX_RANKS];
    size_t at = 0;
    for (int r = 0; r < size; r++) {
        recv_at[r] = x->scratch + (size_t)r * x->block_bytes;
        send_at[r] = (char *)send + at * esize;
        at += (size_t)counts[r];
    }
    x->own = send_at[rank];
    return post_exchange(x, comm, what, type, recv_at, counts[rank], send_at, counts, out);
}

int mpidp__linear_allreduce_start(MPI_Comm comm, int rank, int size, void *data, int count,
                                  MPI_Datatype type, size_t esize, MPI_Op op,
                                  mpidp_reqtable_t *reqs, const char *what,
                                  mpidp__linear_t **out)
{
    mpidp__linear_t *x = NULL;
    int rc = reducing_new(reqs, rank, size, data, count, type, esize, op, what, &x);
    if (rc != MPIDP_OK) return rc;
    /* The own tensor is copied first: the folds write `data` while the
     * sends still read this rank's values. */
    char *own = x->scratch + (size_t)rank * x->block_bytes;
    memcpy(own, data, x->block_bytes);
    x->own = own;
    char *recv_at[MPIDP_LINEAR_MAX_RANKS], *send_at[MPIDP_LINEAR_MAX_RANKS];
    int counts[MPIDP_LINEAR_MAX_RANKS];
    for (int r = 0; r < size; r++) {
        recv_at[r] = x->scratch + (size_t)r * x->block_bytes;
        send_at[r] = own;
        counts[r] = count;
    }
    return post_exchange(x, comm, what, type, recv_at, count, send_at, counts, out);
}

/* Folds in the blocks that have arrived, in rank order: the first is
 * copied, each next one reduced into it, so the result does not depend on
 * which message came first. */
static int fold_arrived(mpidp__linear_t *x)
{
    while (x->next_fold < x->size) {
        int r = x->next_fold;
        const char *block = x->own;
        if (r != x->rank) {
            int arrived = 0;
            int rc = mpidp_reqtable_test(x->reqs, x->recvs[r], &arrived);
            if (rc != MPIDP_OK) return rc;
            if (!arrived) return MPIDP_OK;
            block = x->scratch + (size_t)r * x->block_bytes;
        }
        if (r == 0) {
            memcpy(x->recv, block, x->block_bytes);
        } else {
            int mrc = MPI_Reduce_local(block, x->recv, x->count, x->type, x->op);
            if (mrc != MPI_SUCCESS) return mpidp__mpi_fail(mrc, "linear fold: MPI_Reduce_local");
        }
        x->next_fold++;
    }
    return MPIDP_OK;
}

int mpidp__linear_test(mpidp__linear_t *x, int *done)
{
    *done = x->completed;
    if (x->completed) return MPIDP_OK;
    if (x->reducing) {
        int rc = fold_arrived(x);
        if (rc != MPIDP_OK || x->next_fold < x->size) return rc;
    }
    int moved = 1; /* every message has completed */
    for (int r = 0; r < x->size && moved; r++) {
        int rc = mpidp_reqtable_test(x->reqs, x->recvs[r], &moved);
        if (rc == MPIDP_OK && moved) rc = mpidp_reqtable_test(x->reqs, x->sends[r], &moved);
        if (rc != MPIDP_OK) return rc;
    }
    /* The own block: a step between tests, the rest once nothing moves. */
    if (x->copy_left > 0) {
        size_t n = moved || x->copy_left < COPY_STEP ? x->copy_left : COPY_STEP;
        memcpy(x->copy_to, x->copy_from, n);
        x->copy_to += n, x->copy_from += n, x->copy_left -= n;
    }
    if (moved) x->completed = *done = 1;
    return MPIDP_OK;
}

int mpidp__linear_free(mpidp__linear_t *x)
{
    if (x == NULL) return MPIDP_OK;
    if (in_flight(x)) return mpidp__fail(MPIDP_ESTATE, "collective: still in flight");
    free(x->recvs);
    free(x->sends);
    free(x->scratch);
    free(x);
    return MPIDP_OK;
}
