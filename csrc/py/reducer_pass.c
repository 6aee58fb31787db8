/* A backward pass of DataParallel's reducer, on the Python side: what the
 * glue does is read `.grad` (mpidp_grad_seen_t), let the core reducer decide
 * (csrc/core/reducer_pass.c, "the pass" in mpidp/reducer.h), and carry out
 * its actions (mpidp_grad_action_t); plus staging, the copies of buckets
 * between the device the gradients live on and the host buffers MPI reads.
 *
 *   prepare()      before backward: None grads -> their zeroed bucket views,
 *                  so autograd accumulates straight into the buckets;
 *   on_grad(i)     per parameter after accumulation (the hot path): the first
 *                  one of a backward completes a pass still open and queues
 *                  finalize with autograd; a foreign `.grad` is copied in;
 *                  the core marks the parameter and posts full buckets;
 *   finalize()     end of backward: parameters no hook marked are marked
 *                  (zero contribution), so every bucket is posted on every
 *                  rank; blocking mode then completes the pass;
 *   complete()     waits for every bucket; `.grad` of parameters this rank
 *                  had nothing for becomes the mean or None (blocking), or the
 *                  mean is added where the user kept the gradients
 *                  (non-blocking, no step due);
 *   deliver(b) / after_step(b)   non-blocking, a step due: the mean into
 *                  `.grad` for the optimizer, then `.grad` as the user left it.
 * Staging is csrc/py/reducer_staging.c. */
#include "reducer.h"

#include <string.h>

#include "mpidp/status.h"

static PyObject *str_grad, *str_copy_, *str_detach, *str_finalize, *str_version, *str_zero_;

int mpidp_py_reducer_pass_init(void)
{
    if (str_grad) return 0;
    str_grad = PyUnicode_InternFromString("grad");
    str_copy_ = PyUnicode_InternFromString("copy_");
    str_detach = PyUnicode_InternFromString("detach");
    str_finalize = PyUnicode_InternFromString("_finalize_backward");
    str_version = PyUnicode_InternFromString("_version");
    str_zero_ = PyUnicode_InternFromString("zero_");
    if (!(str_grad && str_copy_ && str_detach && str_finalize && str_version && str_zero_)) return -1;
    return mpidp_py_reducer_staging_init();
}

int mpidp_py_reducer_core_status(mpidp_py_reducer_t *r, int rc, const char *what)
{
    if (rc == MPIDP_OK) return 0;
    mpidp_py_raise(r->st, rc, what);
    return -1;
}

/* --- reading and writing .grad ------------------------------------------ */

/* What parameter i's .grad is (mpidp_grad_seen_t), or -1. */
static int observe_one(mpidp_py_reducer_t *r, size_t i)
{
    PyObject *grad = PyObject_GetAttr(PyTuple_GET_ITEM(r->params, i), str_grad);
    if (grad == NULL) return -1;
    int seen = grad == PyTuple_GET_ITEM(r->views, i) ? MPIDP_SEEN_VIEW
               : grad == Py_None                     ? MPIDP_SEEN_NONE
                                                     : MPIDP_SEEN_OTHER;
    Py_DECREF(grad);
    return seen;
}

/* seen[k] for parameters idx[0..n) (idx NULL: 0..n). */
static int observe(mpidp_py_reducer_t *r, const size_t *idx, size_t n, uint8_t *seen)
{
    for (size_t k = 0; k < n; k++) {
        int s = observe_one(r, idx ? idx[k] : k);
        if (s < 0) return -1;
        seen[k] = (uint8_t)s;
    }
    return 0;
}

/* Copies parameter i's foreign .grad into its view and makes the view its .grad. */
static int adopt(mpidp_py_reducer_t *r, size_t i)
{
    PyObject *param = PyTuple_GET_ITEM(r->params, i), *view = PyTuple_GET_ITEM(r->views, i);
    PyObject *grad = PyObject_GetAttr(param, str_grad);
    /* detach(): with create_graph=True the gradient carries a graph, and
     * copying it would make the bucket view part of that graph. */
    PyObject *plain = grad ? PyObject_CallMethodNoArgs(grad, str_detach) : NULL;
    Py_XDECREF(grad);
    if (plain == NULL) return -1;
    PyObject *res = PyObject_CallMethodOneArg(view, str_copy_, plain);
    Py_DECREF(plain);
    if (res == NULL) return -1;
    Py_DECREF(res);
    return PyObject_SetAttr(param, str_grad, view);
}

