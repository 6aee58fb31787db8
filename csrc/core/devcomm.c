/* Device collectives (mpidp/devcomm.h): the communicator, MPI and the stand-in, and
 * the generalized requests that put NCCL's operations in the request table.
 * The NCCL and CUDA runtime entry points are devcomm_nccl.c's. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "devcomm_internal.h"
#include "fail.h"
#include "mpi_util.h"
#include "post.h"
#include "mpidp/mpiops.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"

static void standin_land(mpidp_devcomm_t *dc, mpidp_req_t h);
static void set_failed(mpidp_devcomm_t *dc, int status, const char *detail);
static int status_locked(const mpidp_devcomm_t *dc);
static int nccl_start_locked(mpidp_devcomm_t *dc, const mpidp_devop_t *op, void *stream,
                             const char *what, mpidp_req_t *out);

/* --- generalized requests: MPI learns of an NCCL operation's end here ----- */

static int greq_query(void *extra, MPI_Status *status)
{
    (void)extra;
    MPI_Status_set_elements(status, MPI_BYTE, 0);
    MPI_Status_set_cancelled(status, 0);
    status->MPI_SOURCE = MPI_UNDEFINED;
    status->MPI_TAG = MPI_UNDEFINED;
    /* A failed operation still completes here: devcomm_wait reports its error,
     * which MPI's error handlers would otherwise turn into an abort. */
    return MPI_SUCCESS;
}

static int greq_free(void *extra) { (void)extra; return MPI_SUCCESS; }
static int greq_cancel(void *extra, int complete) { (void)extra, (void)complete; return MPI_SUCCESS; }

/* Completes pending op k (its request now tests as done) and drops it. */
static void complete_op(mpidp_devcomm_t *dc, size_t k)
{
    MPI_Grequest_complete(dc->ops[k].greq);
    mpidp__nccl_event_release(dc, dc->ops[k].event);
    dc->ops[k] = dc->ops[--dc->n_ops];
}

static void fail_all(mpidp_devcomm_t *dc)
{
    while (dc->n_ops > 0) complete_op(dc, dc->n_ops - 1);
}

/* Ends NCCL's work and completes every request; `mu` held. */
static void abort_locked(mpidp_devcomm_t *dc)
{
    dc->aborted = 1;
    if (dc->kind == MPIDP_DEVCOMM_NCCL) mpidp__nccl_abort(dc);
    fail_all(dc);
}

/* The request table's engine: completes the operations whose events have
 * passed, and all of them once NCCL reported an error or the watchdog
 * aborted (after aborting). */
static void engine(void *ctx)
{
    mpidp_devcomm_t *dc = ctx;
    pthread_mutex_lock(&dc->mu);
    if (dc->aborted) fail_all(dc);
    for (size_t k = 0; k < dc->n_ops;) {
        int passed = mpidp__nccl_event_passed(dc, dc->ops[k].event);
        if (passed < 0) { /* nothing in flight can be trusted */
            set_failed(dc, MPIDP_ECUDA, mpidp_error_detail());
            abort_locked(dc);
            break;
        }
        if (passed) complete_op(dc, k);
        else k++;
    }
    if (dc->n_ops > 0 && mpidp__nccl_async_error(dc)) {
        set_failed(dc, MPIDP_ECUDA, mpidp_error_detail());
        abort_locked(dc);
    }
    pthread_mutex_unlock(&dc->mu);
}

/* The watchdog thread (NCCL): every 100 ms, an operation older than the
 * deadline, or an error NCCL reported, aborts the NCCL communicator so that
 * the device work queued behind it ends; the failure is raised by the next
 * call that reads the communicator's state. */
static void *watchdog(void *arg)
{
    mpidp_devcomm_t *dc = arg;
    for (;;) {
        struct timespec tick = {0, 100000000};
        nanosleep(&tick, NULL);
        pthread_mutex_lock(&dc->mu);
        if (dc->stop) {
            pthread_mutex_unlock(&dc->mu);
            return NULL;
        }
        if (!dc->aborted && dc->n_ops > 0) {
            double now = mpidp_now();
            for (size_t k = 0; k < dc->n_ops; k++) {
                if (dc->timeout_s <= 0 || now - dc->ops[k].started <= dc->timeout_s) continue;
                if (mpidp__nccl_event_passed(dc, dc->ops[k].event) != 0) continue;
                char detail[200];
                snprintf(detail, sizeof detail, "a device collective (NCCL) did not finish within "
                         "%.1f s (MPIDP_TIMEOUT): a rank is stuck or gone; NCCL was aborted",
                         dc->timeout_s);
                set_failed(dc, MPIDP_ETIMEDOUT, detail);
                break;
            }
            if (dc->fail_status == MPIDP_OK && mpidp__nccl_async_error(dc))
                set_failed(dc, MPIDP_ECUDA, mpidp_error_detail());
            if (dc->fail_status != MPIDP_OK) {
                dc->aborted = 1;
                mpidp__nccl_abort(dc); /* the requests are the engine's to complete (MPI) */
            }
        }
        pthread_mutex_unlock(&dc->mu);
    }
}

