/* Whether the ranks passed the same signature (see mpidp/agree.h). */
#include "mpidp/agree.h"

#include <stdlib.h>

#include "mpi_util.h"
#include "post.h"
#include "mpidp/mpiops.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "fail.h"

int mpidp_agree(MPI_Comm comm, const int64_t *sig, size_t n, mpidp_reqtable_t *reqs,
                double timeout_s, int *agreed)
{
    if (sig == NULL || reqs == NULL || agreed == NULL || n == 0 || n > MPIDP_AGREE_MAX_FIELDS)
        return mpidp__fail(MPIDP_EINVAL, "agreement: expected 1 .. %d fields, got %zu",
                           MPIDP_AGREE_MAX_FIELDS, n);
    for (size_t i = 0; i < n; i++)
        if (sig[i] == INT64_MIN)
            return mpidp__fail(MPIDP_EINVAL, "agreement: field %zu is INT64_MIN, whose negation "
                               "does not exist", i);
    /* On the heap: a wait that passes its deadline leaves the allreduce
     * posted, and MPI may write the buffer whenever the late rank comes. */
    int64_t *both = malloc(2 * n * sizeof *both);
    if (both == NULL) return mpidp__fail(MPIDP_ENOMEM, "agreement: out of memory");
    for (size_t i = 0; i < n; i++) {
        both[i] = sig[i];
        both[n + i] = -sig[i];
    }
    mpidp_req_t req;
    int rc = mpidp__post_iallreduce(comm, reqs, both, 2 * n, MPIDP_OP_MAX, MPIDP_I64,
                                    "agreement of the ranks' arguments (MPI_Iallreduce)", &req);
    if (rc == MPIDP_OK) rc = mpidp_reqtable_wait(reqs, req, timeout_s);
    if (rc != MPIDP_OK) {
        if (!mpidp_left_in_flight(rc)) free(both); /* else MPI may still write it: leaked */
        return rc;
    }
    *agreed = 1;
    for (size_t i = 0; i < n; i++)
        if (both[i] != -both[n + i]) *agreed = 0;
    free(both);
    return MPIDP_OK;
}
