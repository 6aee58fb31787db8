/* The reducer's hierarchical mode (mpidp/reducer.h, "hierarchical"): a
 * bucket is reduced in three phases,
 *
 *   1. node-local reduce-scatter: local rank l gets the node's sum of its
 *      slice l of the bucket (slices: the bucket split as evenly as possible,
 *      the first count % L slices one element longer);
 *   2. its slice summed with the ranks of the same local rank on the other
 *      nodes (an allreduce over the cross communicator; with a uint8 wire the
 *      slice's gradient part through the quantized allreduce and its flags
 *      part exactly);
 *   3. node-local allgatherv of the slices back into the bucket,
 *
 * so every local rank carries 1/L of the bytes between nodes. A phase starts
 * when the previous one has arrived; phases 2 and 3 start strictly in bucket
 * order (a cursor each), and each phase has its own communicator, so every
 * rank starts the collectives of each communicator in the same order
 * whatever order completions are seen in. The reducer is a progress engine
 * of the request table: any wait or progress call advances its phases. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpi_util.h"
#include "post.h"
#include "mpidp/mpiops.h"
#include "mpidp/qallreduce.h"
#include "mpidp/status.h"
#include "reducer_internal.h"
#include "fail.h"

enum { H_IDLE, H_SCATTER, H_CROSS, H_GATHER, H_DONE };

int mpidp__hier_init(mpidp_reducer_t *r, const mpidp_reducer_config_t *cfg)
{
    r->hier = cfg->hierarchical != 0;
    if (!r->hier) return MPIDP_OK;
    if (cfg->hier_node_scatter == MPI_COMM_NULL || cfg->hier_cross == MPI_COMM_NULL ||
        cfg->hier_node_gather == MPI_COMM_NULL)
        return mpidp__fail(MPIDP_EINVAL, "reducer: hierarchical mode needs three communicators");
    r->h_node = cfg->hier_node_scatter, r->h_cross = cfg->hier_cross;
    r->h_gather = cfg->hier_node_gather;
    int rc = MPI_Comm_size(r->h_node, &r->h_size);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(r->h_node, &r->h_rank);
    if (rc != MPI_SUCCESS) return mpidp__mpi_fail(rc, "reducer: the node communicator");
    for (size_t b = 0; b < r->n_buckets; b++) {
        bucket_t *bk = &r->buckets[b];
        size_t count = bk->info.numel + bk->info.n_params, L = (size_t)r->h_size, at = 0;
        bk->h.counts = malloc(L * sizeof *bk->h.counts);
        bk->h.displs = malloc(L * sizeof *bk->h.displs);
        bk->h.slice = malloc((count / L + 1) * 8); /* the widest dtype */
        if (!bk->h.counts || !bk->h.displs || !bk->h.slice)
            return mpidp__fail(MPIDP_ENOMEM, "reducer: hierarchical slices of bucket %zu", b);
        for (size_t l = 0; l < L; l++) {
            size_t n = count / L + (l < count % L);
            bk->h.counts[l] = (int)n, bk->h.displs[l] = (int)at;
            at += n;
        }
    }
    return mpidp_reqtable_engine_add(r->reqs, mpidp__hier_engine, r);
}

void mpidp__hier_free(mpidp_reducer_t *r)
{
    if (r->hier) mpidp_reqtable_engine_remove(r->reqs, r);
    for (size_t b = 0; r->buckets && b < r->n_buckets; b++) {
        free(r->buckets[b].h.counts);
        free(r->buckets[b].h.displs);
        free(r->buckets[b].h.slice);
    }
}

/* Starts one node-local phase's MPI collective for bucket bk into *req,
 * returning MPI's status (post_node_phase registers it). */
typedef int (*node_phase_start_fn)(const mpidp_reducer_t *r, const bucket_t *bk,
                                   MPI_Request *req);

