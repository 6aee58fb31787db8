/* All-to-all and point-to-point send and receive (see mpidp/collectives.h):
 * each posts one non-blocking MPI call that moves bytes, so any dtype goes. */
#include "mpidp/collectives.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include "mpi_util.h"
#include "mpidp/status.h"

#include "coll_internal.h"
#include "fail.h"

int mpidp_alltoallv_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                          const size_t *send_counts, const size_t *recv_counts,
                          mpidp_reqtable_t *reqs, mpidp_coll_t **out)
{
    if (send == NULL || recv == NULL || send_counts == NULL || recv_counts == NULL ||
        reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "all_to_all: NULL argument");
    int size = 0, rc = mpidp__coll_comm_size(comm, &size);
    if (rc != MPIDP_OK) return rc;
    size_t esize = mpidp_dtype_size(send->dtype);
    if (esize == 0) return mpidp__fail(MPIDP_EDTYPE, "all_to_all: unknown dtype");
    mpidp_coll_t *x = NULL, *r = NULL;
    size_t sent = 0, received = 0;
    if ((rc = mpidp__vcoll_new(reqs, send_counts, size, esize, "all_to_all", &x, &sent)) != MPIDP_OK)
        return rc;
    /* A second one only for its checked receive counts, which x takes over. */
    if ((rc = mpidp__vcoll_new(reqs, recv_counts, size, esize, "all_to_all", &r, &received)) !=
        MPIDP_OK) {
        mpidp_coll_free(x);
        return rc;
    }
    x->recv_counts = r->counts;
    x->recv_displs = r->displs;
    r->counts = r->displs = NULL;
    mpidp_coll_free(r);
    if (send->numel != sent || recv->numel != received || recv->dtype != send->dtype) {
        mpidp_coll_free(x);
        return mpidp__fail(MPIDP_EINVAL, "all_to_all: expected %zu %s elements in and %zu out "
                           "(the sums of the split sizes), got %zu and %zu %s", sent,
                           mpidp_dtype_name(send->dtype), received, send->numel, recv->numel,
                           mpidp_dtype_name(recv->dtype));
    }
    const char *s = send->data, *d = recv->data;
    if (sent && received && s < d + received * esize && d < s + sent * esize) {
        mpidp_coll_free(x);
        return mpidp__fail(MPIDP_EINVAL, "all_to_all: the result overlaps the input");
    }
    char what[MPIDP_REQ_WHAT_LEN];
    snprintf(what, sizeof what, "MPI_Ialltoallv of %zu %s out, %zu in", sent,
             mpidp_dtype_name(send->dtype), received);
    mpidp_req_t slot;
    if ((rc = mpidp__coll_claim(x, what, &slot)) != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Ialltoallv(send->data, x->counts, x->displs, MPI_BYTE, recv->data, x->recv_counts,
                        x->recv_displs, MPI_BYTE, comm, &req);
    return mpidp__coll_post_done(x, slot, rc, req, comm, what, out);
}

/* Checks a point-to-point call's peer (any_ok: -1 = any rank) and tag. */
static int p2p_check(MPI_Comm comm, const mpidp_tensor_t *t, int peer, int any_ok, int tag,
                     const char *what, size_t *bytes)
{
    int size = 0, rank = 0, rc = mpidp__coll_rank_size(comm, &rank, &size);
    if (rc == MPIDP_OK) rc = mpidp__coll_byte_count(t, what, bytes);
    if (rc != MPIDP_OK) return rc;
    if (!(peer >= 0 && peer < size) && !(any_ok && peer == -1))
        return mpidp__fail(MPIDP_EINVAL, "%s: peer %d is not a rank of a %d-process communicator",
                           what, peer, size);
    if (peer == rank)
        return mpidp__fail(MPIDP_EINVAL, "%s: peer %d is this rank", what, peer);
    /* The largest tag is the core's own (linear.h). */
    int reserved = mpidp__linear_tag(comm);
    if (tag < 0 || tag >= reserved)
        return mpidp__fail(MPIDP_EINVAL, "%s: tag %d is not in 0..%d (%d is mpidp's own)", what,
                           tag, reserved - 1, reserved);
    return MPIDP_OK;
}

int mpidp_send_start(MPI_Comm comm, const mpidp_tensor_t *t, int peer, int tag,
                     mpidp_reqtable_t *reqs, mpidp_coll_t **out)
{
    if (t == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "send: NULL argument");
    size_t bytes = 0;
    int rc = p2p_check(comm, t, peer, 0, tag, "send", &bytes);
    mpidp_coll_t *x = NULL;
    if (rc == MPIDP_OK) rc = mpidp__coll_new(reqs, "send", &x);
    if (rc != MPIDP_OK) return rc;
    char what[MPIDP_REQ_WHAT_LEN];
    snprintf(what, sizeof what, "MPI_Isend of %zu %s to rank %d, tag %d", t->numel,
             mpidp_dtype_name(t->dtype), peer, tag);
    mpidp_req_t slot;
    if ((rc = mpidp__coll_claim(x, what, &slot)) != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Isend(t->data, (int)bytes, MPI_BYTE, peer, tag, comm, &req);
    return mpidp__coll_post_done(x, slot, rc, req, comm, what, out);
}

int mpidp_recv_start(MPI_Comm comm, const mpidp_tensor_t *t, int peer, int tag,
                     int32_t *source, mpidp_reqtable_t *reqs, mpidp_coll_t **out)
{
    if (t == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "recv: NULL argument");
    size_t bytes = 0;
    int rc = p2p_check(comm, t, peer, 1, tag, "recv", &bytes);
    mpidp_coll_t *x = NULL;
    if (rc == MPIDP_OK) rc = mpidp__coll_new(reqs, "recv", &x);
    if (rc != MPIDP_OK) return rc;
    x->source = peer;
    x->source_out = source;
    char what[MPIDP_REQ_WHAT_LEN];
    if (peer < 0)
        snprintf(what, sizeof what, "MPI_Irecv of %zu %s from any rank, tag %d", t->numel,
                 mpidp_dtype_name(t->dtype), tag);
    else
        snprintf(what, sizeof what, "MPI_Irecv of %zu %s from rank %d, tag %d", t->numel,
                 mpidp_dtype_name(t->dtype), peer, tag);
    mpidp_req_t slot;
    if ((rc = mpidp__coll_claim(x, what, &slot)) != MPIDP_OK) return rc;
    /* Set before the request exists, so that whichever thread completes it
     * writes the sender. */
    mpidp_reqtable_set_source(reqs, slot, &x->source);
    MPI_Request req;
    rc = MPI_Irecv(t->data, (int)bytes, MPI_BYTE, peer < 0 ? MPI_ANY_SOURCE : peer, tag, comm, &req);
    return mpidp__coll_post_done(x, slot, rc, req, comm, what, out);
}
