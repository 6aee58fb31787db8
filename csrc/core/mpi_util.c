/* MPI posting and failure reporting (see mpidp/mpi_util.h). */
#include "mpidp/mpi_util.h"

#include <stdarg.h>
#include <stdio.h>

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