/* Posts a node-local phase of bucket b (phase 1 or 3: the ones that are a
 * single MPI collective): claims a request slot described as "<reducer>:
 * <step> of bucket <b+1>/<n>", starts the collective with `start`, registers
 * it in bk->req and, once it is in flight, moves the bucket to `phase`. The
 * slot is claimed first so that a full table is found out before anything is
 * posted (core/mpi_util.h). */
static int post_node_phase(mpidp_reducer_t *r, size_t b, const char *step,
                           node_phase_start_fn start, MPI_Comm comm, int phase)
{
    bucket_t *bk = &r->buckets[b];
    char what[MPIDP_REQ_WHAT_LEN + 64];
    snprintf(what, sizeof what, "%s: %s of bucket %zu/%zu", r->name, step, b + 1, r->n_buckets);
    mpidp_req_t slot;
    int rc = mpidp_reqtable_claim(r->reqs, what, &slot);
    if (rc != MPIDP_OK) return rc;
    MPI_Request req;
    rc = start(r, bk, &req);
    rc = mpidp__post_done(r->reqs, slot, rc, req, comm, what, &bk->req);
    if (rc == MPIDP_OK) bk->h.phase = phase;
    return rc;
}

/* Phase 1's collective: the node's sum of every slice, this rank's slice
 * landing in bk->h.slice. */
static int start_scatter(const mpidp_reducer_t *r, const bucket_t *bk, MPI_Request *req)
{
    return MPI_Ireduce_scatter(bk->h.buf, bk->h.slice, bk->h.counts,
                               mpidp_mpi_datatype(bk->h.dtype),
                               mpidp_mpi_op(MPIDP_OP_SUM, bk->h.dtype), r->h_node, req);
}

int mpidp__hier_post(mpidp_reducer_t *r, size_t b, void *buf, int dtype)
{
    bucket_t *bk = &r->buckets[b];
    bk->h.buf = buf, bk->h.dtype = dtype;
    return post_node_phase(r, b, "node reduce-scatter", start_scatter, r->h_node, H_SCATTER);
}

/* Phase 2 of bucket b: its slice over the cross communicator. */
static int post_cross(mpidp_reducer_t *r, size_t b)
{
    bucket_t *bk = &r->buckets[b];
    size_t n = (size_t)bk->h.counts[r->h_rank], from = (size_t)bk->h.displs[r->h_rank];
    char what[MPIDP_REQ_WHAT_LEN + 64];
    snprintf(what, sizeof what, "%s: cross-node allreduce of bucket %zu/%zu's slice", r->name,
             b + 1, r->n_buckets);
    bk->h.phase = H_CROSS;
    if (r->wire != MPIDP_U8)
        return mpidp__post_iallreduce(r->h_cross, r->reqs, bk->h.slice, n, MPIDP_OP_SUM,
                                      bk->h.dtype, what, &bk->req);
    /* uint8: the gradients of the slice quantized, its flags exact. */
    size_t numel = bk->info.numel, data = from >= numel ? 0 : (numel - from < n ? numel - from : n);
    int rc = mpidp__post_iallreduce(r->h_cross, r->reqs, (float *)bk->h.slice + data, n - data,
                                    MPIDP_OP_SUM, MPIDP_F32, what, &bk->req);
    if (rc != MPIDP_OK || data == 0) return rc;
    mpidp_tensor_t t = {.data = bk->h.slice, .numel = data, .dtype = MPIDP_F32,
                        .device = MPIDP_DEV_CPU};
    mpidp_qallreduce_opts_t o = {.drain_timeout_s = r->drain_timeout_s, .what = r->name};
    return mpidp_qallreduce_start(r->h_cross, &t, &o, r->reqs, &bk->q);
}

/* Phase 3's collective: every rank's slice back into the bucket. Counts are
 * in elements of the travelling dtype, so its MPI datatype describes them. */
