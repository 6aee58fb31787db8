/* Single-tensor collectives: in-place allreduce and broadcast.
 *
 * These post a non-blocking MPI operation and register it in the request
 * table; the caller waits through the table (so every wait has a deadline).
 * *out is MPIDP_REQ_NONE when the operation finished at once (one rank). */
#ifndef MPIDP_COLLECTIVES_H
#define MPIDP_COLLECTIVES_H

#include <mpi.h>

#include "mpidp/reqtable.h"
#include "mpidp/tensor.h"

typedef enum {
    MPIDP_OP_SUM = 0,
    MPIDP_OP_AVG = 1,
} mpidp_op_t;

/* The MPI datatype of a core dtype (MPI_DATATYPE_NULL if MPI has none). */
MPI_Datatype mpidp_mpi_datatype(int dtype);

/* Posts an in-place allreduce of `t` (a CPU tensor) with `op`. AVG scales by
 * 1/size before the sum. Fails with MPIDP_EDTYPE for a dtype MPI cannot sum,
 * MPIDP_EINVAL for more than INT_MAX elements, MPIDP_EMPI if MPI refuses. */
int mpidp_allreduce_start(MPI_Comm comm, const mpidp_tensor_t *t, int op, mpidp_reqtable_t *reqs,
                          mpidp_req_t *out);

/* Posts an in-place broadcast of `t` from `root`. */
int mpidp_bcast_start(MPI_Comm comm, const mpidp_tensor_t *t, int root, mpidp_reqtable_t *reqs,
                      mpidp_req_t *out);

/* Posts a barrier. */
int mpidp_barrier_start(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_req_t *out);

#endif /* MPIDP_COLLECTIVES_H */
