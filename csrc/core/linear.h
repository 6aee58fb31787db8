/* Core-private: allgather, reduce-scatter and (small) allreduce of a few
 * ranks as point-to-point messages, each rank exchanging its blocks with
 * every other at once.
 *
 * Why: Open MPI's non-blocking collectives (libnbc) run a generic schedule
 * that costs up to 1.8x the blocking call's time at 256 KB per rank in
 * shared memory (and its allreduce 2.2x at 1 KB), while one Isend/Irecv per
 * pair of ranks matches the blocking call (both measured at 2 ranks; see
 * docs/design-notes.md). With
 * up to MPIDP_LINEAR_MAX_RANKS ranks each rank's sends are few, so the
 * burst is bounded; larger communicators keep MPI's own algorithms.
 *
 * The messages use the communicator's largest tag (MPI_TAG_UB), which the
 * core's point-to-point calls refuse (mpidp__linear_tag), so a user's own
 * send or receive on the same communicator never matches them. Two of these
 * collectives in flight on one communicator match in posting order, which
 * is the same on every rank, as for any collective.
 *
 * Every block is received from every other rank before the operation
 * completes, so, as with MPI's collectives, no rank completes one before
 * every rank has joined it. */
#ifndef MPIDP_CORE_LINEAR_H
#define MPIDP_CORE_LINEAR_H

#include <mpi.h>
#include <stddef.h>

#include "mpidp/reqtable.h"

#define MPIDP_LINEAR_MAX_RANKS 8

typedef struct mpidp__linear mpidp__linear_t;

/* The tag this communicator's linear collectives use, which point-to-point
 * calls may not. */
int mpidp__linear_tag(MPI_Comm comm);

/* Whether a collective over `size` ranks goes this way. */
static inline int mpidp__linear_fits(int size)
{
    return size > 1 && size <= MPIDP_LINEAR_MAX_RANKS;
}

/* Posts the allgather of `bytes` (at most INT_MAX) per rank from `send`
 * into `recv` (size blocks); send == recv + rank * bytes is in place. */
int mpidp__linear_allgather_start(MPI_Comm comm, int rank, int size, const void *send, void *recv,
                                  size_t bytes, mpidp_reqtable_t *reqs, const char *what,
                                  mpidp__linear_t **out);

/* Posts the reduce-scatter of `send` (counts[r] elements for each rank r, in
 * rank order) into `recv` (counts[rank] elements) under `op`: the blocks
 * are reduced in rank order, as they arrive. `send` and `recv` may not
 * overlap. */
int mpidp__linear_reduce_scatter_start(MPI_Comm comm, int rank, int size, const void *send,
                                       void *recv, const int *counts, MPI_Datatype type,
                                       size_t esize, MPI_Op op, mpidp_reqtable_t *reqs,
                                       const char *what, mpidp__linear_t **out);

/* Posts the in-place allreduce of `data` (count elements) under `op`: every
 * rank sends its whole tensor to every other, and each folds them in rank
 * order (the same bits on every rank). For small tensors only: each rank
 * sends (size - 1) x its bytes. */
int mpidp__linear_allreduce_start(MPI_Comm comm, int rank, int size, void *data, int count,
                                  MPI_Datatype type, size_t esize, MPI_Op op,
                                  mpidp_reqtable_t *reqs, const char *what,
                                  mpidp__linear_t **out);

/* Advances the operation; *done = 1 once its result is in place. */
int mpidp__linear_test(mpidp__linear_t *x, int *done);

/* Frees a completed (or never posted) operation; MPIDP_ESTATE while a
 * message is still in flight. */
int mpidp__linear_free(mpidp__linear_t *x);

#endif /* MPIDP_CORE_LINEAR_H */