static int apply_one(mpidp_py_reducer_t *r, size_t i, int action)
{
    PyObject *param = PyTuple_GET_ITEM(r->params, i), *view = PyTuple_GET_ITEM(r->views, i);
    switch (action) {
    case MPIDP_GRAD_KEEP: return 0;
    case MPIDP_GRAD_SET_VIEW: return PyObject_SetAttr(param, str_grad, view);
    case MPIDP_GRAD_SET_NONE: return PyObject_SetAttr(param, str_grad, Py_None);
    case MPIDP_GRAD_ZERO_VIEW:
        return mpidp_py_call_method0(view, str_zero_) < 0 ? -1 : PyObject_SetAttr(param, str_grad, view);
    case MPIDP_GRAD_ADOPT: return adopt(r, i);
    case MPIDP_GRAD_ZERO_ONLY: return mpidp_py_call_method0(view, str_zero_);
    }
    PyErr_Format(PyExc_SystemError, "reducer: unknown .grad action %d", action);
    return -1;
}

static int apply(mpidp_py_reducer_t *r, const size_t *idx, size_t n, const uint8_t *act)
{
    for (size_t k = 0; k < n; k++)
        if (apply_one(r, idx ? idx[k] : k, act[k]) < 0) return -1;
    return 0;
}

/* The version counter of the tensor bucket b's .grad views are views of. */
static int read_version(mpidp_py_reducer_t *r, size_t b, long long *out)
{
    PyObject *t = PyTuple_GET_ITEM(r->device_buckets ? r->device_buckets : r->bucket_tensors, b);
    PyObject *v = PyObject_GetAttr(t, str_version);
    if (v == NULL) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* --- the pass --------------------------------------------------------------- */

static int reset_pass(mpidp_py_reducer_t *r)
{
    if (CORE(r, "DataParallel", mpidp_reducer_reset(r->core)) < 0) return -1;
    memset(r->copy_issued, 0, r->n_buckets);
    return 0;
}

static int wait_core_bucket(mpidp_py_reducer_t *r, size_t b)
{
    if (mpidp_reducer_bucket_state(r->core, b) == MPIDP_BUCKET_DONE) return 0;
    int rc;
    mpidp_error_clear();
    MPIDP_PY_WAIT(r->st, rc, mpidp_reducer_wait_bucket(r->core, b, mpidp_py_timeout_s));
    return mpidp_py_reducer_core_status(r, rc, "DataParallel gradient allreduce");
}

/* What the core's per-bucket decisions take: waits for bucket b, reads its
 * version counter (*now) and what each member's .grad is (r->seen). Returns
 * the number of members (*members points at them), or -1. */
static Py_ssize_t read_bucket(mpidp_py_reducer_t *r, size_t b, long long *now,
                              const size_t **members)
{
    if (wait_core_bucket(r, b) < 0 || read_version(r, b, now) < 0) return -1;
    size_t n = mpidp_reducer_bucket_params(r->core, b, members);
    return observe(r, *members, n, r->seen) < 0 ? -1 : (Py_ssize_t)n;
}

/* Blocking mode: bucket b's mean back where the gradients live, and the
 * .grad of parameters this rank had nothing for fixed up. */
static int complete_bucket(mpidp_py_reducer_t *r, size_t b)
{
    if (wait_core_bucket(r, b) < 0) return -1;
    if (mpidp_reducer_needs_unstaging(r->core, b) &&
        (mpidp_py_reducer_stage(r, b, MPIDP_PY_TO_DEVICE) < 0 || CORE(r, "DataParallel", mpidp_reducer_unstaged(r->core, b)) < 0))
        return -1;
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r->core, b, &members);
    if (CORE(r, "DataParallel", mpidp_reducer_missing_grads(r->core, b, r->act)) < 0) return -1;
    return apply(r, members, n, r->act);
}

