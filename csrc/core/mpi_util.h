/* Core-private: how the core talks to MPI -- one way to post a non-blocking
 * operation and one way to report an MPI failure (what the glue may ask of
 * MPI is in mpidp/mpi_info.h).
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
#ifndef MPIDP_CORE_MPI_UTIL_H
#define MPIDP_CORE_MPI_UTIL_H

#include <mpi.h>

#include "mpidp/mpi_info.h"
#include "mpidp/reqtable.h"

/* Records "<formatted context>: <MPI's error string>" and returns MPIDP_EMPI. */
int mpidp__mpi_fail(int mpi_rc, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

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

/* The number of the point-to-point operation being started on `comm`: 0, 1,
 * 2, .. counted per communicator (in an MPI attribute), shared by every
 * engine that tags its messages with it (the quantized allreduce, the peer
 * exchange). Ranks that start the same operations on a communicator in the
 * same order number them alike, so a tag built from the number matches only
 * its own operation's messages. */
int mpidp__next_op_number(MPI_Comm comm, const char *what, unsigned *out);

/* 1 when the MPI library yields the core when idle -- Open MPI's
 * mpi_yield_when_idle, which mpirun turns on when it puts more ranks on a
 * node than it has cores, and which users set for the same reason -- else 0
 * (also where MPI has no such setting). Read through the MPI tool interface,
 * after MPI_Init; MPI's thread level is left as it was. */
int mpidp__mpi_yields_when_idle(void);

#endif /* MPIDP_CORE_MPI_UTIL_H */
