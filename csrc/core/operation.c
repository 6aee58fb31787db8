/* Running any engine's operation to its end (see mpidp/operation.h). */
#include "mpidp/operation.h"

#include <stdio.h>

#include "mpidp/status.h"

int mpidp_operation_finish(const mpidp_operation_t *ops, void *op, double timeout_s, int *ended)
{
    if (ended) *ended = 0;
    if (ops == NULL || op == NULL || ended == NULL)
        return mpidp__fail(MPIDP_EINVAL, "operation: NULL argument");
    int rc = ops->wait(op, timeout_s);
    if (rc == MPIDP_ETIMEDOUT) return rc; /* still in flight: MPI may write its buffers */
    /* The wait's failure is the one to report: keep its detail, which a
     * failing free would overwrite. */
    char detail[256];
    snprintf(detail, sizeof detail, "%s", mpidp_error_detail());
    int frc = ops->free(op);
    *ended = frc == MPIDP_OK;
    if (rc != MPIDP_OK) return mpidp__fail(rc, "%s", detail);
    return frc;
}
