/* The C API of the C++ "mpidp" backend (c10d_api.h): the core's collectives
 * posted on the caller's thread over the module's request table, each after
 * the ranks' check of its signature (mpidp/callcheck.h), and finished by
 * whichever thread waits for them. */
#include "module.h"

#include <stdlib.h>
#include <string.h>

#include "c10d_api.h"
#include "mpidp/allreduce.h"
#include "mpidp/callcheck.h"
#include "mpidp/collectives.h"
#include "mpidp/mpiops.h"

_Static_assert(MPIDP_C10D_ROW == MPIDP_CALLCHECK_ROW(MPIDP_C10D_SIG_FIELDS),
               "c10d_api.h's row is callcheck.h's");
_Static_assert(MPIDP_C10D_SIG_FIELDS <= MPIDP_CALLCHECK_MAX_FIELDS, "a signature fits the check");
_Static_assert(MPIDP_C10D_POSTED == MPIDP_CALLCHECK_POSTED(MPIDP_C10D_SIG_FIELDS) &&
                   MPIDP_C10D_LATE == MPIDP_CALLCHECK_POSTED_LATE,
               "c10d_api.h's late rank is callcheck.h's");

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

static const mpidp_py_comm_t *py_comm(const void *comm) { return comm; }

/* One collective's arguments, for its post function. */
typedef struct {
    const mpidp_tensor_t *send, *recv; /* recv: the in-place calls' tensor */
    int op, root;
    double timeout_s; /* the allreduce's, should posting a chunk find the table full */
} call_t;

typedef int (*post_fn)(const mpidp_py_comm_t *c, const call_t *a, const mpidp_operation_t **ops,
                       void **op);

static int post_allreduce(const mpidp_py_comm_t *c, const call_t *a,
                          const mpidp_operation_t **ops, void **op)
{
    mpidp_allreduce_opts_t opts = mpidp_allreduce_default_opts(a->recv->dtype, a->op, -1, a->timeout_s,
                                                                "mpidp backend all_reduce");
    *ops = &mpidp_allreduce_operation;
    return mpidp_allreduce_start(c->comm, a->recv, &opts, state->reqs,
                                 (mpidp_allreduce_t **)op);
}

static int post_bcast(const mpidp_py_comm_t *c, const call_t *a, const mpidp_operation_t **ops,
                      void **op)
{
    *ops = &mpidp_coll_operation;
    return mpidp_bcast_start(c->comm, a->recv, a->root, state->reqs, (mpidp_coll_t **)op);
}

static int post_allgather(const mpidp_py_comm_t *c, const call_t *a,
                          const mpidp_operation_t **ops, void **op)
{
    *ops = &mpidp_coll_operation;
    return mpidp_allgather_start(c->comm, a->send, a->recv, state->reqs, (mpidp_coll_t **)op);
}

static int post_reduce_scatter(const mpidp_py_comm_t *c, const call_t *a,
                               const mpidp_operation_t **ops, void **op)
{
    size_t *counts = malloc((size_t)(c->size > 0 ? c->size : 1) * sizeof *counts);
    if (counts == NULL) return MPIDP_ENOMEM;
    for (int r = 0; r < c->size; r++) counts[r] = a->recv->numel;
    *ops = &mpidp_coll_operation;
    int rc = mpidp_reduce_scatter_start(c->comm, a->send, a->recv, counts, a->op, state->reqs,
                                        (mpidp_coll_t **)op);
    free(counts); /* the core keeps its own copy */
    return rc;
}

static int post_barrier(const mpidp_py_comm_t *c, const call_t *a, const mpidp_operation_t **ops,
                        void **op)
{
    (void)a;
    *ops = &mpidp_coll_operation;
    return mpidp_barrier_start(c->comm, state->reqs, (mpidp_coll_t **)op);
}

static post_fn post_of(int64_t call)
{
    switch (call) {
    case MPIDP_C10D_CALL_ALLREDUCE: return post_allreduce;
    case MPIDP_C10D_CALL_BCAST: return post_bcast;
    case MPIDP_C10D_CALL_ALLGATHER: return post_allgather;
    case MPIDP_C10D_CALL_REDUCE_SCATTER: return post_reduce_scatter;
    case MPIDP_C10D_CALL_BARRIER: return post_barrier;
    default: return NULL;
    }
}

/* Posts `a` and runs it to its end: *ended = 0 when it is left in flight. */
static int post_and_finish(const mpidp_py_comm_t *c, post_fn post, const call_t *a,
                           double timeout_s, int *ended)
{
    const mpidp_operation_t *ops = NULL;
    void *op = NULL;
    *ended = 1;
    int rc = post(c, a, &ops, &op);
    if (rc != MPIDP_OK) return rc;
    return mpidp_operation_finish(ops, op, timeout_s, ended);
}

