/* Broadcast, allgather, barrier, reduce-scatter and allgatherv: each posts one
 * non-blocking MPI call and returns it as an mpidp_coll_t (see
 * mpidp/collectives.h). */
#include "mpidp/collectives.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include "mpi_util.h"
#include "post.h"
#include "mpidp/mpiops.h"
#include "mpidp/operation.h"
#include "mpidp/pack.h"
#include "mpidp/status.h"

#include "coll_internal.h"
#include "fail.h"

/* ---- helpers shared with rooted.c and alltoall_p2p.c (coll_internal.h) ------- */

int mpidp__coll_byte_count(const mpidp_tensor_t *t, const char *what, size_t *bytes)
{
    size_t esize = mpidp_dtype_size(t->dtype);
    if (esize == 0 || t->numel > (size_t)INT_MAX / esize)
        return mpidp__fail(MPIDP_EINVAL, "%s: %zu elements is too many for one MPI call", what,
                           t->numel);
    *bytes = t->numel * esize;
    return MPIDP_OK;
}

int mpidp__coll_comm_size(MPI_Comm comm, int *size)
{
    int rc = MPI_Comm_size(comm, size);
    return rc == MPI_SUCCESS ? MPIDP_OK : mpidp__mpi_fail(rc, "MPI_Comm_size");
}

int mpidp__coll_rank_size(MPI_Comm comm, int *rank, int *size)
{
    int rc = mpidp__coll_comm_size(comm, size);
    if (rc == MPIDP_OK && (rc = MPI_Comm_rank(comm, rank)) != MPI_SUCCESS)
        rc = mpidp__mpi_fail(rc, "MPI_Comm_rank");
    return rc;
}

int mpidp__coll_check_op(int op, int dtype, const char *what)
{
    if (op < MPIDP_OP_SUM || op > MPIDP_OP_BXOR)
        return mpidp__fail(MPIDP_EINVAL, "%s: unknown op %d", what, op);
    if (mpidp_mpi_op(op, dtype) == MPI_OP_NULL)
        return mpidp__fail(MPIDP_EDTYPE, "%s: op %s is not defined for %s tensors%s", what,
                           mpidp_op_name(op), mpidp_dtype_name(dtype), mpidp_op_hint(op, dtype));
    if (op == MPIDP_OP_AVG && dtype != MPIDP_F32 && dtype != MPIDP_F64)
        return mpidp__fail(MPIDP_EDTYPE, "%s: avg of %s tensors: sum them and scale", what,
                           mpidp_dtype_name(dtype));
    return MPIDP_OK;
}

int mpidp__coll_new(mpidp_reqtable_t *reqs, const char *what, mpidp_coll_t **out)
{
    mpidp_coll_t *x = calloc(1, sizeof *x);
    if (x == NULL) return mpidp__fail(MPIDP_ENOMEM, "%s", what);
    x->reqs = reqs;
    x->scale = 1.0;
    *out = x;
    return MPIDP_OK;
}

int mpidp__coll_finished_at_once(mpidp_coll_t *x, mpidp_coll_t **out)
{
    x->req = MPIDP_REQ_NONE;
    *out = x;
    return MPIDP_OK;
}

int mpidp__vcoll_new(mpidp_reqtable_t *reqs, const size_t *counts, int size, size_t unit,
                     const char *what, mpidp_coll_t **out, size_t *total)
{
    mpidp_coll_t *x = NULL;
    int rc = mpidp__coll_new(reqs, what, &x);
    if (rc != MPIDP_OK) return rc;
    x->counts = malloc((size_t)size * sizeof *x->counts);
    x->displs = malloc((size_t)size * sizeof *x->displs);
    if (x->counts == NULL || x->displs == NULL) {
        mpidp_coll_free(x);
        return mpidp__fail(MPIDP_ENOMEM, "%s", what);
    }
    size_t sum = 0;
    for (int r = 0; r < size; r++) {
        if (counts[r] > (size_t)INT_MAX / unit || sum + counts[r] > (size_t)INT_MAX / unit) {
            mpidp_coll_free(x);
            return mpidp__fail(MPIDP_EINVAL, "%s: %zu elements are too many for one MPI call",
                               what, sum + counts[r]);
        }
        x->counts[r] = (int)(counts[r] * unit);
        x->displs[r] = (int)(sum * unit);
        sum += counts[r];
    }
    *total = sum;
    *out = x;
    return MPIDP_OK;
}