/* --- the communicator ------------------------------------------------------ */

static int alloc_devcomm(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_devcomm_kind_t kind,
                         mpidp_devcomm_t **out)
{
    mpidp_devcomm_t *dc = calloc(1, sizeof *dc);
    if (dc == NULL) return mpidp__fail(MPIDP_ENOMEM, "device communicator");
    dc->kind = kind;
    pthread_mutex_init(&dc->mu, NULL);
    dc->comm = comm;
    dc->reqs = reqs;
    MPI_Comm_rank(comm, &dc->rank);
    MPI_Comm_size(comm, &dc->size);
    *out = dc;
    return MPIDP_OK;
}

int mpidp_devcomm_create_nccl(MPI_Comm comm, mpidp_reqtable_t *reqs, const char *nccl_path,
                              const char *cudart_path, int device, double timeout_s,
                              mpidp_devcomm_t **out)
{
    if (reqs == NULL || out == NULL || nccl_path == NULL || cudart_path == NULL)
        return mpidp__fail(MPIDP_EINVAL, "device communicator: NULL argument");
    mpidp_devcomm_t *dc = NULL;
    int rc = alloc_devcomm(comm, reqs, MPIDP_DEVCOMM_NCCL, &dc);
    if (rc != MPIDP_OK) return rc;
    dc->timeout_s = timeout_s;
    rc = mpidp__nccl_open(dc, nccl_path, cudart_path, device, timeout_s);
    if (rc == MPIDP_OK && (rc = mpidp_reqtable_engine_add(reqs, engine, dc)) == MPIDP_OK)
        dc->engine_added = 1;
    if (rc == MPIDP_OK) {
        if (pthread_create(&dc->watchdog, NULL, watchdog, dc) == 0) dc->watchdog_running = 1;
        else rc = mpidp__fail(MPIDP_ENOMEM, "device communicator: no watchdog thread");
    }
    if (rc != MPIDP_OK) {
        char detail[256];
        snprintf(detail, sizeof detail, "%s", mpidp_error_detail());
        mpidp_devcomm_abort(dc);
        mpidp_devcomm_destroy(dc, 0);
        return mpidp__fail(rc, "%s", detail);
    }
    *out = dc;
    return MPIDP_OK;
}

int mpidp_devcomm_create_standin(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_devcomm_t **out)
{
    if (reqs == NULL || out == NULL) return mpidp__fail(MPIDP_EINVAL, "device communicator: NULL");
    return alloc_devcomm(comm, reqs, MPIDP_DEVCOMM_STANDIN, out);
}

int mpidp_devcomm_create_mpi(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_devcomm_t **out)
{
    if (reqs == NULL || out == NULL) return mpidp__fail(MPIDP_EINVAL, "device communicator: NULL");
    return alloc_devcomm(comm, reqs, MPIDP_DEVCOMM_MPI, out);
}

mpidp_devcomm_kind_t mpidp_devcomm_kind(const mpidp_devcomm_t *dc) { return dc->kind; }

int mpidp_devcomm_version(const mpidp_devcomm_t *dc) { return dc->nccl_version; }

int mpidp_devcomm_aborted(const mpidp_devcomm_t *dc) { return dc != NULL && dc->aborted; }

static void set_failed(mpidp_devcomm_t *dc, int status, const char *detail)
{
    if (dc->fail_status != MPIDP_OK) return;
    dc->fail_status = status;
    snprintf(dc->fail_detail, sizeof dc->fail_detail, "%s", detail);
}