/* The ranks differ, and some posted the predicted call (a row's flag says
 * so): a rank that did not posts its match on scratch buffers, so that
 * their call completes and nothing stays in flight. */
static int complete_the_prediction(const mpidp_py_comm_t *c, mpidp_callcheck_t *check,
                                   double timeout_s)
{
    const int64_t *rows = mpidp_callcheck_rows(check);
    const int64_t *mine = rows + (size_t)c->rank * MPIDP_C10D_ROW, *posted = NULL;
    for (int r = 0; r < c->size && posted == NULL; r++)
        if (rows[(size_t)r * MPIDP_C10D_ROW + MPIDP_CALLCHECK_POSTED(MPIDP_C10D_SIG_FIELDS)])
            posted = rows + (size_t)r * MPIDP_C10D_ROW;
    if (posted == NULL || mine[MPIDP_CALLCHECK_POSTED(MPIDP_C10D_SIG_FIELDS)]) return MPIDP_OK;
    post_fn post = post_of(posted[MPIDP_C10D_SIG_CALL]);
    int dtype = (int)posted[MPIDP_C10D_SIG_DTYPE];
    size_t numel = (size_t)posted[MPIDP_C10D_SIG_NUMEL], esize = mpidp_dtype_size(dtype);
    if (post == NULL || (esize == 0 && posted[MPIDP_C10D_SIG_CALL] != MPIDP_C10D_CALL_BARRIER))
        return MPIDP_ESTATE; /* only the fast calls are predicted */
    /* The input, and the allgather's output (size blocks) or the
     * reduce-scatter's (one block) after it. */
    size_t out = posted[MPIDP_C10D_SIG_CALL] == MPIDP_C10D_CALL_ALLGATHER ? numel * c->size
                 : posted[MPIDP_C10D_SIG_CALL] == MPIDP_C10D_CALL_REDUCE_SCATTER
                     ? numel / (size_t)c->size
                     : 0;
    char *scratch = calloc(numel + out + 1, esize ? esize : 1);
    if (scratch == NULL) return MPIDP_ENOMEM;
    mpidp_tensor_t in = {scratch, numel, dtype, MPIDP_DEV_CPU, 0, 0};
    mpidp_tensor_t res = {scratch + numel * esize, out, dtype, MPIDP_DEV_CPU, 0, 0};
    call_t a = {&in, out ? &res : &in, (int)posted[MPIDP_C10D_SIG_OP],
                (int)posted[MPIDP_C10D_SIG_ROOT], timeout_s};
    int ended = 1;
    int rc = post_and_finish(c, post, &a, timeout_s, &ended);
    if (ended) free(scratch); /* else MPI may still write it: leaked */
    return rc;
}

struct mpidp_c10d_pending {
    /* The check while the call is the prediction not yet resolved: the
     * call's wait watches for a rank that says otherwise. */
    mpidp_callcheck_t *check;
    mpidp_handle_t call;
    int differ;
    /* A predicted call's written tensor as it was before the post, put
     * back where the ranks turn out to differ (NULL: none, or too large to
     * copy on every call). */
    void *saved, *target;
    size_t saved_bytes;
};

/* A predicted call writes its tensor before the ranks know whether they
 * all made it; where they did not, the call still completes (on the
 * others' scratch buffers) and leaves a partial result. Tensors up to this
 * size are copied before the post and put back then; a larger copy on
 * every call would cost a share of the call itself. */
#define RESTORE_MAX_BYTES ((size_t)16 << 10)

static void pending_free(mpidp_c10d_pending_t *p)
{
    free(p->saved);
    free(p);
}

