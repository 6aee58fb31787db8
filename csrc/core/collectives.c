/* Broadcast, allgather and barrier (see mpidp/collectives.h). */
#include "mpidp/collectives.h"

#include <limits.h>
#include <stdio.h>

#include "mpidp/mpi_util.h"
#include "mpidp/status.h"

/* The bytes of `t` as one MPI count (int), or MPIDP_EINVAL naming `what`. */
static int byte_count(const mpidp_tensor_t *t, const char *what, size_t *bytes)
{
    size_t esize = mpidp_dtype_size(t->dtype);
    if (esize == 0 || t->numel > (size_t)INT_MAX / esize)
        return mpidp__fail(MPIDP_EINVAL, "%s: %zu elements is too many for one MPI call", what,
                           t->numel);
    *bytes = t->numel * esize;
    return MPIDP_OK;
}

static int comm_size(MPI_Comm comm, int *size)
{
    int rc = MPI_Comm_size(comm, size);
    return rc == MPI_SUCCESS ? MPIDP_OK : mpidp__mpi_fail(rc, "MPI_Comm_size");
}

int mpidp_bcast_start(MPI_Comm comm, const mpidp_tensor_t *t, int root, mpidp_reqtable_t *reqs,
                      mpidp_req_t *out)
{
    if (t == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "bcast: NULL argument");
    size_t bytes = 0;
    int size = 0, rc = byte_count(t, "bcast", &bytes);
    if (rc == MPIDP_OK) rc = comm_size(comm, &size);
    if (rc != MPIDP_OK) return rc;
    if (root < 0 || root >= size)
        return mpidp__fail(MPIDP_EINVAL, "bcast: root %d is not a rank of a %d-process communicator",
                           root, size);
    *out = MPIDP_REQ_NONE;
    if (size == 1 || t->numel == 0) return MPIDP_OK;
    /* Bytes, not elements: a broadcast needs no arithmetic, so any dtype goes. */
    char what[MPIDP_REQ_WHAT_LEN];
    snprintf(what, sizeof what, "MPI_Ibcast of %zu %s from rank %d", t->numel,
             mpidp_dtype_name(t->dtype), root);
    mpidp_req_t slot;
    rc = mpidp_reqtable_claim(reqs, what, &slot);
    if (rc != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Ibcast(t->data, (int)bytes, MPI_BYTE, root, comm, &req);
    return mpidp__post_done(reqs, slot, rc, req, what, out);
}

int mpidp_allgather_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                          mpidp_reqtable_t *reqs, mpidp_req_t *out)
{
    if (send == NULL || recv == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "allgather: NULL argument");
    size_t bytes = 0;
    int size = 0, rc = byte_count(send, "allgather", &bytes);
    if (rc == MPIDP_OK) rc = comm_size(comm, &size);
    if (rc != MPIDP_OK) return rc;
    if (recv->dtype != send->dtype || recv->numel != (size_t)size * send->numel)
        return mpidp__fail(MPIDP_EINVAL, "allgather: the result must hold %d x %zu %s elements, "
                           "got %zu %s", size, send->numel, mpidp_dtype_name(send->dtype),
                           recv->numel, mpidp_dtype_name(recv->dtype));
    const char *s = send->data, *r = recv->data;
    if (bytes && s < r + (size_t)size * bytes && r < s + bytes)
        return mpidp__fail(MPIDP_EINVAL, "allgather: the result overlaps the input");
    *out = MPIDP_REQ_NONE;
    if (bytes == 0) return MPIDP_OK;
    char what[MPIDP_REQ_WHAT_LEN];
    snprintf(what, sizeof what, "MPI_Iallgather of %zu %s per rank", send->numel,
             mpidp_dtype_name(send->dtype));
    mpidp_req_t slot;
    rc = mpidp_reqtable_claim(reqs, what, &slot);
    if (rc != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Iallgather(send->data, (int)bytes, MPI_BYTE, recv->data, (int)bytes, MPI_BYTE, comm,
                        &req);
    return mpidp__post_done(reqs, slot, rc, req, what, out);
}

int mpidp_barrier_start(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_req_t *out)
{
    if (reqs == NULL || out == NULL) return mpidp__fail(MPIDP_EINVAL, "barrier: NULL argument");
    mpidp_req_t slot;
    int rc = mpidp_reqtable_claim(reqs, "MPI_Ibarrier", &slot);
    if (rc != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Ibarrier(comm, &req);
    return mpidp__post_done(reqs, slot, rc, req, "MPI_Ibarrier", out);
}
