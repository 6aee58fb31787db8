/* Broadcast and barrier (see mpidp/collectives.h). */
#include "mpidp/collectives.h"

#include <limits.h>
#include <stdio.h>

#include "mpidp/status.h"

static int mpi_fail(int rc, const char *call)
{
    char msg[MPI_MAX_ERROR_STRING];
    return mpidp__fail(MPIDP_EMPI, "%s: %s", call, mpidp__mpi_errstr(rc, msg, sizeof msg));
}

static int comm_size(MPI_Comm comm, int *size)
{
    int rc = MPI_Comm_size(comm, size);
    return rc == MPI_SUCCESS ? MPIDP_OK : mpi_fail(rc, "MPI_Comm_size");
}

static int register_req(mpidp_reqtable_t *reqs, MPI_Request req, const char *what, mpidp_req_t *out)
{
    int rc = mpidp_reqtable_add(reqs, req, what, out);
    if (rc != MPIDP_OK) {
        /* No slot to track it: complete it here rather than lose it. */
        MPI_Wait(&req, MPI_STATUS_IGNORE);
        *out = MPIDP_REQ_NONE;
    }
    return MPIDP_OK;
}

int mpidp_bcast_start(MPI_Comm comm, const mpidp_tensor_t *t, int root, mpidp_reqtable_t *reqs,
                      mpidp_req_t *out)
{
    if (t == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "bcast: NULL argument");
    size_t esize = mpidp_dtype_size(t->dtype);
    if (esize == 0 || t->numel > (size_t)INT_MAX / esize)
        return mpidp__fail(MPIDP_EINVAL, "bcast: %zu elements is too many", t->numel);
    int size, rc = comm_size(comm, &size);
    if (rc != MPIDP_OK) return rc;
    if (root < 0 || root >= size)
        return mpidp__fail(MPIDP_EINVAL, "bcast: root %d is not a rank of a %d-process communicator",
                           root, size);
    *out = MPIDP_REQ_NONE;
    if (size == 1 || t->numel == 0) return MPIDP_OK;
    /* Bytes, not elements: a broadcast needs no arithmetic, so any dtype goes. */
    MPI_Request req;
    rc = MPI_Ibcast(t->data, (int)(t->numel * esize), MPI_BYTE, root, comm, &req);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Ibcast");
    char what[MPIDP_REQ_WHAT_LEN];
    snprintf(what, sizeof what, "MPI_Ibcast of %zu %s from rank %d", t->numel,
             mpidp_dtype_name(t->dtype), root);
    return register_req(reqs, req, what, out);
}

int mpidp_barrier_start(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_req_t *out)
{
    if (reqs == NULL || out == NULL) return mpidp__fail(MPIDP_EINVAL, "barrier: NULL argument");
    MPI_Request req;
    int rc = MPI_Ibarrier(comm, &req);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Ibarrier");
    return register_req(reqs, req, "MPI_Ibarrier", out);
}
