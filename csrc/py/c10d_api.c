/* The C API of the C++ "mpidp" backend (c10d_api.h): the core's collectives
 * run to their end on the caller's thread, over the module's request table. */
#include "module.h"

#include <stdlib.h>

#include "c10d_api.h"
#include "mpidp/agree.h"
#include "mpidp/allreduce.h"
#include "mpidp/collectives.h"
#include "mpidp/mpiops.h"

/* The module's state, set when the capsule is made (one _C per process). */
static mpidp_py_state *state;

static const void *api_comm_of(PyObject *obj, int *rank, int *size)
{
    mpidp_py_comm_t *c = mpidp_py_as_comm(state, obj, "comm");
    if (c == NULL) return NULL;
    *rank = c->rank;
    *size = c->size;
    return c;
}

static MPI_Comm comm_of(const void *comm) { return ((const mpidp_py_comm_t *)comm)->comm; }

/* Posted with status rc: run to the end, or (nothing posted) the status. */
static int finish(int rc, const mpidp_operation_t *ops, void *x, double timeout_s, int *ended)
{
    *ended = 1;
    if (rc != MPIDP_OK) return rc;
    *ended = 0;
    return mpidp_operation_finish(ops, x, timeout_s, ended);
}

static int api_allreduce(const void *comm, const mpidp_tensor_t *t, int op, double timeout_s,
                         int *ended)
{
    mpidp_error_clear();
    mpidp_allreduce_opts_t opts = mpidp_allreduce_default_opts(t->dtype, op, -1, timeout_s,
                                                                "mpidp backend all_reduce");
    mpidp_allreduce_t *x = NULL;
    int rc = mpidp_allreduce_start(comm_of(comm), t, &opts, state->reqs, &x);
    return finish(rc, &mpidp_allreduce_operation, x, timeout_s, ended);
}

static int api_bcast(const void *comm, const mpidp_tensor_t *t, int root, double timeout_s,
                     int *ended)
{
    mpidp_error_clear();
    mpidp_coll_t *x = NULL;
    int rc = mpidp_bcast_start(comm_of(comm), t, root, state->reqs, &x);
    return finish(rc, &mpidp_coll_operation, x, timeout_s, ended);
}

static int api_allgather(const void *comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                         double timeout_s, int *ended)
{
    mpidp_error_clear();
    mpidp_coll_t *x = NULL;
    int rc = mpidp_allgather_start(comm_of(comm), send, recv, state->reqs, &x);
    return finish(rc, &mpidp_coll_operation, x, timeout_s, ended);
}

static int api_reduce_scatter(const void *comm, const mpidp_tensor_t *send,
                              const mpidp_tensor_t *recv, int op, double timeout_s, int *ended)
{
    mpidp_error_clear();
    int size = ((const mpidp_py_comm_t *)comm)->size;
    size_t *counts = malloc((size_t)(size > 0 ? size : 1) * sizeof *counts);
    *ended = 1;
    if (counts == NULL) return MPIDP_ENOMEM;
    for (int r = 0; r < size; r++) counts[r] = recv->numel;
    mpidp_coll_t *x = NULL;
    int rc = mpidp_reduce_scatter_start(comm_of(comm), send, recv, counts, op, state->reqs, &x);
    free(counts);     /* the core keeps its own copy */
    return finish(rc, &mpidp_coll_operation, x, timeout_s, ended);
}

static int api_barrier(const void *comm, double timeout_s, int *ended)
{
    mpidp_error_clear();
    mpidp_coll_t *x = NULL;
    int rc = mpidp_barrier_start(comm_of(comm), state->reqs, &x);
    return finish(rc, &mpidp_coll_operation, x, timeout_s, ended);
}

static int api_agree(const void *comm, const int64_t *sig, size_t n, double timeout_s, int *agreed)
{
    mpidp_error_clear();
    return mpidp_agree(comm_of(comm), sig, n, state->reqs, timeout_s, agreed);
}

static void api_raise(int status, const char *what) { mpidp_py_raise(state, status, what); }

static int api_forked(void) { return mpidp_py_forked; }

static const mpidp_c10d_api_t api = {
    MPIDP_C10D_API_VERSION, api_comm_of, api_allreduce, api_bcast, api_allgather,
    api_reduce_scatter, api_barrier, api_agree, api_raise, api_forked, mpidp_py_check_not_forked,
    MPIDP_OP_SUM, MPIDP_OP_AVG, MPIDP_OP_MIN, MPIDP_OP_MAX, MPIDP_OP_PROD};

PyObject *mpidp_py_c10d_api_capsule(mpidp_py_state *st)
{
    state = st;
    return PyCapsule_New((void *)&api, MPIDP_C10D_API_CAPSULE, NULL);
}