static int start_gather(const mpidp_reducer_t *r, const bucket_t *bk, MPI_Request *req)
{
    return MPI_Iallgatherv(bk->h.slice, bk->h.counts[r->h_rank], mpidp_mpi_datatype(bk->h.dtype),
                           bk->h.buf, bk->h.counts, bk->h.displs,
                           mpidp_mpi_datatype(bk->h.dtype), r->h_gather, req);
}

/* Phase 3 of bucket b: the slices back into the bucket. */
static int post_gather(mpidp_reducer_t *r, size_t b)
{
    return post_node_phase(r, b, "node allgather", start_gather, r->h_gather, H_GATHER);
}

/* 1 when bucket b's current phase has arrived (tested, never waited). */
static int arrived(mpidp_reducer_t *r, bucket_t *bk, int *rc)
{
    int done = 0;
    *rc = mpidp_reqtable_test(r->reqs, bk->req, &done);
    if (*rc != MPIDP_OK || !done) return 0;
    if (bk->q) {
        *rc = mpidp_qallreduce_test(bk->q, &done);
        if (*rc != MPIDP_OK || !done) return 0;
        *rc = mpidp_qallreduce_free(bk->q);
        if (*rc != MPIDP_OK) return 0;
        bk->q = NULL;
    }
    return 1;
}

int mpidp__hier_progress(mpidp_reducer_t *r)
{
    if (r->h_error) return mpidp__fail(r->h_error, "%s", r->h_detail);
    for (int moved = 1; moved;) {
        moved = 0;
        int rc = MPIDP_OK;
        bucket_t *bk;
        if (r->h_next_cross < r->n_buckets && (bk = &r->buckets[r->h_next_cross])->h.phase == H_SCATTER &&
            arrived(r, bk, &rc)) {
            rc = post_cross(r, r->h_next_cross++);
            moved = 1;
        }
        if (rc == MPIDP_OK && r->h_next_gather < r->h_next_cross &&
            (bk = &r->buckets[r->h_next_gather])->h.phase == H_CROSS && arrived(r, bk, &rc)) {
            rc = post_gather(r, r->h_next_gather++);
            moved = 1;
        }
        for (size_t b = 0; rc == MPIDP_OK && b < r->h_next_gather; b++) {
            bk = &r->buckets[b];
            if (bk->h.phase == H_GATHER && arrived(r, bk, &rc)) {
                bk->h.phase = H_DONE;
                rc = reducer_complete_bucket(r, bk);
                moved = 1;
            }
        }
        if (rc != MPIDP_OK) {
            /* A half-started pipeline cannot finish correctly: every later call says so. */
            r->h_error = rc;
            snprintf(r->h_detail, sizeof r->h_detail, "%s", mpidp_error_detail());
            return rc;
        }
    }
    return MPIDP_OK;
}

void mpidp__hier_engine(void *ctx) { (void)mpidp__hier_progress(ctx); }

int mpidp__hier_wait(mpidp_reducer_t *r, size_t b, double timeout_s)
{
    for (;;) {
        int rc = mpidp__hier_progress(r);
        if (rc != MPIDP_OK || r->buckets[b].h.phase == H_DONE) return rc;
        /* Wait on the earliest bucket's phase in flight: the one the order
         * waits for (a handle only: progress may free the quantized part). */
        size_t k = 0;
        while (k <= b && r->buckets[k].h.phase == H_DONE) k++;
        const bucket_t *bk = &r->buckets[k];
        mpidp_req_t req = bk->q ? mpidp_qallreduce_pending(bk->q) : MPIDP_REQ_NONE;
        rc = mpidp_reqtable_wait(r->reqs, req.gen ? req : bk->req, timeout_s);
        if (rc != MPIDP_OK) return rc;
    }
}

void mpidp__hier_reset(mpidp_reducer_t *r)
{
    r->h_next_cross = r->h_next_gather = 0;
    for (size_t b = 0; b < r->n_buckets; b++) r->buckets[b].h.phase = H_IDLE;
}
