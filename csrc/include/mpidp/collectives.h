/* Broadcast, allgather, barrier, reduce-scatter and allgatherv (the
 * allreduce lives in mpidp/allreduce.h).
 *
 * These post a non-blocking MPI operation and register it in the request
 * table; the caller waits through the table (so every wait has a deadline).
 * *out is MPIDP_REQ_NONE when the operation finished at once (one rank). */
#ifndef MPIDP_COLLECTIVES_H
#define MPIDP_COLLECTIVES_H

#include <mpi.h>

#include "mpidp/reqtable.h"
#include "mpidp/tensor.h"

/* Posts an in-place broadcast of `t` from `root`. */
int mpidp_bcast_start(MPI_Comm comm, const mpidp_tensor_t *t, int root, mpidp_reqtable_t *reqs,
                      mpidp_req_t *out);

/* Posts an allgather of equal blocks: every rank's `send` (same dtype and
 * element count on every rank) lands in `recv`, rank r's at element
 * r * send->numel; recv must hold size * send->numel elements of that dtype
 * and not overlap send. Moves bytes: any dtype goes. */
int mpidp_allgather_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                          mpidp_reqtable_t *reqs, mpidp_req_t *out);

/* Posts a barrier. */
int mpidp_barrier_start(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_req_t *out);

/* Collectives with a count per rank (uneven blocks), which own their counts
 * until completion (MPI reads them while the operation runs). */
typedef struct mpidp_vcoll mpidp_vcoll_t;

/* Posts a reduce-scatter: rank r receives in `recv` (counts[r] elements) the
 * sum, or with op MPIDP_OP_AVG the mean, over the ranks of `send`'s block r
 * (blocks in rank order; send holds sum(counts) elements). float32 or
 * float64; `recv` must not overlap `send`. `counts` has one entry per rank
 * and is copied. */
int mpidp_reduce_scatter_start(MPI_Comm comm, const mpidp_tensor_t *send,
                               const mpidp_tensor_t *recv, const size_t *counts, int op,
                               mpidp_reqtable_t *reqs, mpidp_vcoll_t **out);
/* Posts an allgather of uneven blocks: rank r's `send` (counts[r] elements)
 * lands in `recv` (sum(counts) elements, rank order). Moves bytes: any
 * dtype, the same on every rank. */
int mpidp_allgatherv_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                           const size_t *counts, mpidp_reqtable_t *reqs, mpidp_vcoll_t **out);
/* Waits (deadline per wait, as the request table's), then finishes the
 * operation (the mean's scaling). */
int mpidp_vcoll_wait(mpidp_vcoll_t *x, double timeout_s);
/* Tests without blocking; *done = 1 once complete, the mean's scaling done. */
int mpidp_vcoll_test(mpidp_vcoll_t *x, int *done);
/* Frees it; MPIDP_ESTATE (nothing freed) while it is in flight. */
int mpidp_vcoll_free(mpidp_vcoll_t *x);

#endif /* MPIDP_COLLECTIVES_H */