int mpidp_devcomm_wait(mpidp_devcomm_t *dc, mpidp_req_t req, double timeout_s)
{
    if (dc == NULL) return mpidp__fail(MPIDP_EINVAL, "device communicator: NULL");
    int rc = mpidp_reqtable_wait(dc->reqs, req, timeout_s);
    if (rc != MPIDP_OK) {
        /* The detail (what was pending) is the wait's; the device work queued
         * behind the operation must not hang on it. */
        pthread_mutex_lock(&dc->mu);
        set_failed(dc, rc, "an earlier device collective failed or timed out");
        abort_locked(dc);
        pthread_mutex_unlock(&dc->mu);
        return rc;
    }
    rc = mpidp_devcomm_status(dc);
    if (rc == MPIDP_OK && dc->kind == MPIDP_DEVCOMM_STANDIN) standin_land(dc, req);
    return rc;
}

/* Room for one more of `n` items of `size` bytes in *items (capacity *cap). */
static int reserve(void **items, size_t *cap, size_t n, size_t size, const char *what)
{
    if (n < *cap) return MPIDP_OK;
    size_t grown = *cap ? 2 * *cap : 16;
    void *p = realloc(*items, grown * size);
    if (p == NULL) return mpidp__fail(MPIDP_ENOMEM, "%s: operation list", what);
    *items = p;
    *cap = grown;
    return MPIDP_OK;
}

/* The MPI operation of `op` on host or device buffers, posted into the
 * table; send == recv (or NULL) runs it in place: ALLGATHER then finds this
 * rank's block in recv, REDUCE_SCATTER its input in recv, the result at its
 * start. */
static int post_mpi(mpidp_devcomm_t *dc, const mpidp_devop_t *op, const char *what,
                    mpidp_req_t *out)
{
    if (op->kind == MPIDP_DEVOP_ALLREDUCE && op->send == op->recv)
        return mpidp__post_iallreduce(dc->comm, dc->reqs, op->recv, op->count, op->op, op->dtype,
                                      what, out);
    mpidp_req_t slot;
    int rc = mpidp_reqtable_claim(dc->reqs, what, &slot);
    if (rc != MPIDP_OK) return rc;
    const void *send = op->send == NULL || op->send == op->recv ? MPI_IN_PLACE : op->send;
    MPI_Datatype type = mpidp_mpi_datatype(op->dtype);
    int n = (int)op->count;
    MPI_Request req;
    int mrc = MPI_ERR_ARG;
    switch (op->kind) {
    case MPIDP_DEVOP_ALLREDUCE:
        mrc = MPI_Iallreduce(send, op->recv, n, type, mpidp_mpi_op(op->op, op->dtype), dc->comm,
                             &req);
        break;
    case MPIDP_DEVOP_BCAST: mrc = MPI_Ibcast(op->recv, n, type, op->root, dc->comm, &req); break;
    case MPIDP_DEVOP_ALLGATHER:
        mrc = MPI_Iallgather(send, send == MPI_IN_PLACE ? 0 : n, type, op->recv, n, type,
                             dc->comm, &req);
        break;
    case MPIDP_DEVOP_REDUCE_SCATTER:
        mrc = MPI_Ireduce_scatter_block(send, op->recv, n, type, mpidp_mpi_op(op->op, op->dtype),
                                        dc->comm, &req);
        break;
    }
    return mpidp__post_done(dc->reqs, slot, mrc, req, dc->comm, what, out);
}

/* Elements of `op`'s input and output (mpidp_devop_t's table). */
static size_t input_count(const mpidp_devcomm_t *dc, const mpidp_devop_t *op)
{
    return op->kind == MPIDP_DEVOP_REDUCE_SCATTER ? op->count * (size_t)dc->size : op->count;
}

static size_t output_count(const mpidp_devcomm_t *dc, const mpidp_devop_t *op)
{
    return op->kind == MPIDP_DEVOP_ALLGATHER ? op->count * (size_t)dc->size : op->count;
}

/* The stand-in: MPI runs `op` in place on a private copy (the shadow, as
 * large as the bigger side), which lands in recv only at the wait. */
static int standin_start(mpidp_devcomm_t *dc, const mpidp_devop_t *op, const char *what,
                         mpidp_req_t *out)
{
    int rc = reserve((void **)&dc->sops, &dc->cap_sops, dc->n_sops, sizeof *dc->sops, what);
    if (rc != MPIDP_OK) return rc;
    size_t elem = mpidp_dtype_size(op->dtype);
    size_t in = input_count(dc, op), outn = output_count(dc, op);
    size_t bytes = (in > outn ? in : outn) * elem;
    char *shadow = malloc(bytes ? bytes : 1);
    if (shadow == NULL) return mpidp__fail(MPIDP_ENOMEM, "%s: stand-in buffer", what);
    if (op->kind == MPIDP_DEVOP_ALLGATHER)
        memcpy(shadow + (size_t)dc->rank * op->count * elem, op->send, op->count * elem);
    else if (op->kind == MPIDP_DEVOP_BCAST)
        memcpy(shadow, op->recv, op->count * elem);
    else
        memcpy(shadow, op->send, in * elem);
    mpidp_devop_t in_place = *op;
    in_place.send = in_place.recv = shadow;
    rc = post_mpi(dc, &in_place, what, out);
    if (rc != MPIDP_OK) {
        free(shadow);
        return rc;
    }
    dc->sops[dc->n_sops++] = (mpidp__standin_op_t){.h = *out, .buf = op->recv, .shadow = shadow,
                                                   .bytes = outn * elem};
    return MPIDP_OK;
}

