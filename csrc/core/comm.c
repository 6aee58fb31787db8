/* mpidp's duplicate of a user's communicator (see mpidp/comm.h). */
#include "mpidp/comm.h"

#include "mpi_util.h"
#include "post.h"
#include "mpidp/ft.h"
#include "mpidp/status.h"
#include "fail.h"

int mpidp_comm_dup(MPI_Comm user, mpidp_reqtable_t *reqs, double timeout_s, MPI_Comm *out,
                   int *rank, int *size, int *in_flight)
{
    if (reqs == NULL || out == NULL || rank == NULL || size == NULL || in_flight == NULL)
        return mpidp__fail(MPIDP_EINVAL, "comm_dup: NULL argument");
    *out = MPI_COMM_NULL;
    *in_flight = 0;
    const char *what = "MPI_Comm_idup (creating mpidp's communicator)";
    mpidp_req_t handle = MPIDP_REQ_NONE;
    int st = mpidp_reqtable_claim(reqs, what, &handle);
    if (st != MPIDP_OK) return st;
    MPI_Request req;
    int rc = MPI_Comm_idup(user, out, &req);
    if ((st = mpidp__post_done(reqs, handle, rc, req, user, what, &handle)) != MPIDP_OK) return st;
    if ((st = mpidp_reqtable_wait(reqs, handle, timeout_s)) != MPIDP_OK) {
        *in_flight = st == MPIDP_ETIMEDOUT || st == MPIDP_EDEPARTED;
        return st;
    }
    rc = MPI_Comm_set_errhandler(*out, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(*out, rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(*out, size);
    if (rc != MPI_SUCCESS) {
        MPI_Comm_free(out);
        return mpidp__mpi_fail(rc, "setting up mpidp's communicator");
    }
    mpidp_ft_track(*out);
    return MPIDP_OK;
}

void mpidp_comm_free(MPI_Comm *c)
{
    if (c == NULL || *c == MPI_COMM_NULL) return;
    mpidp_ft_untrack(*c);
    if (!mpidp_mpi_finalized()) MPI_Comm_free(c);
}
