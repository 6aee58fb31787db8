/* Core-internal: the posted collective of mpidp/collectives.h and the
 * helpers its files (collectives.c, rooted.c, alltoall_p2p.c) share. */
#ifndef MPIDP_COLL_INTERNAL_H
#define MPIDP_COLL_INTERNAL_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#include "mpidp/collectives.h"
#include "linear.h"

/* A posted collective: its request, what MPI reads while it runs (the
 * counts of a vector collective) and how its result is finished. */
struct mpidp_coll {
    mpidp_reqtable_t *reqs;
    mpidp_req_t req;       /* MPIDP_REQ_NONE: nothing was posted (done at once) */
    mpidp__linear_t *linear; /* instead of req: point-to-point messages (linear.h) */
    int *counts, *displs;  /* in elements (reduce-scatter) or bytes (the others) */
    int *recv_counts, *recv_displs; /* all-to-all: the receiving side's, in bytes */
    mpidp_tensor_t recv;
    double scale;          /* applied to recv on completion (avg); 1: none */
    int source;            /* a receive: the sender, written when it completes */
    int32_t *source_out;   /* NULL, or where the finishing copies `source` */
    int finished;
};

/* Checks that `op` reduces `dtype` here (an average only of float32 and
 * float64: the other dtypes' averages are scaled by the caller), naming
 * `what`; MPIDP_EDTYPE / MPIDP_EINVAL with a detail otherwise. */
int mpidp__coll_check_op(int op, int dtype, const char *what);

/* The bytes of `t` as one MPI count (int), or MPIDP_EINVAL naming `what`. */
int mpidp__coll_byte_count(const mpidp_tensor_t *t, const char *what, size_t *bytes);
int mpidp__coll_comm_size(MPI_Comm comm, int *size);
/* Rank and size of `comm`, or MPIDP_EMPI. */
int mpidp__coll_rank_size(MPI_Comm comm, int *rank, int *size);
int mpidp__coll_new(mpidp_reqtable_t *reqs, const char *what, mpidp_coll_t **out);
/* A collective with nothing to move (one rank, no bytes): complete already. */
int mpidp__coll_finished_at_once(mpidp_coll_t *x, mpidp_coll_t **out);
/* A coll with `size` counts (times `unit`) and their displacements; checks
 * that each and their sum fit an MPI count. *total = the sum of counts. */
int mpidp__vcoll_new(mpidp_reqtable_t *reqs, const size_t *counts, int size, size_t unit,
                     const char *what, mpidp_coll_t **out, size_t *total);
/* Finishes the start of a linear operation into x->linear (rc is its
 * status): on success hands x to the caller in *out; on failure frees x. */
int mpidp__coll_linear_done(mpidp_coll_t *x, int rc, mpidp_coll_t **out);
/* Claims a request slot for x's operation; on failure x is freed. */
int mpidp__coll_claim(mpidp_coll_t *x, const char *what, mpidp_req_t *slot);
/* Finishes the post mpidp__coll_claim began: on success hands x to the
 * caller in *out; on failure frees x. */
int mpidp__coll_post_done(mpidp_coll_t *x, mpidp_req_t slot, int mpi_rc, MPI_Request req,
                          MPI_Comm comm, const char *what, mpidp_coll_t **out);

#endif /* MPIDP_COLL_INTERNAL_H */