/* Refuses what no transport can run, before anything is posted. */
static int check_op(const mpidp_devcomm_t *dc, const mpidp_devop_t *op, const char *what)
{
    int reduces = op->kind == MPIDP_DEVOP_ALLREDUCE || op->kind == MPIDP_DEVOP_REDUCE_SCATTER;
    if (op->kind < MPIDP_DEVOP_ALLREDUCE || op->kind > MPIDP_DEVOP_REDUCE_SCATTER)
        return mpidp__fail(MPIDP_EINVAL, "%s: no device collective of kind %d", what, (int)op->kind);
    if ((op->recv == NULL || (op->send == NULL && op->kind != MPIDP_DEVOP_BCAST)) && op->count > 0)
        return mpidp__fail(MPIDP_EINVAL, "%s: NULL buffer", what);
    if (op->kind == MPIDP_DEVOP_BCAST && (op->root < 0 || op->root >= dc->size))
        return mpidp__fail(MPIDP_EINVAL, "%s: root %d of a group of %d", what, op->root, dc->size);
    if (reduces && op->op != MPIDP_OP_SUM && op->op != MPIDP_OP_PROD && op->op != MPIDP_OP_MIN &&
        op->op != MPIDP_OP_MAX)
        return mpidp__fail(MPIDP_EINVAL, "%s: a device reduction takes sum, product, min or max "
                           "(op %d)", what, op->op);
    if (dc->kind != MPIDP_DEVCOMM_NCCL && reduces && mpidp_mpi_op(op->op, op->dtype) == MPI_OP_NULL)
        return mpidp__fail(MPIDP_EDTYPE, "%s: MPI has no op %d of %s (NCCL has)", what, op->op,
                           mpidp_dtype_name(op->dtype));
    if (dc->kind != MPIDP_DEVCOMM_NCCL && input_count(dc, op) > (size_t)INT_MAX / 2 + 1)
        return mpidp__fail(MPIDP_EINVAL, "%s: %zu elements exceed one MPI call's count", what,
                           input_count(dc, op));
    return MPIDP_OK;
}

/* The stand-in's sum h has completed: it lands in the caller's buffer. */
static void standin_land(mpidp_devcomm_t *dc, mpidp_req_t h)
{
    for (size_t k = 0; k < dc->n_sops; k++) {
        mpidp__standin_op_t *op = &dc->sops[k];
        if (op->h.slot != h.slot || op->h.gen != h.gen) continue;
        memcpy(op->buf, op->shadow, op->bytes);
        free(op->shadow);
        *op = dc->sops[--dc->n_sops];
        return;
    }
}

int mpidp_devcomm_start(mpidp_devcomm_t *dc, const mpidp_devop_t *op, void *stream,
                        const char *what, mpidp_req_t *out)
{
    if (dc == NULL || op == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "device collective: NULL argument");
    int rc = check_op(dc, op, what);
    if (rc != MPIDP_OK) return rc;
    if (dc->kind != MPIDP_DEVCOMM_NCCL) {
        if ((rc = mpidp_devcomm_status(dc)) != MPIDP_OK) return rc;
        return dc->kind == MPIDP_DEVCOMM_STANDIN ? standin_start(dc, op, what, out)
                                                 : post_mpi(dc, op, what, out);
    }
    pthread_mutex_lock(&dc->mu);
    rc = nccl_start_locked(dc, op, stream, what, out);
    pthread_mutex_unlock(&dc->mu);
    return rc;
}

int mpidp_devcomm_allreduce_start(mpidp_devcomm_t *dc, void *buf, size_t count, int dtype,
                                  void *stream, const char *what, mpidp_req_t *out)
{
    mpidp_devop_t op = {.kind = MPIDP_DEVOP_ALLREDUCE, .send = buf, .recv = buf, .count = count,
                        .dtype = dtype, .op = MPIDP_OP_SUM};
    return mpidp_devcomm_start(dc, &op, stream, what, out);
}

