/* Peer exchange (see mpidp/peer_exchange.h). */
#include "mpidp/peer_exchange.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpi_util.h"
#include "post.h"
#include "mpidp/operation.h"
#include "mpidp/status.h"
#include "fail.h"

struct mpidp_peerx {
    mpidp_reqtable_t *reqs;
    mpidp_req_t *handles; /* every request posted, sends and receives */
    size_t n_handles;
    char what[MPIDP_REQ_WHAT_LEN];
};

static int check_peers(const int *peers, int n, int size, int rank, const char *side,
                       const char *what)
{
    if (n < 0 || n > MPIDP_PEERX_MAX_PEERS)
        return mpidp__fail(MPIDP_EINVAL, "%s: %d %s peers, expected 0 .. %d", what, n, side,
                           MPIDP_PEERX_MAX_PEERS);
    if (n > 0 && peers == NULL) return mpidp__fail(MPIDP_EINVAL, "%s: NULL %s peers", what, side);
    for (int i = 0; i < n; i++) {
        if (peers[i] < 0 || peers[i] >= size || peers[i] == rank)
            return mpidp__fail(MPIDP_EINVAL, "%s: %s peer %d is not another rank of the "
                               "communicator (rank %d of %d)", what, side, peers[i], rank, size);
        for (int j = 0; j < i; j++)
            if (peers[j] == peers[i])
                return mpidp__fail(MPIDP_EINVAL, "%s: %s peer %d listed twice", what, side,
                                   peers[i]);
    }
    return MPIDP_OK;
}

/* Waits for every request posted so far, for at most `timeout_s` each.
 * Returns 1 when none is left in flight. */
static int drain(mpidp_peerx_t *x, double timeout_s)
{
    int all = 1;
    for (size_t i = 0; i < x->n_handles; i++)
        if (mpidp_left_in_flight(mpidp_reqtable_wait(x->reqs, x->handles[i], timeout_s))) all = 0;
    return all;
}

static int post_all(mpidp_peerx_t *x, MPI_Comm comm, const mpidp_peerx_spec_t *s, int tag_base,
                    size_t piece, size_t n_pieces, mpidp_req_t *slots)
{
    size_t k = 0;
    for (size_t p = 0; p < n_pieces; p++) {
        size_t off = p * piece, len = s->bytes - off < piece ? s->bytes - off : piece;
        int tag = tag_base + (int)p;
        /* Receives first, so a peer's send finds its match posted. */
        for (int i = 0; i < s->n_in; i++, k++) {
            MPI_Request req;
            int rc = MPI_Irecv((char *)s->recv[i] + off, (int)len, MPI_BYTE, s->in[i], tag, comm,
                               &req);
            rc = mpidp__post_done(x->reqs, slots[k], rc, req, comm, x->what,
                                  &x->handles[x->n_handles]);
            if (rc != MPIDP_OK) return rc;
            x->n_handles++;
        }
        for (int i = 0; i < s->n_out; i++, k++) {
            MPI_Request req;
            int rc = MPI_Isend((const char *)s->send + off, (int)len, MPI_BYTE, s->out[i], tag,
                               comm, &req);
            rc = mpidp__post_done(x->reqs, slots[k], rc, req, comm, x->what,
                                  &x->handles[x->n_handles]);
            if (rc != MPIDP_OK) return rc;
            x->n_handles++;
        }
    }
    return MPIDP_OK;
}