/* Non-blocking mode, no step due: the mean is added where the user kept the
 * gradients. `accumulated`: see mpidp_reducer_accumulate. */
static int accumulate_bucket(mpidp_py_reducer_t *r, size_t b, long accumulated)
{
    long long now;
    const size_t *members;
    Py_ssize_t n = read_bucket(r, b, &now, &members);
    if (n < 0 || mpidp_py_reducer_stage(r, b, MPIDP_PY_TO_HOST) < 0) /* what autograd added since */
        return -1;
    if (CORE(r, "DataParallel", mpidp_reducer_accumulate(r->core, b, now, accumulated, r->seen, r->act)) < 0 ||
        apply(r, members, (size_t)n, r->act) < 0)
        return -1;
    return mpidp_py_reducer_stage(r, b, MPIDP_PY_TO_DEVICE);
}

static int complete_pass_from(mpidp_py_reducer_t *r, long accumulated)
{
    if (mpidp_reducer_n_ready(r->core) == 0) return 0;
    if (!mpidp_reducer_finalized(r->core)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "DataParallel: the previous backward pass did not finish (it raised, or "
                        "its end was never reached); its gradients cannot be completed");
        return -1;
    }
    for (size_t b = 0; b < r->n_buckets; b++)
        if ((r->blocking ? complete_bucket(r, b) : accumulate_bucket(r, b, accumulated)) < 0)
            return -1;
    return reset_pass(r);
}

int mpidp_py_reducer_complete(mpidp_py_reducer_t *r) { return complete_pass_from(r, -1); }

int mpidp_py_reducer_prepare(mpidp_py_reducer_t *r)
{
    /* A pass still open must be completed (or its step applied) before grads
     * move; in non-blocking mode DataParallel.forward decides which. */
    if (mpidp_reducer_finalized(r->core) && r->blocking && mpidp_py_reducer_complete(r) < 0)
        return -1;
    if (mpidp_reducer_n_ready(r->core) != 0) return 0;
    if (observe(r, NULL, r->n_params, r->seen) < 0 ||
        CORE(r, "DataParallel", mpidp_reducer_prepare(r->core, r->seen, r->act)) < 0)
        return -1;
    return apply(r, NULL, r->n_params, r->act);
}

int mpidp_py_reducer_on_grad(mpidp_py_reducer_t *r, size_t i, PyObject *param)
{
    if (mpidp_py_forked) return mpidp_py_check_not_forked("DataParallel backward");
    if (!r->queued) {
        /* First hook of a new backward: finish a previous pass still open
         * (non-blocking mode, or two backwards before one step), then ask
         * autograd to call us when this backward ends. */
        if (mpidp_reducer_finalized(r->core) && complete_pass_from(r, (long)i) < 0) return -1;
        PyObject *cb = PyObject_GetAttr((PyObject *)r, str_finalize);
        PyObject *res = cb ? PyObject_CallOneArg(r->queue_callback, cb) : NULL;
        Py_XDECREF(cb);
        if (res == NULL) return -1;
        Py_DECREF(res);
        r->queued = 1;
    }
    PyObject *grad = PyObject_GetAttr(param, str_grad);
    if (grad == NULL) return -1;
    int has = grad != Py_None, foreign = has && grad != PyTuple_GET_ITEM(r->views, i);
    Py_DECREF(grad);
    if (foreign && adopt(r, i) < 0) return -1;
    mpidp_error_clear();
    int rc = mpidp_reducer_grad_arrived(r->core, i, has);
    /* Open MPI advances non-blocking collectives only inside MPI calls: test
     * what is in flight so buckets posted earlier progress during backward. */
    if (rc == MPIDP_OK && mpidp_py_hook_progress) rc = mpidp_reqtable_progress(r->st->reqs, NULL);
    if (mpidp_py_reducer_core_status(r, rc, "DataParallel backward") < 0) return -1;
    return r->device_buckets ? mpidp_py_reducer_stage_full(r, 0) : 0;
}

