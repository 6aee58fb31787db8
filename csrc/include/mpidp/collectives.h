/* Broadcast, allgather, barrier, reduce-scatter and allgatherv (the
 * allreduce lives in mpidp/allreduce.h).
 *
 * Each posts one non-blocking MPI operation, registers it in the request
 * table and returns it as an mpidp_coll_t, which owns what MPI reads while
 * it runs and finishes the result (a mean's scaling) on completion. The
 * caller tests or waits for it (every wait has a deadline) and frees it:
 * directly, or through mpidp_coll_operation (mpidp/operation.h), as any
 * other engine's operation. On failure nothing is posted and *out is not
 * set. */
#ifndef MPIDP_COLLECTIVES_H
#define MPIDP_COLLECTIVES_H

#include <mpi.h>

#include "mpidp/reqtable.h"
#include "mpidp/tensor.h"

typedef struct mpidp_coll mpidp_coll_t;

/* Posts an in-place broadcast of `t` from `root`. */
int mpidp_bcast_start(MPI_Comm comm, const mpidp_tensor_t *t, int root, mpidp_reqtable_t *reqs,
                      mpidp_coll_t **out);

/* Posts an allgather of equal blocks: every rank's `send` (same dtype and
 * element count on every rank) lands in `recv`, rank r's at element
 * r * send->numel; recv must hold size * send->numel elements of that dtype
 * and not overlap send. Moves bytes: any dtype goes. */
int mpidp_allgather_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                          mpidp_reqtable_t *reqs, mpidp_coll_t **out);

/* Posts a barrier. */
int mpidp_barrier_start(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_coll_t **out);

/* The collectives with a count per rank (uneven blocks) below keep a copy of
 * the counts until completion (MPI reads them while the operation runs). */

/* Posts a reduce-scatter: rank r receives in `recv` (counts[r] elements) the
 * sum, or with op MPIDP_OP_AVG the mean, over the ranks of `send`'s block r
 * (blocks in rank order; send holds sum(counts) elements). float32 or
 * float64; `recv` must not overlap `send`. `counts` has one entry per rank
 * and is copied. */
int mpidp_reduce_scatter_start(MPI_Comm comm, const mpidp_tensor_t *send,
                               const mpidp_tensor_t *recv, const size_t *counts, int op,
                               mpidp_reqtable_t *reqs, mpidp_coll_t **out);
/* Posts an allgather of uneven blocks: rank r's `send` (counts[r] elements)
 * lands in `recv` (sum(counts) elements, rank order). Moves bytes: any
 * dtype, the same on every rank. */
int mpidp_allgatherv_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                           const size_t *counts, mpidp_reqtable_t *reqs, mpidp_coll_t **out);
/* Waits (deadline per wait, as the request table's), then finishes the
 * operation (the mean's scaling). */
int mpidp_coll_wait(mpidp_coll_t *x, double timeout_s);
/* Tests without blocking; *done = 1 once complete, the mean's scaling done. */
int mpidp_coll_test(mpidp_coll_t *x, int *done);
/* Frees it; MPIDP_ESTATE (nothing freed) while it is in flight. */
int mpidp_coll_free(mpidp_coll_t *x);

#endif /* MPIDP_COLLECTIVES_H */