int mpidp_peerx_start(MPI_Comm comm, const mpidp_peerx_spec_t *s, mpidp_reqtable_t *reqs,
                      mpidp_peerx_t **out)
{
    if (out) *out = NULL;
    if (s == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "peer exchange: NULL argument");
    const char *what = s->what ? s->what : "peer exchange";
    int size, rank;
    int rc = MPI_Comm_size(comm, &size);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(comm, &rank);
    if (rc != MPI_SUCCESS) return mpidp__mpi_fail(rc, "%s: MPI_Comm_size", what);
    if ((rc = check_peers(s->out, s->n_out, size, rank, "out", what)) != MPIDP_OK) return rc;
    if ((rc = check_peers(s->in, s->n_in, size, rank, "in", what)) != MPIDP_OK) return rc;
    if (s->n_out > 0 && s->bytes > 0 && s->send == NULL)
        return mpidp__fail(MPIDP_EINVAL, "%s: NULL send buffer", what);
    for (int i = 0; i < s->n_in; i++) {
        if (s->bytes > 0 && (s->recv == NULL || s->recv[i] == NULL))
            return mpidp__fail(MPIDP_EINVAL, "%s: NULL receive buffer %d", what, i);
        if (s->recv_bytes && s->recv_bytes[i] != s->bytes)
            return mpidp__fail(MPIDP_EINVAL, "%s: receive buffer %d holds %zu bytes, the message "
                               "%zu", what, i, s->recv_bytes[i], s->bytes);
    }
    size_t piece = s->piece_bytes ? s->piece_bytes : MPIDP_PEERX_PIECE;
    if (piece > (size_t)INT_MAX) piece = (size_t)INT_MAX;
    size_t n_pieces = s->bytes ? (s->bytes + piece - 1) / piece : 1;
    if (n_pieces > MPIDP_PEERX_MAX_PIECES)
        return mpidp__fail(MPIDP_EINVAL, "%s: %zu bytes take %zu pieces of %zu, at most %d", what,
                           s->bytes, n_pieces, piece, MPIDP_PEERX_MAX_PIECES);
    /* Every rank numbers the exchange alike, peers or not. */
    unsigned op = 0;
    if ((rc = mpidp__next_op_number(comm, what, &op)) != MPIDP_OK) return rc;
    int tag_base = (int)((op & 511u) << 6) + 1;

    size_t n = n_pieces * (size_t)(s->n_in + s->n_out);
    mpidp_peerx_t *x = calloc(1, sizeof *x);
    mpidp_req_t *slots = malloc((n ? n : 1) * sizeof *slots);
    if (x) x->handles = malloc((n ? n : 1) * sizeof *x->handles);
    if (x == NULL || slots == NULL || x->handles == NULL) {
        if (x) free(x->handles);
        free(x), free(slots);
        return mpidp__fail(MPIDP_ENOMEM, "%s", what);
    }
    x->reqs = reqs;
    snprintf(x->what, sizeof x->what, "%s", what);
    size_t claimed = 0;
    for (; claimed < n; claimed++)
        if ((rc = mpidp_reqtable_claim(reqs, x->what, &slots[claimed])) != MPIDP_OK) break;
    if (claimed < n) {
        while (claimed > 0) mpidp_reqtable_unclaim(reqs, slots[--claimed]);
        free(slots), free(x->handles), free(x);
        return rc;
    }
    rc = post_all(x, comm, s, tag_base, piece, n_pieces, slots);
    if (rc != MPIDP_OK) {
        for (size_t k = x->n_handles + 1; k < n; k++) mpidp_reqtable_unclaim(reqs, slots[k]);
        free(slots);
        /* Only what went out can still touch the buffers: finish it first. */
        if (drain(x, s->drain_timeout_s)) free(x->handles), free(x);
        return rc;
    }
    free(slots);
    *out = x;
    return MPIDP_OK;
}

int mpidp_peerx_test(mpidp_peerx_t *x, int *done)
{
    if (x == NULL || done == NULL) return mpidp__fail(MPIDP_EINVAL, "peer exchange: NULL argument");
    *done = 0;
    int all = 1;
    for (size_t i = 0; i < x->n_handles; i++) {
        int one = 0;
        int rc = mpidp_reqtable_test(x->reqs, x->handles[i], &one);
        if (rc != MPIDP_OK) return rc;
        all &= one;
    }
    *done = all;
    return MPIDP_OK;
}

int mpidp_peerx_wait(mpidp_peerx_t *x, double timeout_s)
{
    if (x == NULL) return mpidp__fail(MPIDP_EINVAL, "peer exchange: NULL argument");
    for (size_t i = 0; i < x->n_handles; i++) {
        int rc = mpidp_reqtable_wait(x->reqs, x->handles[i], timeout_s);
        if (rc != MPIDP_OK) return rc;
    }
    return MPIDP_OK;
}

int mpidp_peerx_free(mpidp_peerx_t *x)
{
    if (x == NULL) return MPIDP_OK;
    int done = 0;
    int rc = mpidp_peerx_test(x, &done);
    if (rc == MPIDP_OK && !done)
        return mpidp__fail(MPIDP_ESTATE, "%s: messages are still in flight", x->what);
    free(x->handles);
    free(x);
    return MPIDP_OK;
}

static int operation_test(void *op, int *done) { return mpidp_peerx_test(op, done); }
static int operation_wait(void *op, double timeout_s) { return mpidp_peerx_wait(op, timeout_s); }
static int operation_free(void *op) { return mpidp_peerx_free(op); }
const mpidp_operation_t mpidp_peerx_operation = {operation_test, operation_wait, operation_free};
