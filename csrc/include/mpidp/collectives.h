/* Broadcast, allgather and barrier (the allreduce lives in mpidp/allreduce.h).
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

#endif /* MPIDP_COLLECTIVES_H */