/* Claims a request slot for x's operation, described by `what`. On failure
 * (MPIDP_EFULL: nothing may be posted) x is freed, because no request will
 * ever refer to it, so the caller only returns the status. */
int mpidp__coll_claim(mpidp_coll_t *x, const char *what, mpidp_req_t *slot)
{
    int rc = mpidp_reqtable_claim(x->reqs, what, slot);
    if (rc != MPIDP_OK) mpidp_coll_free(x);
    return rc;
}

/* Finishes the post coll_claim began (mpidp__post_done into x->req): on
 * success hands x to the caller in *out; on failure frees x, since the
 * operation never started. */
int mpidp__coll_post_done(mpidp_coll_t *x, mpidp_req_t slot, int mpi_rc, MPI_Request req,
                          MPI_Comm comm, const char *what, mpidp_coll_t **out)
{
    int rc = mpidp__post_done(x->reqs, slot, mpi_rc, req, comm, what, &x->req);
    if (rc != MPIDP_OK) {
        mpidp_coll_free(x);
        return rc;
    }
    *out = x;
    return MPIDP_OK;
}

int mpidp__coll_linear_done(mpidp_coll_t *x, int rc, mpidp_coll_t **out)
{
    if (rc != MPIDP_OK) {
        mpidp_coll_free(x); /* the linear operation never reached x */
        return rc;
    }
    *out = x; /* x->req stays MPIDP_REQ_NONE: x->linear holds the messages */
    return MPIDP_OK;
}

