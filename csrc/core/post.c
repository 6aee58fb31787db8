/* Posting a non-blocking MPI operation into the request table (post.h). */
#include "post.h"

#include <limits.h>

#include "fail.h"
#include "mpi_util.h"
#include "mpidp/ft.h"
#include "mpidp/mpiops.h"
#include "mpidp/status.h"

int mpidp__post_done(mpidp_reqtable_t *reqs, mpidp_req_t slot, int mpi_rc, MPI_Request req,
                     MPI_Comm comm, const char *what, mpidp_req_t *out)
{
    if (mpi_rc != MPI_SUCCESS) {
        mpidp_reqtable_unclaim(reqs, slot);
        /* Open MPI's non-blocking collectives can refuse to start, with
         * MPI_ERR_OTHER, on a communicator whose peer just died: under
         * fault tolerance that is the peer's failure (as at completion). */
        return mpidp__mpi_fail(mpidp_ft_classify(mpi_rc, comm), "%s", what);
    }
    mpidp_reqtable_fill(reqs, slot, req, comm, what);
    if (out) *out = slot;
    return MPIDP_OK;
}

int mpidp__post_iallreduce(MPI_Comm comm, mpidp_reqtable_t *reqs, void *buf, size_t count, int op,
                           int dtype, const char *what, mpidp_req_t *out)
{
    if (count > (size_t)INT_MAX)
        return mpidp__fail(MPIDP_EINVAL, "%s: %zu elements exceed one MPI call's count", what, count);
    mpidp_req_t slot;
    int rc = mpidp_reqtable_claim(reqs, what, &slot);
    if (rc != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, mpidp_mpi_datatype(dtype),
                        mpidp_mpi_op(op, dtype), comm, &req);
    return mpidp__post_done(reqs, slot, rc, req, comm, what, out);
}