/* mpidp_devcomm_start for NCCL, `mu` held. */
static int nccl_start_locked(mpidp_devcomm_t *dc, const mpidp_devop_t *op, void *stream,
                             const char *what, mpidp_req_t *out)
{
    int rc = status_locked(dc);
    if (rc == MPIDP_OK) rc = reserve((void **)&dc->ops, &dc->cap_ops, dc->n_ops, sizeof *dc->ops, what);
    if (rc != MPIDP_OK) return rc;
    mpidp_req_t slot;
    rc = mpidp_reqtable_claim(dc->reqs, what, &slot);
    if (rc != MPIDP_OK) return rc;
    void *event = NULL;
    rc = mpidp__nccl_collective(dc, op, stream, what, &event);
    if (rc != MPIDP_OK) {
        mpidp_reqtable_unclaim(dc->reqs, slot);
        return rc;
    }
    MPI_Request greq;
    int mrc = MPI_Grequest_start(greq_query, greq_free, greq_cancel, NULL, &greq);
    if (mrc != MPI_SUCCESS) {
        mpidp__nccl_event_release(dc, event);
        mpidp_reqtable_unclaim(dc->reqs, slot);
        return mpidp__mpi_fail(mrc, "%s: MPI_Grequest_start", what);
    }
    dc->ops[dc->n_ops++] = (mpidp__devop_t){.greq = greq, .event = event, .started = mpidp_now()};
    /* MPI_COMM_SELF: a generalized request waits for no other rank, so the
     * table's departure checks must not hold it for a departed one. */
    mpidp_reqtable_fill(dc->reqs, slot, greq, MPI_COMM_SELF, what);
    *out = slot;
    return MPIDP_OK;
}

void mpidp_devcomm_abort(mpidp_devcomm_t *dc)
{
    if (dc == NULL) return;
    pthread_mutex_lock(&dc->mu);
    if (!dc->aborted || dc->n_ops > 0) abort_locked(dc);
    pthread_mutex_unlock(&dc->mu);
}

/* mpidp_devcomm_status, `mu` held. */
static int status_locked(const mpidp_devcomm_t *dc)
{
    if (!dc->aborted) return MPIDP_OK;
    return mpidp__fail(dc->fail_status != MPIDP_OK ? dc->fail_status : MPIDP_ESTATE,
                       "the device communicator was aborted: %s",
                       dc->fail_detail[0] ? dc->fail_detail : "by its owner");
}

int mpidp_devcomm_status(mpidp_devcomm_t *dc)
{
    if (dc == NULL) return mpidp__fail(MPIDP_EINVAL, "device communicator: NULL");
    pthread_mutex_lock(&dc->mu);
    int rc = status_locked(dc);
    pthread_mutex_unlock(&dc->mu);
    return rc;
}

void mpidp_devcomm_destroy(mpidp_devcomm_t *dc, double timeout_s)
{
    if (dc == NULL) return;
    if (dc->watchdog_running) {
        pthread_mutex_lock(&dc->mu);
        dc->stop = 1;
        pthread_mutex_unlock(&dc->mu);
        pthread_join(dc->watchdog, NULL);
    }
    if (dc->kind == MPIDP_DEVCOMM_NCCL && !dc->aborted && dc->n_ops > 0 && !mpidp_mpi_finalized()) {
        int rc = mpidp_reqtable_wait_all(dc->reqs, timeout_s);
        if (rc != MPIDP_OK || dc->n_ops > 0) mpidp_devcomm_abort(dc);
    }
    if (dc->n_sops > 0 && !mpidp_mpi_finalized()) {
        /* Sums nobody waited for: MPI must be done with their copies first. */
        int rc = mpidp_reqtable_wait_all(dc->reqs, timeout_s);
        if (rc != MPIDP_OK) dc->sops = NULL, dc->n_sops = 0; /* leaked: MPI may still write */
    }
    for (size_t k = 0; k < dc->n_sops; k++) free(dc->sops[k].shadow);
    free(dc->sops);
    if (dc->engine_added) mpidp_reqtable_engine_remove(dc->reqs, dc);
    if (dc->kind == MPIDP_DEVCOMM_NCCL) mpidp__nccl_close(dc);
    free(dc->ops);
    pthread_mutex_destroy(&dc->mu);
    free(dc);
}