static int api_start(const void *comm, void *check_ptr, const int64_t *sig,
                     const mpidp_tensor_t *send, const mpidp_tensor_t *recv, int op, int root,
                     double timeout_s, mpidp_c10d_pending_t **pending, int *differ)
{
    const mpidp_py_comm_t *c = py_comm(comm);
    mpidp_callcheck_t *check = check_ptr;
    mpidp_error_clear();
    *pending = NULL;
    *differ = 0;
    post_fn post = post_of(sig[MPIDP_C10D_SIG_CALL]);
    /* Made first: once the check said "predicted", the others have posted
     * their part, and a failure here would leave them waiting. */
    mpidp_c10d_pending_t *p = post != NULL ? calloc(1, sizeof *p) : NULL;
    if (post != NULL && p == NULL) return MPIDP_ENOMEM;
    int outcome = MPIDP_CALL_AGREED, rc = MPIDP_OK;
    if (check != NULL) {
        /* A broadcast's root can complete alone: it always exchanges. */
        int exchange = post == NULL || sig[MPIDP_C10D_SIG_CALL] == MPIDP_C10D_CALL_BCAST;
        rc = mpidp_callcheck_begin(check, sig, exchange, state->reqs, timeout_s, &outcome);
        if (rc == MPIDP_OK && outcome == MPIDP_CALL_DIFFER) {
            *differ = 1;
            rc = complete_the_prediction(c, check, timeout_s);
        }
    }
    if (rc != MPIDP_OK || *differ || post == NULL) {
        free(p);
        return rc;
    }
    const mpidp_operation_t *ops = NULL;
    void *posted = NULL;
    call_t a = {send, recv, op, root, timeout_s};
    size_t bytes = recv != NULL ? recv->numel * mpidp_dtype_size(recv->dtype) : 0;
    if (outcome == MPIDP_CALL_PREDICTED && bytes > 0 && bytes <= RESTORE_MAX_BYTES &&
        (p->saved = malloc(bytes)) != NULL) {
        memcpy(p->saved, recv->data, bytes);
        p->target = recv->data;
        p->saved_bytes = bytes;
    }
    if ((rc = post(c, &a, &ops, &posted)) != MPIDP_OK) {
        pending_free(p);
        return rc;
    }
    mpidp_handle_init(&p->call, ops, posted);
    p->check = outcome == MPIDP_CALL_PREDICTED ? check : NULL;
    *pending = p;
    return MPIDP_OK;
}

static int api_progress(mpidp_c10d_pending_t *p, int block, int late, double timeout_s, int *done,
                        int *ended, int *differ)
{
    mpidp_error_clear();
    *done = 0;
    *ended = 1;
    *differ = 0;
    int rc = MPIDP_OK;
    if (p->check != NULL) {
        int outcome = MPIDP_CALL_PREDICTED, resolved = 1;
        rc = block ? mpidp_callcheck_wait(p->check, p->call.ops, p->call.op, state->reqs,
                                          timeout_s, late, &outcome)
                   : mpidp_callcheck_poll(p->check, p->call.ops, p->call.op, state->reqs,
                                          timeout_s, &resolved, &outcome);
        if (rc != MPIDP_OK) {
            /* In flight for good: its buffers and its handle stay. */
            *done = 1;
            *ended = 0;
            pending_free(p);
            return rc;
        }
        if (!resolved) return MPIDP_OK;
        p->check = NULL;
        p->differ = outcome == MPIDP_CALL_DIFFER; /* the others complete it */
    }
    if (block) {
        rc = mpidp_handle_wait(&p->call, timeout_s);
    } else {
        int complete = 0;
        rc = mpidp_handle_test(&p->call, &complete);
        if (!complete) return rc;
    }
    *done = 1;
    *ended = p->call.op == NULL;
    if (p->differ) {
        *differ = MPIDP_C10D_DIFFER_WRITTEN;
        if (*ended && p->saved != NULL) {
            memcpy(p->target, p->saved, p->saved_bytes);
            *differ = MPIDP_C10D_DIFFER;
        }
    }
    pending_free(p);
    return rc;
}

static int api_check_new(const void *comm, double timeout_s, void **check)
{
    mpidp_error_clear();
    return mpidp_callcheck_create(py_comm(comm)->comm, MPIDP_C10D_SIG_FIELDS, state->reqs,
                                  timeout_s, (mpidp_callcheck_t **)check);
}

static void api_check_free(void *check) { mpidp_callcheck_destroy(check); }

static const int64_t *api_check_rows(const void *check) { return mpidp_callcheck_rows(check); }

static void api_raise(int status, const char *what) { mpidp_py_raise(state, status, what); }

static int api_forked(void) { return mpidp_py_forked; }

static const mpidp_c10d_api_t api = {
    MPIDP_C10D_API_VERSION, api_comm_of, api_check_new, api_check_free, api_start, api_progress,
    api_check_rows, api_raise, mpidp_error_set, api_forked, mpidp_py_check_not_forked, MPIDP_OP_SUM, MPIDP_OP_AVG, MPIDP_OP_MIN, MPIDP_OP_MAX,
    MPIDP_OP_PROD};

PyObject *mpidp_py_c10d_api_capsule(mpidp_py_state *st)
{
    state = st;
    return PyCapsule_New((void *)&api, MPIDP_C10D_API_CAPSULE, NULL);
}