int mpidp_py_reducer_finalize(mpidp_py_reducer_t *r)
{
    r->queued = 0;
    for (size_t i = 0; i < r->n_params; i++) {
        if (mpidp_reducer_is_ready(r->core, i)) continue;
        int seen = observe_one(r, i);
        if (seen < 0 || apply_one(r, i, mpidp_reducer_unhooked_action(r->core, i, seen)) < 0 ||
            CORE(r, "DataParallel backward", mpidp_reducer_mark_unhooked(r->core, i, seen)) < 0 ||
            (r->device_buckets && mpidp_py_reducer_stage_full(r, 0) < 0))
            return -1;
    }
    /* Every bucket is full now: wait for the copies still on their way to the
     * host, so that every bucket is posted when backward returns. */
    if (r->device_buckets && mpidp_py_reducer_stage_full(r, 1) < 0) return -1;
    /* Non-blocking: every bucket is posted (and zeroed); any in-place change
     * from now on is the user's (zero_grad(set_to_none=False)) or a new backward. */
    for (size_t b = 0; !r->blocking && b < r->n_buckets; b++)
        if (read_version(r, b, &r->versions[b]) < 0) return -1;
    if (CORE(r, "DataParallel backward",
             mpidp_reducer_finalize(r->core, r->blocking ? NULL : r->versions)) < 0 ||
        mpidp_py_warn_fp16_overflow() < 0)
        return -1;
    return r->blocking ? mpidp_py_reducer_complete(r) : 0;
}

/* Delivers bucket b's mean into `.grad` as the core's `deliver` decides
 * (deliver_for_step or deliver_now: same arguments), then copies it to where
 * the gradients live. */
typedef int (*deliver_fn)(mpidp_reducer_t *, size_t, long long, const uint8_t *, uint8_t *);

static int deliver_bucket(mpidp_py_reducer_t *r, size_t b, deliver_fn deliver)
{
    long long now;
    const size_t *members;
    Py_ssize_t n = read_bucket(r, b, &now, &members);
    if (n < 0 ||
        CORE(r, "DataParallel (non-blocking)", deliver(r->core, b, now, r->seen, r->act)) < 0 ||
        apply(r, members, (size_t)n, r->act) < 0)
        return -1;
    return mpidp_py_reducer_stage(r, b, MPIDP_PY_TO_DEVICE);
}

int mpidp_py_reducer_deliver(mpidp_py_reducer_t *r, size_t b)
{
    if (mpidp_reducer_delivered(r->core, b)) return 0;
    return deliver_bucket(r, b, mpidp_reducer_deliver_for_step);
}

int mpidp_py_reducer_after_step(mpidp_py_reducer_t *r, size_t b)
{
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r->core, b, &members);
    int over = 0;
    if (CORE(r, "DataParallel", mpidp_reducer_after_step(r->core, b, r->act, &over)) < 0 ||
        apply(r, members, n, r->act) < 0)
        return -1;
    return over ? reset_pass(r) : 0;
}

int mpidp_py_reducer_deliver_now(mpidp_py_reducer_t *r)
{
    for (size_t b = 0; b < r->n_buckets; b++)
        if (deliver_bucket(r, b, mpidp_reducer_deliver_now) < 0) return -1;
    return reset_pass(r);
}

int mpidp_py_reducer_edited(mpidp_py_reducer_t *r)
{
    for (size_t b = 0; b < r->n_buckets; b++) {
        long long now;
        if (read_version(r, b, &now) < 0) return -1;
        if (mpidp_reducer_version_moved(r->core, b, now)) return 1;
    }
    return 0;
}

int mpidp_py_reducer_shadow_pass(mpidp_py_reducer_t *r)
{
    if (CORE(r, "DataParallel.join", mpidp_reducer_contribute_nothing(r->core)) < 0) return -1;
    /* Staged buckets are posted only once copied from the device: zero them
     * there first (the core does not write staged gradients). */
    for (size_t b = 0; r->device_buckets && b < r->n_buckets; b++)
        if (mpidp_py_call_method0(PyTuple_GET_ITEM(r->device_buckets, b), str_zero_) < 0) return -1;
    if (r->device_buckets && mpidp_py_reducer_stage_full(r, 1) < 0) return -1;
    for (size_t b = 0; b < r->n_buckets; b++)
        if (wait_core_bucket(r, b) < 0) return -1;
    return reset_pass(r);
}
