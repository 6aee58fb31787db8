/* Broadcast, allgather, barrier, reduce-scatter, allgatherv, the rooted
 * collectives (reduce, gather, scatter), all-to-all and point-to-point send
 * and receive (the allreduce lives in mpidp/allreduce.h).
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
#include <stdint.h>

#include "mpidp/reqtable.h"
#include "mpidp/tensor.h"

typedef struct mpidp_coll mpidp_coll_t;

/* Posts an in-place broadcast of `t` from `root`. */
int mpidp_bcast_start(MPI_Comm comm, const mpidp_tensor_t *t, int root, mpidp_reqtable_t *reqs,
                      mpidp_coll_t **out);

/* Posts an allgather of equal blocks: every rank's `send` (same dtype and
 * element count on every rank) lands in `recv`, rank r's at element
 * r * send->numel; recv must hold size * send->numel elements of that dtype
 * and not overlap send, unless send is exactly this rank's block of recv (an
 * in-place allgather). Moves bytes: any dtype goes. */
int mpidp_allgather_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                          mpidp_reqtable_t *reqs, mpidp_coll_t **out);

/* Posts a barrier. */
int mpidp_barrier_start(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_coll_t **out);

/* The collectives with a count per rank (uneven blocks) below keep a copy of
 * the counts until completion (MPI reads them while the operation runs). */

/* Posts a reduce-scatter: rank r receives in `recv` (counts[r] elements)
 * the reduction with `op` (mpidp/mpiops.h) over the ranks of `send`'s block
 * r (blocks in rank order; send holds sum(counts) elements): any dtype the
 * op is defined for (mpidp_mpi_op), the average for float32 and float64
 * only; `recv` must not overlap `send`. `counts` has one entry per rank and
 * is copied. */
int mpidp_reduce_scatter_start(MPI_Comm comm, const mpidp_tensor_t *send,
                               const mpidp_tensor_t *recv, const size_t *counts, int op,
                               mpidp_reqtable_t *reqs, mpidp_coll_t **out);
/* Posts an allgather of uneven blocks: rank r's `send` (counts[r] elements)
 * lands in `recv` (sum(counts) elements, rank order). Moves bytes: any
 * dtype, the same on every rank. */
int mpidp_allgatherv_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                           const size_t *counts, mpidp_reqtable_t *reqs, mpidp_coll_t **out);
/* Rooted collectives (root: a rank of comm).
 * Posts a reduction with `op` of every rank's `t` into root's `t`, in place
 * (the other ranks' `t` are only read). Any dtype `op` is defined for, the
 * average for float32 and float64 only. */
int mpidp_reduce_start(MPI_Comm comm, const mpidp_tensor_t *t, int op, int root,
                       mpidp_reqtable_t *reqs, mpidp_coll_t **out);
/* Posts a gather of uneven blocks: rank r's `send` (counts[r] elements)
 * lands in root's `recv` (sum(counts) elements, rank order; NULL elsewhere).
 * Moves bytes: any dtype, the same on every rank. */
int mpidp_gatherv_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                        const size_t *counts, int root, mpidp_reqtable_t *reqs,
                        mpidp_coll_t **out);
/* Posts a scatter of uneven blocks: root's `send` (sum(counts) elements;
 * NULL elsewhere) block r lands in rank r's `recv` (counts[r] elements). */
int mpidp_scatterv_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                         const size_t *counts, int root, mpidp_reqtable_t *reqs,
                         mpidp_coll_t **out);

/* Exchanges (alltoall_p2p.c).
 * Posts an all-to-all of uneven blocks: this rank's `send` block for rank r
 * (send_counts[r] elements, blocks in rank order) lands in rank r's `recv`
 * at this rank's block (recv_counts[this rank's number] there). Each rank's
 * counts must match its peers' (what r sends here = what this rank expects
 * from r). Moves bytes: any dtype, the same on every rank; `recv` must not
 * overlap `send`. */
int mpidp_alltoallv_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                          const size_t *send_counts, const size_t *recv_counts,
                          mpidp_reqtable_t *reqs, mpidp_coll_t **out);
/* Posts a send of `t` to rank `peer` with message tag `tag` (>= 0). */
int mpidp_send_start(MPI_Comm comm, const mpidp_tensor_t *t, int peer, int tag,
                     mpidp_reqtable_t *reqs, mpidp_coll_t **out);
/* Posts a receive into `t` from rank `peer`, or from any rank with peer -1,
 * with tag `tag` (>= 0). When it completes, the sender's rank is written to
 * *source (if not NULL; it must stay valid until then). A message longer
 * than `t` fails with MPI's truncation error. */
int mpidp_recv_start(MPI_Comm comm, const mpidp_tensor_t *t, int peer, int tag,
                     int32_t *source, mpidp_reqtable_t *reqs, mpidp_coll_t **out);

/* Waits (deadline per wait, as the request table's), then finishes the
 * operation (the mean's scaling). */
int mpidp_coll_wait(mpidp_coll_t *x, double timeout_s);
/* Tests without blocking; *done = 1 once complete, the mean's scaling done. */
int mpidp_coll_test(mpidp_coll_t *x, int *done);
/* Frees it; MPIDP_ESTATE (nothing freed) while it is in flight. */
int mpidp_coll_free(mpidp_coll_t *x);

#endif /* MPIDP_COLLECTIVES_H */
