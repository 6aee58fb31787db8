/* Core-private: the one way the core posts a non-blocking MPI operation.
 * Above the request table (csrc/core/reqtable.c), MPI's datatypes and ops
 * (mpiops.c) and mpi_util.c; below every engine that posts.
 *
 * Posting is two-phase so that no request is ever posted without a slot to
 * track it (which would leave only an unbounded MPI_Wait to finish it):
 *
 *     mpidp_req_t slot;
 *     int rc = mpidp_reqtable_claim(reqs, what, &slot);    // MPIDP_EFULL: nothing posted
 *     if (rc != MPIDP_OK) return rc;
 *     MPI_Request req;
 *     int mrc = MPI_Iallreduce(..., &req);
 *     return mpidp__post_done(reqs, slot, mrc, req, what, &handle);
 *
 * The handle then goes to mpidp_reqtable_test / _wait (deadline-bounded). */
#ifndef MPIDP_CORE_POST_H
#define MPIDP_CORE_POST_H

#include <mpi.h>

#include "mpidp/reqtable.h"

/* Finishes a post: with mpi_rc == MPI_SUCCESS, registers `req` (posted on
 * `comm`, whose ranks it waits for) in the claimed slot and stores its
 * handle in *out; otherwise releases the slot and returns MPIDP_EMPI with
 * "<what>: <MPI's error string>". */
int mpidp__post_done(mpidp_reqtable_t *reqs, mpidp_req_t slot, int mpi_rc, MPI_Request req,
                     MPI_Comm comm, const char *what, mpidp_req_t *out);

/* The in-place sum of `count` elements of core dtype `dtype` over `comm`
 * (MPI_Iallreduce with mpiops.c's datatype and op), posted as above: claim,
 * post, register into *out. Every allreduce of the core goes through here. */
int mpidp__post_iallreduce(MPI_Comm comm, mpidp_reqtable_t *reqs, void *buf, size_t count, int op,
                           int dtype, const char *what, mpidp_req_t *out);

#endif /* MPIDP_CORE_POST_H */