int mpidp_bcast_start(MPI_Comm comm, const mpidp_tensor_t *t, int root, mpidp_reqtable_t *reqs,
                      mpidp_coll_t **out)
{
    if (t == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "bcast: NULL argument");
    size_t bytes = 0;
    int size = 0, rc = mpidp__coll_byte_count(t, "bcast", &bytes);
    if (rc == MPIDP_OK) rc = mpidp__coll_comm_size(comm, &size);
    if (rc != MPIDP_OK) return rc;
    if (root < 0 || root >= size)
        return mpidp__fail(MPIDP_EINVAL, "bcast: root %d is not a rank of a %d-process communicator",
                           root, size);
    mpidp_coll_t *x = NULL;
    if ((rc = mpidp__coll_new(reqs, "bcast", &x)) != MPIDP_OK) return rc;
    if (size == 1 || t->numel == 0) return mpidp__coll_finished_at_once(x, out);
    /* Bytes, not elements: a broadcast needs no arithmetic, so any dtype goes. */
    char what[MPIDP_REQ_WHAT_LEN];
    snprintf(what, sizeof what, "MPI_Ibcast of %zu %s from rank %d", t->numel,
             mpidp_dtype_name(t->dtype), root);
    mpidp_req_t slot;
    if ((rc = mpidp__coll_claim(x, what, &slot)) != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Ibcast(t->data, (int)bytes, MPI_BYTE, root, comm, &req);
    return mpidp__coll_post_done(x, slot, rc, req, comm, what, out);
}

int mpidp_allgather_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                          mpidp_reqtable_t *reqs, mpidp_coll_t **out)
{
    if (send == NULL || recv == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "allgather: NULL argument");
    size_t bytes = 0;
    int size = 0, rc = mpidp__coll_byte_count(send, "allgather", &bytes);
    if (rc == MPIDP_OK) rc = mpidp__coll_comm_size(comm, &size);
    if (rc != MPIDP_OK) return rc;
    if (recv->dtype != send->dtype || recv->numel != (size_t)size * send->numel)
        return mpidp__fail(MPIDP_EINVAL, "allgather: the result must hold %d x %zu %s elements, "
                           "got %zu %s", size, send->numel, mpidp_dtype_name(send->dtype),
                           recv->numel, mpidp_dtype_name(recv->dtype));
    int rank = 0;
    if ((rc = mpidp__coll_rank_size(comm, &rank, &size)) != MPIDP_OK) return rc;
    const char *s = send->data, *r = recv->data;
    /* The input sitting in its own block of the result (FSDP's unshard) is
     * MPI's in-place allgather; any other overlap is an error. */
    int in_place = bytes && s == r + (size_t)rank * bytes;
    if (bytes && !in_place && s < r + (size_t)size * bytes && r < s + bytes)
        return mpidp__fail(MPIDP_EINVAL, "allgather: the result overlaps the input (other than "
                           "with the input in this rank's own block)");
    mpidp_coll_t *x = NULL;
    if ((rc = mpidp__coll_new(reqs, "allgather", &x)) != MPIDP_OK) return rc;
    if (bytes == 0) return mpidp__coll_finished_at_once(x, out);
    char what[MPIDP_REQ_WHAT_LEN];
    if (mpidp__linear_fits(size)) {
        snprintf(what, sizeof what, "allgather of %zu %s per rank", send->numel,
                 mpidp_dtype_name(send->dtype));
        return mpidp__coll_linear_done(
            x, mpidp__linear_allgather_start(comm, rank, size, s, recv->data, bytes, reqs, what,
                                             &x->linear),
            out);
    }
    snprintf(what, sizeof what, "MPI_Iallgather of %zu %s per rank", send->numel,
             mpidp_dtype_name(send->dtype));
    mpidp_req_t slot;
    if ((rc = mpidp__coll_claim(x, what, &slot)) != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Iallgather(in_place ? MPI_IN_PLACE : send->data, (int)bytes, MPI_BYTE, recv->data,
                        (int)bytes, MPI_BYTE, comm, &req);
    return mpidp__coll_post_done(x, slot, rc, req, comm, what, out);
}

int mpidp_barrier_start(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_coll_t **out)
{
    if (reqs == NULL || out == NULL) return mpidp__fail(MPIDP_EINVAL, "barrier: NULL argument");
    mpidp_coll_t *x = NULL;
    mpidp_req_t slot;
    int rc = mpidp__coll_new(reqs, "barrier", &x);
    if (rc == MPIDP_OK) rc = mpidp__coll_claim(x, "MPI_Ibarrier", &slot);
    if (rc != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Ibarrier(comm, &req);
    return mpidp__coll_post_done(x, slot, rc, req, comm, "MPI_Ibarrier", out);
}

/* ---- collectives with a count per rank ---------------------------------- */

int mpidp_reduce_scatter_start(MPI_Comm comm, const mpidp_tensor_t *send,
                               const mpidp_tensor_t *recv, const size_t *counts, int op,
                               mpidp_reqtable_t *reqs, mpidp_coll_t **out)
{
    if (send == NULL || recv == NULL || counts == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "reduce_scatter: NULL argument");
    int size = 0, rank = 0, rc = mpidp__coll_check_op(op, send->dtype, "reduce_scatter");
    if (rc == MPIDP_OK) rc = mpidp__coll_rank_size(comm, &rank, &size);
    if (rc != MPIDP_OK) return rc;
    mpidp_coll_t *x = NULL;
    size_t total;
    rc = mpidp__vcoll_new(reqs, counts, size, 1, "reduce_scatter", &x, &total);
    if (rc != MPIDP_OK) return rc;
    if (send->numel != total || recv->numel != counts[rank] || recv->dtype != send->dtype) {
        mpidp_coll_free(x);
        return mpidp__fail(MPIDP_EINVAL, "reduce_scatter: expected %zu %s elements in and %zu "
                           "out (this rank's count), got %zu and %zu %s", total,
                           mpidp_dtype_name(send->dtype), counts[rank], send->numel, recv->numel,
                           mpidp_dtype_name(recv->dtype));
    }
    x->recv = *recv;
    if (op == MPIDP_OP_AVG) x->scale = 1.0 / (double)size;
    char what[MPIDP_REQ_WHAT_LEN];
    size_t esize = mpidp_dtype_size(send->dtype);
    const char *in = send->data, *res = recv->data;
    int overlap = recv->numel && in < res + recv->numel * esize && res < in + total * esize;
    if (mpidp__linear_fits(size) && total > 0 && !overlap) {
        snprintf(what, sizeof what, "reduce_scatter of %zu %s", total,
                 mpidp_dtype_name(send->dtype));
        return mpidp__coll_linear_done(
            x, mpidp__linear_reduce_scatter_start(
                   comm, rank, size, send->data, recv->data, x->counts,
                   mpidp_mpi_datatype(send->dtype), esize, mpidp_mpi_op(op, send->dtype), reqs,
                   what, &x->linear),
            out);
    }
    snprintf(what, sizeof what, "MPI_Ireduce_scatter of %zu %s", total, mpidp_dtype_name(send->dtype));
    mpidp_req_t slot;
    if ((rc = mpidp__coll_claim(x, what, &slot)) != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Ireduce_scatter(send->data, recv->data, x->counts, mpidp_mpi_datatype(send->dtype),
                             mpidp_mpi_op(op, send->dtype), comm, &req);
    return mpidp__coll_post_done(x, slot, rc, req, comm, what, out);
}

int mpidp_allgatherv_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                           const size_t *counts, mpidp_reqtable_t *reqs, mpidp_coll_t **out)
{
    if (send == NULL || recv == NULL || counts == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "allgatherv: NULL argument");
    int size = 0, rank = 0, rc = mpidp__coll_rank_size(comm, &rank, &size);
    if (rc != MPIDP_OK) return rc;
    size_t esize = mpidp_dtype_size(send->dtype);
    if (esize == 0) return mpidp__fail(MPIDP_EDTYPE, "allgatherv: unknown dtype");
    mpidp_coll_t *x = NULL;
    size_t total;
    rc = mpidp__vcoll_new(reqs, counts, size, esize, "allgatherv", &x, &total);
    if (rc != MPIDP_OK) return rc;
    if (send->numel != counts[rank] || recv->numel != total || recv->dtype != send->dtype) {
        mpidp_coll_free(x);
        return mpidp__fail(MPIDP_EINVAL, "allgatherv: expected %zu %s elements in (this rank's "
                           "count) and %zu out, got %zu and %zu %s", counts[rank],
                           mpidp_dtype_name(send->dtype), total, send->numel, recv->numel,
                           mpidp_dtype_name(recv->dtype));
    }
    const char *s = send->data, *r = recv->data;
    if (send->numel && s < r + total * esize && r < s + send->numel * esize) {
        mpidp_coll_free(x);
        return mpidp__fail(MPIDP_EINVAL, "allgatherv: the result overlaps the input");
    }
    char what[MPIDP_REQ_WHAT_LEN];
    snprintf(what, sizeof what, "MPI_Iallgatherv of %zu %s", total, mpidp_dtype_name(send->dtype));
    mpidp_req_t slot;
    if ((rc = mpidp__coll_claim(x, what, &slot)) != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Iallgatherv(send->data, (int)(send->numel * esize), MPI_BYTE, recv->data, x->counts,
                         x->displs, MPI_BYTE, comm, &req);
    return mpidp__coll_post_done(x, slot, rc, req, comm, what, out);
}

/* Once the request has completed: the mean's scaling, exactly once. */
static void coll_finished(mpidp_coll_t *x)
{
    if (x->finished) return;
    x->finished = 1;
    if (x->source_out != NULL) *x->source_out = x->source;
    if (x->scale != 1.0) {
        const mpidp_pack_kernels_t *k = mpidp_pack_kernels();
        if (x->recv.dtype == MPIDP_F32) k->scale_f32(x->recv.data, (float)x->scale, x->recv.numel);
        else k->scale_f64(x->recv.data, x->scale, x->recv.numel);
    }
}

static int linear_poll(void *arg, int *done) { return mpidp__linear_test(arg, done); }

int mpidp_coll_wait(mpidp_coll_t *x, double timeout_s)
{
    if (x == NULL) return mpidp__fail(MPIDP_EINVAL, "collective: NULL argument");
    int rc = x->linear != NULL
                 ? mpidp_reqtable_wait_until(x->reqs, linear_poll, x->linear, timeout_s)
                 : mpidp_reqtable_wait(x->reqs, x->req, timeout_s);
    if (rc == MPIDP_OK) coll_finished(x);
    return rc;
}

int mpidp_coll_test(mpidp_coll_t *x, int *done)
{
    if (x == NULL || done == NULL) return mpidp__fail(MPIDP_EINVAL, "collective: NULL argument");
    int rc = x->linear != NULL ? mpidp__linear_test(x->linear, done)
                               : mpidp_reqtable_test(x->reqs, x->req, done);
    if (rc == MPIDP_OK && *done) coll_finished(x);
    return rc;
}

int mpidp_coll_free(mpidp_coll_t *x)
{
    if (x == NULL) return MPIDP_OK;
    int done = 1;
    if (x->req.gen != 0) mpidp_reqtable_test(x->reqs, x->req, &done);
    if (!done) return mpidp__fail(MPIDP_ESTATE, "collective: still in flight");
    int rc = mpidp__linear_free(x->linear);
    if (rc != MPIDP_OK) return rc;
    free(x->counts);
    free(x->displs);
    free(x->recv_counts);
    free(x->recv_displs);
    free(x);
    return MPIDP_OK;
}

static int operation_test(void *op, int *done) { return mpidp_coll_test(op, done); }
static int operation_wait(void *op, double timeout_s) { return mpidp_coll_wait(op, timeout_s); }
static int operation_free(void *op) { return mpidp_coll_free(op); }
const mpidp_operation_t mpidp_coll_operation = {operation_test, operation_wait, operation_free};
