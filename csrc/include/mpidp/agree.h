/* Whether the ranks of a communicator passed the same signature.
 *
 * The public collectives first check that every rank passed the same call,
 * shape, dtype and settings (python/mpidp/_agreement.py builds the
 * signature): mismatched MPI collectives can exit 0 with wrong bytes,
 * truncate or hang, since MPI matches them by order alone. One blocking
 * MPI_Iallreduce (MPI_MAX) of the signature and its negation, waited for
 * with the deadline of every wait: the ranks agree exactly when the maximum
 * of every field equals minus the maximum of its negation. Fields must lie
 * in (-2^63, 2^63) so that every negation exists. */
#ifndef MPIDP_AGREE_H
#define MPIDP_AGREE_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#include "mpidp/reqtable.h"

#define MPIDP_AGREE_MAX_FIELDS 32

/* *agreed = 1 when every rank of `comm` called with the same n fields in
 * sig[], else 0 (the same answer on every rank). Collective over comm.
 * MPIDP_EINVAL for n outside 1 .. MPIDP_AGREE_MAX_FIELDS or INT64_MIN in
 * sig; the wait's status (MPIDP_ETIMEDOUT, MPIDP_EMPI) otherwise. */
int mpidp_agree(MPI_Comm comm, const int64_t *sig, size_t n, mpidp_reqtable_t *reqs,
                double timeout_s, int *agreed);

#endif /* MPIDP_AGREE_H */
