/* Running any engine's operation to its end (see mpidp/operation.h). */
#include "mpidp/operation.h"

#include <stdio.h>

#include "mpidp/status.h"
#include "fail.h"

int mpidp_operation_finish(const mpidp_operation_t *ops, void *op, double timeout_s, int *ended)
{
    if (ended) *ended = 0;
    if (ops == NULL || op == NULL || ended == NULL)
        return mpidp__fail(MPIDP_EINVAL, "operation: NULL argument");
    int rc = ops->wait(op, timeout_s);
    if (mpidp_left_in_flight(rc)) return rc; /* MPI may still write its buffers */
    /* The wait's failure is the one to report: keep its detail, which a
     * failing free would overwrite. */
    char detail[256];
    snprintf(detail, sizeof detail, "%s", mpidp_error_detail());
    int frc = ops->free(op);
    *ended = frc == MPIDP_OK;
    if (rc != MPIDP_OK) return mpidp__fail(rc, "%s", detail);
    return frc;
}

/* The operation ended with `status`: free it (a part still in flight, which
 * the free refuses, keeps it and its buffers). */
static void ended(mpidp_handle_t *h, int status)
{
    h->done = 1;
    h->status = status;
    if (h->ops->free(h->op) == MPIDP_OK) h->op = NULL;
}

void mpidp_handle_init(mpidp_handle_t *h, const mpidp_operation_t *ops, void *op)
{
    *h = (mpidp_handle_t){.ops = ops, .op = op, .done = 0, .status = MPIDP_OK};
}

int mpidp_handle_wait(mpidp_handle_t *h, double timeout_s)
{
    if (h->done) {
        if (h->status == MPIDP_OK) return MPIDP_OK;
        return mpidp__fail(h->status, "the operation failed when it was first waited for");
    }
    int rc = h->ops->wait(h->op, timeout_s);
    if (!mpidp_left_in_flight(rc)) ended(h, rc);
    return rc;
}

int mpidp_handle_test(mpidp_handle_t *h, int *done)
{
    int rc = MPIDP_OK;
    if (!h->done) {
        int complete = 0;
        rc = h->ops->test(h->op, &complete);
        if (complete || rc != MPIDP_OK) ended(h, rc);
    }
    *done = h->done;
    return rc;
}

int mpidp_handle_drop(mpidp_handle_t *h, double timeout_s)
{
    if (h->op == NULL) return MPIDP_OK;
    int freed = 0;
    int rc = mpidp_operation_finish(h->ops, h->op, timeout_s, &freed);
    if (freed) h->op = NULL;
    return rc;
}
