/* The rooted collectives: reduce, gather and scatter (see
 * mpidp/collectives.h). Each posts one non-blocking MPI call; the gather and
 * scatter move bytes, so any dtype goes. */
#include "mpidp/collectives.h"

#include <limits.h>
#include <stdio.h>

#include "mpi_util.h"
#include "mpidp/mpiops.h"
#include "mpidp/status.h"

#include "coll_internal.h"
#include "fail.h"

/* Rank and size of comm, with `root` checked to be one of its ranks. */
static int rooted_begin(MPI_Comm comm, int root, const char *what, int *rank, int *size)
{
    int rc = mpidp__coll_rank_size(comm, rank, size);
    if (rc == MPIDP_OK && (root < 0 || root >= *size))
        rc = mpidp__fail(MPIDP_EINVAL, "%s: root %d is not a rank of a %d-process communicator",
                         what, root, *size);
    return rc;
}

int mpidp_reduce_start(MPI_Comm comm, const mpidp_tensor_t *t, int op, int root,
                       mpidp_reqtable_t *reqs, mpidp_coll_t **out)
{
    if (t == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "reduce: NULL argument");
    int rank = 0, size = 0, rc = mpidp__coll_check_op(op, t->dtype, "reduce");
    if (rc == MPIDP_OK) rc = rooted_begin(comm, root, "reduce", &rank, &size);
    if (rc != MPIDP_OK) return rc;
    if (t->numel > (size_t)INT_MAX)
        return mpidp__fail(MPIDP_EINVAL, "reduce: %zu elements are too many for one MPI call",
                           t->numel);
    mpidp_coll_t *x = NULL;
    if ((rc = mpidp__coll_new(reqs, "reduce", &x)) != MPIDP_OK) return rc;
    if (rank == root) {
        x->recv = *t;
        if (op == MPIDP_OP_AVG) x->scale = 1.0 / (double)size;
    }
    char what[MPIDP_REQ_WHAT_LEN];
    snprintf(what, sizeof what, "MPI_Ireduce (%s) of %zu %s to rank %d", mpidp_op_name(op),
             t->numel, mpidp_dtype_name(t->dtype), root);
    mpidp_req_t slot;
    if ((rc = mpidp__coll_claim(x, what, &slot)) != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Ireduce(rank == root ? MPI_IN_PLACE : t->data, t->data, (int)t->numel,
                     mpidp_mpi_datatype(t->dtype), mpidp_mpi_op(op, t->dtype), root, comm, &req);
    return mpidp__coll_post_done(x, slot, rc, req, comm, what, out);
}

/* The shared part of gatherv and scatterv: `one` is this rank's own block
 * (counts[rank] elements), `all` root's whole buffer (sum(counts) elements,
 * NULL on the other ranks), both of one dtype and not overlapping. */
static int vrooted_begin(MPI_Comm comm, const mpidp_tensor_t *one, const mpidp_tensor_t *all,
                         const size_t *counts, int root, mpidp_reqtable_t *reqs,
                         const char *what, int *rank, mpidp_coll_t **out)
{
    if (one == NULL || counts == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "%s: NULL argument", what);
    int size = 0, rc = rooted_begin(comm, root, what, rank, &size);
    if (rc != MPIDP_OK) return rc;
    if (*rank == root && all == NULL)
        return mpidp__fail(MPIDP_EINVAL, "%s: the root needs the whole buffer", what);
    size_t esize = mpidp_dtype_size(one->dtype), total = 0;
    if (esize == 0) return mpidp__fail(MPIDP_EDTYPE, "%s: unknown dtype", what);
    mpidp_coll_t *x = NULL;
    if ((rc = mpidp__vcoll_new(reqs, counts, size, esize, what, &x, &total)) != MPIDP_OK)
        return rc;
    if (one->numel != counts[*rank] ||
        (*rank == root && (all->numel != total || all->dtype != one->dtype))) {
        mpidp_coll_free(x);
        return mpidp__fail(MPIDP_EINVAL, "%s: expected %zu %s elements for this rank%s, got %zu%s",
                           what, counts[*rank], mpidp_dtype_name(one->dtype),
                           *rank == root ? " and the sum of the counts at the root" : "",
                           one->numel, *rank == root ? " and a whole buffer of another size or "
                           "dtype" : "");
    }
    if (*rank == root && one->numel) {
        const char *a = all->data, *o = one->data;
        if (o < a + total * esize && a < o + one->numel * esize) {
            mpidp_coll_free(x);
            return mpidp__fail(MPIDP_EINVAL, "%s: the root's block overlaps its whole buffer", what);
        }
    }
    *out = x;
    return MPIDP_OK;
}

int mpidp_gatherv_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                        const size_t *counts, int root, mpidp_reqtable_t *reqs,
                        mpidp_coll_t **out)
{
    mpidp_coll_t *x = NULL;
    int rank = 0;
    int rc = vrooted_begin(comm, send, recv, counts, root, reqs, "gather", &rank, &x);
    if (rc != MPIDP_OK) return rc;
    char what[MPIDP_REQ_WHAT_LEN];
    snprintf(what, sizeof what, "MPI_Igatherv of %zu %s to rank %d", send->numel,
             mpidp_dtype_name(send->dtype), root);
    mpidp_req_t slot;
    if ((rc = mpidp__coll_claim(x, what, &slot)) != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Igatherv(send->data, (int)(send->numel * mpidp_dtype_size(send->dtype)), MPI_BYTE,
                      rank == root ? recv->data : NULL, x->counts, x->displs, MPI_BYTE, root,
                      comm, &req);
    return mpidp__coll_post_done(x, slot, rc, req, comm, what, out);
}

int mpidp_scatterv_start(MPI_Comm comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                         const size_t *counts, int root, mpidp_reqtable_t *reqs,
                         mpidp_coll_t **out)
{
    mpidp_coll_t *x = NULL;
    int rank = 0;
    int rc = vrooted_begin(comm, recv, send, counts, root, reqs, "scatter", &rank, &x);
    if (rc != MPIDP_OK) return rc;
    char what[MPIDP_REQ_WHAT_LEN];
    snprintf(what, sizeof what, "MPI_Iscatterv of %zu %s from rank %d", recv->numel,
             mpidp_dtype_name(recv->dtype), root);
    mpidp_req_t slot;
    if ((rc = mpidp__coll_claim(x, what, &slot)) != MPIDP_OK) return rc;
    MPI_Request req;
    rc = MPI_Iscatterv(rank == root ? send->data : NULL, x->counts, x->displs, MPI_BYTE,
                       recv->data, (int)(recv->numel * mpidp_dtype_size(recv->dtype)), MPI_BYTE,
                       root, comm, &req);
    return mpidp__coll_post_done(x, slot, rc, req, comm, what, out);
}
