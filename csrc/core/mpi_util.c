/* MPI posting and failure reporting (see mpidp/mpi_util.h). */
#include "mpidp/mpi_util.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>

#include "mpidp/mpiops.h"
#include "mpidp/status.h"

/* The message of an MPI error code ("MPI_ERR_TRUNCATE: ..."). */
static const char *mpi_errstr(int code, char *buf, size_t len)
{
    char msg[MPI_MAX_ERROR_STRING];
    int n = 0;
    if (MPI_Error_string(code, msg, &n) != MPI_SUCCESS) snprintf(msg, sizeof msg, "MPI error %d", code);
    snprintf(buf, len, "%s", msg);
    return buf;
}

int mpidp__mpi_fail(int mpi_rc, const char *fmt, ...)
{
    char context[256], msg[MPI_MAX_ERROR_STRING];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(context, sizeof context, fmt, ap);
    va_end(ap);
    return mpidp__fail(MPIDP_EMPI, "%s: %s", context, mpi_errstr(mpi_rc, msg, sizeof msg));
}

int mpidp__post_done(mpidp_reqtable_t *reqs, mpidp_req_t slot, int mpi_rc, MPI_Request req,
                     const char *what, mpidp_req_t *out)
{
    if (mpi_rc != MPI_SUCCESS) {
        mpidp_reqtable_unclaim(reqs, slot);
        return mpidp__mpi_fail(mpi_rc, "%s", what);
    }
    mpidp_reqtable_fill(reqs, slot, req, what);
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
    return mpidp__post_done(reqs, slot, rc, req, what, out);
}
