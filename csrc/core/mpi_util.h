/* Core-private: how the core reports an MPI failure, numbers its
 * point-to-point operations and reads MPI's settings (what the glue may ask
 * of MPI is in mpidp/mpi_info.h; posting a request is csrc/core/post.h). The
 * bottom of the core's MPI layers: it calls none of them. */
#ifndef MPIDP_CORE_MPI_UTIL_H
#define MPIDP_CORE_MPI_UTIL_H

#include <mpi.h>

#include "mpidp/mpi_info.h"

/* Records "<formatted context>: <MPI's error string>" and returns MPIDP_EMPI. */
int mpidp__mpi_fail(int mpi_rc, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

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
