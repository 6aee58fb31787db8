/* mpidp._C.Reducer and mpidp._C.GradHook: DataParallel's gradient path.
 *
 * Python plans the buckets, allocates one flat tensor per bucket and makes a
 * view into it for every trainable parameter; the Reducer keeps all of them
 * and drives the core reducer (csrc/core/reducer.c).
 *
 * One pass (one backward):
 *   prepare()          before backward (DataParallel.forward): every `.grad`
 *                      that is None is pointed at its zeroed bucket view, so
 *                      autograd accumulates straight into the bucket;
 *   GradHook(param)    per parameter, after its gradient is accumulated: the
 *                      first one queues _finalize_backward with autograd; if
 *                      `.grad` is not the bucket view any more (set to None or
 *                      replaced after prepare) it is copied in and re-pointed;
 *                      the core marks the parameter ready and posts buckets;
 *   _finalize_backward at the end of backward: parameters that got no
 *                      gradient are marked (zero contribution), so every
 *                      bucket is posted on every rank; blocking mode then
 *                      completes the pass;
 *   wait_bucket / complete   wait, then fix up `.grad` of parameters this rank
 *                      had no gradient for: the bucket view if another rank
 *                      had one, else back to None (as a single process would).
 *
 * Non-blocking mode (`separate`): the core copies each bucket into its own
 * communication buffer when posting and zeroes the bucket, and
 * _finalize_backward records each bucket tensor's version counter. The
 * results are delivered later, in one of two ways:
 *   deliver_for_step(params) + after_step(params): the next forward applies
 *                      the optimizer step, bucket by bucket. Delivery notes
 *                      what the user did to each `.grad` meanwhile -- set it
 *                      to None, zeroed it in place (the version counter
 *                      moved), or nothing -- points `.grad` at the mean for
 *                      the step, and after_step restores the user's intent
 *                      (None, zeros, or the mean kept, as a single process
 *                      would have it after the step).
 *   complete()          no step is due (gradient accumulation): the mean is
 *                      added to whatever the bucket holds now, unless the
 *                      user cleared the gradients since.
 */
#include "module.h"

#include <structmember.h> /* PyMemberDef, T_PYSSIZET (Python < 3.12) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/bucket.h"
#include "mpidp/reducer.h"
#include "mpidp/status.h"

/* after[i]: the mpidp_after_step_t decided when the mean was delivered for a
 * deferred step (non-blocking), or AFTER_DONE once carried out. */
enum { AFTER_DONE = 0xFF };

typedef struct {
    PyObject_HEAD
    mpidp_reducer_t *core;
    mpidp_py_state *st;
    PyObject *module;
    PyObject *comm;
    PyObject *params;          /* tuple of parameters */
    PyObject *views;           /* tuple of gradient views into the buckets */
    PyObject *bucket_tensors;  /* tuple of flat bucket tensors (host memory) */
    PyObject *device_buckets;  /* staging: the buckets the .grad views live in, or NULL */
    PyObject *host_grads;      /* staging: per bucket, the gradient part of the host bucket */
    PyObject *dev_grads;       /* ... and of the device bucket (narrowed once, at construction) */
    PyObject *event_type;      /* staging on a GPU: torch.cuda.Event (copies run
                                * asynchronously, tracked by events); NULL: synchronous */
    PyObject **stage_event;    /* per bucket: the recorded event of its copy to the host */
    uint8_t *copy_issued;      /* per bucket: copied (or copying) to the host in this pass */
    PyObject *queue_callback;  /* autograd's Variable._execution_engine.queue_callback */
    mpidp_py_borrowed_t *buckets;
    size_t n_buckets;
    size_t n_params;
    uint8_t *was_none;         /* `.grad` was None when prepare() pointed it at the view */
    uint8_t *local_has;        /* this rank contributed a gradient in this pass */
    int blocking;
    int separate;              /* non-blocking mode: separate communication buffers */
    int queued;                /* _finalize_backward queued for the current backward */
    int finalized;             /* the current pass has every bucket posted */
    long long *version;        /* per bucket: version counter when the pass was posted */
    uint8_t *delivered;        /* per bucket: result delivered for a step */
    uint8_t *after;            /* per parameter: mpidp_after_step_t, or AFTER_DONE */
    size_t n_done;             /* parameters whose after-step action is done */
} reducer_t;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    reducer_t *reducer;
    Py_ssize_t index;
} gradhook_t;

static PyObject *str_grad, *str_copy_, *str_detach, *str_finalize, *str_version;
static PyObject *kw_non_blocking; /* ("non_blocking",): keyword names of stage()'s copy_ */

/* --- helpers ----------------------------------------------------------- */

static PyObject *fail(reducer_t *r, int rc, const char *what)
{
    return mpidp_py_raise(r->st, rc, what);
}

/* 0 when the core call's status is MPIDP_OK, else -1 with the exception set. */
static int core_status(reducer_t *r, int rc, const char *what)
{
    if (rc == MPIDP_OK) return 0;
    fail(r, rc, what);
    return -1;
}

/* A core call with a fresh error detail: CORE(r, "what", mpidp_reducer_x(...)) < 0 on failure. */
#define CORE(r, what, call) (mpidp_error_clear(), core_status((r), (call), (what)))

/* --- staging (gradients in GPU memory, reduced through host buckets) ------ */

/* Copies the gradient part of bucket b between its device and host buffers
 * (the flags that follow it live on the host only). On a GPU the copy is
 * asynchronous (pinned host memory, torch's current stream): to the host it
 * is followed by an event that says when the host bytes are there; back to
 * the device, stream order puts it before everything that reads the
 * gradients, and the host bucket is next written only after the next pass's
 * copy to the host has completed (see stage_full_buckets). */
enum { TO_HOST, TO_HOST_ASYNC, TO_DEVICE };

static int stage(reducer_t *r, size_t b, int how)
{
    if (r->device_buckets == NULL) return 0;
    int to_host = how != TO_DEVICE;
    /* Only the backward hooks' copies to the host may run ahead (their arrival
     * is checked before the core reads them); every other caller reads the
     * host bucket right away. */
    int non_blocking = r->event_type != NULL && how != TO_HOST;
    PyObject *h = PyTuple_GET_ITEM(r->host_grads, b), *d = PyTuple_GET_ITEM(r->dev_grads, b);
    /* dst.copy_(src, non_blocking=...), without building arguments per call */
    PyObject *argv[] = {to_host ? h : d, to_host ? d : h, non_blocking ? Py_True : Py_False};
    PyObject *res = PyObject_VectorcallMethod(str_copy_, argv, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                              kw_non_blocking);
    if (res == NULL) return -1;
    Py_DECREF(res);
    if (how == TO_HOST_ASYNC && non_blocking) {
        PyObject *ev = PyObject_CallNoArgs(r->event_type);
        PyObject *rec = ev ? PyObject_CallMethod(ev, "record", NULL) : NULL;
        if (rec == NULL) {
            Py_XDECREF(ev);
            return -1;
        }
        Py_DECREF(rec);
        Py_XSETREF(r->stage_event[b], ev);
    }
    return 0;
}

/* Tells the core that bucket b's gradients are in its host buffer (after its
 * copy's event, if any, has passed: `wait` waits for it, else only a copy
 * already done counts). Returns 1 when told, 0 when the copy is still running. */
static int report_staged(reducer_t *r, size_t b, int wait)
{
    PyObject *ev = r->stage_event[b];
    if (ev != NULL) {
        PyObject *res = PyObject_CallMethod(ev, wait ? "synchronize" : "query", NULL);
        if (res == NULL) return -1;
        int done = wait || PyObject_IsTrue(res);
        Py_DECREF(res);
        if (!done) return 0;
        Py_CLEAR(r->stage_event[b]);
    }
    if (CORE(r, "DataParallel backward", mpidp_reducer_staged(r->core, b)) < 0) return -1;
    return 1;
}

/* What the core asks after parameters were marked: copy every full bucket to
 * the host, and tell it which copies have arrived (it then posts in bucket
 * order). With `flush`, wait for every copy: everything full gets posted. */
static int stage_full_buckets(reducer_t *r, int flush)
{
    size_t b, from = 0;
    while (from < r->n_buckets && mpidp_reducer_next_to_stage(r->core, from, &b)) {
        from = b + 1;
        if (!r->copy_issued[b]) {
            if (stage(r, b, TO_HOST_ASYNC) < 0) return -1;
            r->copy_issued[b] = 1;
            if (r->separate) {
                /* The core zeroes the host bucket once it is copied for sending;
                 * the device bucket, where the .grad views are, must match
                 * (stream order puts this after the copy). */
                PyObject *res = PyObject_CallMethod(PyTuple_GET_ITEM(r->device_buckets, b), "zero_", NULL);
                if (res == NULL) return -1;
                Py_DECREF(res);
            }
        }
        if (report_staged(r, b, flush) < 0) return -1;
    }
    return 0;
}

/* After bucket b completed: its averaged result back to the device. */
static int unstage(reducer_t *r, size_t b)
{
    if (!mpidp_reducer_needs_unstaging(r->core, b)) return 0;
    if (stage(r, b, TO_DEVICE) < 0) return -1;
    if (CORE(r, "DataParallel", mpidp_reducer_unstaged(r->core, b)) < 0) return -1;
    return 0;
}

/* The tensor whose version counter tells whether the user touched the .grad
 * views of bucket b: the one they are views of. */
static PyObject *grad_bucket(reducer_t *r, size_t b)
{
    return PyTuple_GET_ITEM(r->device_buckets ? r->device_buckets : r->bucket_tensors, b);
}

/* Copies `grad` into parameter i's bucket view and makes the view its .grad. */
static int adopt_grad(reducer_t *r, size_t i, PyObject *param, PyObject *grad)
{
    PyObject *view = PyTuple_GET_ITEM(r->views, i);
    /* detach(): with create_graph=True the new gradient carries a graph, and
     * copying it would make the bucket view part of that graph. */
    PyObject *plain = PyObject_CallMethodNoArgs(grad, str_detach);
    if (plain == NULL) return -1;
    PyObject *res = PyObject_CallMethodOneArg(view, str_copy_, plain);
    Py_DECREF(plain);
    if (res == NULL) return -1;
    Py_DECREF(res);
    return PyObject_SetAttr(param, str_grad, view);
}

/* Decides this rank's contribution for parameter i from its current .grad
 * (copying a foreign tensor in) and marks it ready in the core. */
static int mark_param(reducer_t *r, size_t i)
{
    PyObject *param = PyTuple_GET_ITEM(r->params, i);
    PyObject *view = PyTuple_GET_ITEM(r->views, i);
    PyObject *grad = PyObject_GetAttr(param, str_grad);
    if (grad == NULL) return -1;
    int has, rc = 0;
    if (grad == view) {
        /* Our view: a real gradient, unless it only holds prepare()'s zeros. */
        has = !r->was_none[i];
    } else if (grad == Py_None) {
        has = 0;
    } else {
        rc = adopt_grad(r, i, param, grad);
        has = 1;
        r->was_none[i] = 0;
    }
    Py_DECREF(grad);
    if (rc < 0) return -1;
    if (!has && r->device_buckets != NULL) {
        /* The bucket is copied from the device before sending: zero there too. */
        PyObject *res = PyObject_CallMethod(view, "zero_", NULL);
        if (res == NULL) return -1;
        Py_DECREF(res);
    }
    r->local_has[i] = (uint8_t)has;
    if (CORE(r, "DataParallel backward", mpidp_reducer_mark_ready(r->core, i, has)) < 0) return -1;
    return r->device_buckets ? stage_full_buckets(r, 0) : 0;
}

/* After bucket b completed: give parameters this rank had no gradient for the
 * state a single process would see: the averaged gradient if some rank had
 * one, else None. */
static int fix_missing_grads(reducer_t *r, size_t b)
{
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r->core, b, &members);
    for (size_t k = 0; k < n; k++) {
        size_t i = members[k];
        if (r->local_has[i]) continue;
        int used = 0;
        if (CORE(r, "DataParallel", mpidp_reducer_used_globally(r->core, i, &used)) < 0) return -1;
        PyObject *param = PyTuple_GET_ITEM(r->params, i);
        PyObject *value = used ? PyTuple_GET_ITEM(r->views, i) : Py_None;
        if (PyObject_SetAttr(param, str_grad, value) < 0) return -1;
        r->local_has[i] = 1; /* fixed: do not visit again in this pass */
    }
    return 0;
}

static int wait_bucket(reducer_t *r, size_t b)
{
    if (mpidp_reducer_bucket_state(r->core, b) != MPIDP_BUCKET_DONE) {
        int rc;
        mpidp_error_clear();
        MPIDP_PY_WAIT(r->st, rc, mpidp_reducer_wait_bucket(r->core, b, mpidp_py_timeout_s));
        if (core_status(r, rc, "DataParallel gradient allreduce") < 0) return -1;
    }
    if (unstage(r, b) < 0) return -1;
    return fix_missing_grads(r, b);
}

static int read_version(reducer_t *r, size_t b, long long *out)
{
    PyObject *v = PyObject_GetAttr(grad_bucket(r, b), str_version);
    if (v == NULL) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int reset_pass(reducer_t *r)
{
    if (CORE(r, "DataParallel", mpidp_reducer_reset(r->core)) < 0) return -1;
    memset(r->local_has, 0, r->n_params);
    memset(r->was_none, 0, r->n_params);
    memset(r->copy_issued, 0, r->n_buckets);
    if (r->separate) {
        memset(r->delivered, 0, r->n_buckets);
        memset(r->after, 0, r->n_params);
        r->n_done = 0;
    }
    r->finalized = 0;
    return 0;
}

static int wait_core_bucket(reducer_t *r, size_t b)
{
    if (mpidp_reducer_bucket_state(r->core, b) == MPIDP_BUCKET_DONE) return 0;
    int rc;
    mpidp_error_clear();
    MPIDP_PY_WAIT(r->st, rc, mpidp_reducer_wait_bucket(r->core, b, mpidp_py_timeout_s));
    if (core_status(r, rc, "DataParallel gradient allreduce") < 0) return -1;
    return 0;
}

static int deliver(reducer_t *r, size_t i, int mode)
{
    if (CORE(r, "DataParallel", mpidp_reducer_deliver(r->core, i, mode)) < 0) return -1;
    return 0;
}

/* Non-blocking mode, no step due: adds the mean into the bucket unless the
 * user cleared the gradients since backward. `accumulated` is a parameter
 * whose new gradient autograd has already added to its view (a second
 * backward started before any forward), -1 if none: that addition moved the
 * bucket's version counter by one and is not the user clearing anything. */
static int complete_separate(reducer_t *r, long accumulated)
{
    for (size_t b = 0; b < r->n_buckets; b++) {
        if (wait_core_bucket(r, b) < 0) return -1;
        long long now;
        if (read_version(r, b, &now) < 0) return -1;
        long long expected = r->version[b];
        if (accumulated >= 0 && mpidp_reducer_bucket_of(r->core, (size_t)accumulated) == b) expected++;
        int cleared = now != expected;
        if (stage(r, b, TO_HOST) < 0) return -1;  /* what autograd added since, if anything */
        const size_t *members;
        size_t n = mpidp_reducer_bucket_params(r->core, b, &members);
        for (size_t k = 0; k < n; k++) {
            size_t i = members[k];
            PyObject *param = PyTuple_GET_ITEM(r->params, i);
            PyObject *grad = PyObject_GetAttr(param, str_grad);
            if (grad == NULL) return -1;
            int is_view = grad == PyTuple_GET_ITEM(r->views, i);
            Py_DECREF(grad);
            int used = 0;
            mpidp_reducer_used_globally(r->core, i, &used);
            mpidp_accum_action_t act = mpidp_reducer_accumulate_action(
                is_view, cleared, used, r->was_none[i], (long)i == accumulated);
            if (act == MPIDP_ACCUM_DROP) continue;
            if (deliver(r, i, MPIDP_DELIVER_ADD) < 0) return -1;
            if (act == MPIDP_ACCUM_ADD_THEN_NONE && PyObject_SetAttr(param, str_grad, Py_None) < 0)
                return -1;
        }
        if (stage(r, b, TO_DEVICE) < 0) return -1;
    }
    return reset_pass(r);
}

/* Completes the open pass: waits for every bucket, fixes grads, resets. */
static int complete_pass_from(reducer_t *r, long accumulated)
{
    if (mpidp_reducer_n_ready(r->core) == 0) return 0;
    if (!r->finalized) {
        PyErr_SetString(PyExc_RuntimeError,
                        "DataParallel: the previous backward pass did not finish (it raised, or "
                        "its end was never reached); its gradients cannot be completed");
        return -1;
    }
    if (r->separate) {
        if (r->n_done != 0) {
            PyErr_SetString(PyExc_RuntimeError, "DataParallel: a deferred optimizer step is half "
                            "applied; finish it before completing the pass");
            return -1;
        }
        return complete_separate(r, accumulated);
    }
    for (size_t b = 0; b < r->n_buckets; b++)
        if (wait_bucket(r, b) < 0) return -1;
    return reset_pass(r);
}

static int complete_pass(reducer_t *r) { return complete_pass_from(r, -1); }

/* Non-blocking mode, a step is due: delivers bucket b's mean into its
 * parameters' `.grad` for the optimizer, remembering what each `.grad`
 * must become after the step. */
static int deliver_bucket_for_step(reducer_t *r, size_t b)
{
    if (r->delivered[b]) return 0;
    if (wait_core_bucket(r, b) < 0) return -1;
    long long now;
    if (read_version(r, b, &now) < 0) return -1;
    int cleared = now != r->version[b];
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r->core, b, &members);
    for (size_t k = 0; k < n; k++) {
        size_t i = members[k];
        PyObject *param = PyTuple_GET_ITEM(r->params, i);
        PyObject *view = PyTuple_GET_ITEM(r->views, i);
        PyObject *grad = PyObject_GetAttr(param, str_grad);
        if (grad == NULL) return -1;
        int is_view = grad == view, is_none = grad == Py_None;
        Py_DECREF(grad);
        if (!is_view && !is_none) {
            PyErr_Format(PyExc_RuntimeError,
                         "DataParallel (non-blocking): the .grad of parameter %zu was replaced "
                         "between backward and the step; the averaged gradient is applied at the "
                         "next forward, so gradients cannot be edited in between (use "
                         "blocking_parameter_updates=True for that)", i);
            return -1;
        }
        int used = 0;
        mpidp_reducer_used_globally(r->core, i, &used);
        r->after[i] = (uint8_t)mpidp_reducer_after_step(is_none, cleared, used, r->was_none[i]);
        if (deliver(r, i, MPIDP_DELIVER_COPY) < 0) return -1;
        /* For the step: the mean, or None where no rank had a gradient (the
         * optimizer then skips the parameter, as in a single process). */
        if (PyObject_SetAttr(param, str_grad, used ? view : Py_None) < 0) return -1;
    }
    if (stage(r, b, TO_DEVICE) < 0) return -1;
    r->delivered[b] = 1;
    return 0;
}

static int after_step_param(reducer_t *r, size_t i)
{
    if (r->after[i] == AFTER_DONE) return 0;
    PyObject *param = PyTuple_GET_ITEM(r->params, i);
    PyObject *view = PyTuple_GET_ITEM(r->views, i);
    PyObject *value = r->after[i] == MPIDP_AFTER_NONE ? Py_None : view;
    if (r->after[i] == MPIDP_AFTER_ZEROED) {
        PyObject *res = PyObject_CallMethod(view, "zero_", NULL);
        if (res == NULL) return -1;
        Py_DECREF(res);
    }
    if (PyObject_SetAttr(param, str_grad, value) < 0) return -1;
    r->after[i] = AFTER_DONE;
    r->n_done++;
    return 0;
}

/* --- the per-parameter hook (hot path) --------------------------------- */

static PyObject *on_grad(reducer_t *r, size_t i, PyObject *param)
{
    if (!r->queued) {
        /* First hook of a new backward: finish a previous pass still open
         * (non-blocking mode, or two backwards before one step), then ask
         * autograd to call us when this backward ends. */
        if (r->finalized && complete_pass_from(r, (long)i) < 0) return NULL;
        PyObject *cb = PyObject_GetAttr((PyObject *)r, str_finalize);
        if (cb == NULL) return NULL;
        PyObject *res = PyObject_CallOneArg(r->queue_callback, cb);
        Py_DECREF(cb);
        if (res == NULL) return NULL;
        Py_DECREF(res);
        r->queued = 1;
    }
    PyObject *view = PyTuple_GET_ITEM(r->views, i);
    PyObject *grad = PyObject_GetAttr(param, str_grad);
    if (grad == NULL) return NULL;
    int rc = 0;
    if (grad != view && grad != Py_None) rc = adopt_grad(r, i, param, grad);
    int has = grad != Py_None;
    Py_DECREF(grad);
    if (rc < 0) return NULL;
    r->was_none[i] = 0;  /* a gradient arrived: the view holds real data */
    r->local_has[i] = (uint8_t)has;
    mpidp_error_clear();
    rc = mpidp_reducer_mark_ready(r->core, i, has);
    /* Open MPI advances non-blocking collectives only inside MPI calls: test
     * what is in flight so buckets posted earlier progress during backward. */
    if (rc == MPIDP_OK && mpidp_py_hook_progress) rc = mpidp_reqtable_progress(r->st->reqs, NULL);
    if (rc != MPIDP_OK) return fail(r, rc, "DataParallel backward");
    if (r->device_buckets && stage_full_buckets(r, 0) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *gradhook_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames)
{
    gradhook_t *h = (gradhook_t *)self;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL)
        return PyErr_Format(PyExc_TypeError, "GradHook takes exactly one argument (the parameter)");
    return on_grad(h->reducer, (size_t)h->index, args[0]);
}

/* --- Reducer methods ---------------------------------------------------- */

static PyObject *reducer_finalize_backward(reducer_t *r, PyObject *unused)
{
    (void)unused;
    r->queued = 0;
    for (size_t i = 0; i < r->n_params; i++)
        if (!mpidp_reducer_is_ready(r->core, i) && mark_param(r, i) < 0) return NULL;
    /* Every bucket is full now: wait for the copies still on their way to the
     * host, so that every bucket is posted when backward returns. */
    if (r->device_buckets && stage_full_buckets(r, 1) < 0) return NULL;
    r->finalized = 1;
    if (r->separate) {
        /* Every bucket is posted (and zeroed): any in-place change from now on
         * is the user's (zero_grad with set_to_none=False) or a new backward. */
        for (size_t b = 0; b < r->n_buckets; b++)
            if (read_version(r, b, &r->version[b]) < 0) return NULL;
    }
    if (r->blocking && complete_pass(r) < 0) return NULL;
    Py_RETURN_NONE;
}

/* deliver_for_step(params): non-blocking mode, a step is due: deliver the
 * buckets holding these parameters (and so every parameter in them). */
static PyObject *reducer_deliver_for_step(reducer_t *r, PyObject *indices)
{
    if (!r->separate || !r->finalized)
        return PyErr_Format(PyExc_RuntimeError, "deliver_for_step: no finished non-blocking pass");
    PyObject *fast = PySequence_Fast(indices, "indices must be a sequence");
    if (fast == NULL) return NULL;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(fast); k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, k));
        if ((i == -1 && PyErr_Occurred()) || i < 0 || (size_t)i >= r->n_params ||
            deliver_bucket_for_step(r, mpidp_reducer_bucket_of(r->core, (size_t)i)) < 0) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_IndexError, "parameter %zd out of range", i);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

/* after_step(params): restore `.grad` as the user left it; when every
 * parameter is done, the pass is over. */
static PyObject *reducer_after_step(reducer_t *r, PyObject *indices)
{
    if (!r->separate || !r->finalized)
        return PyErr_Format(PyExc_RuntimeError, "after_step: no finished non-blocking pass");
    PyObject *fast = PySequence_Fast(indices, "indices must be a sequence");
    if (fast == NULL) return NULL;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(fast); k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, k));
        if ((i == -1 && PyErr_Occurred()) || i < 0 || (size_t)i >= r->n_params ||
            !r->delivered[mpidp_reducer_bucket_of(r->core, (size_t)i)] ||
            after_step_param(r, (size_t)i) < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_RuntimeError, "after_step: parameter %zd was not delivered", i);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    if (r->n_done == r->n_params && reset_pass(r) < 0) return NULL;
    Py_RETURN_NONE;
}

/* set_divisor(n): average over n ranks from the next pass on (join). */
static PyObject *reducer_set_divisor(reducer_t *r, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (CORE(r, "DataParallel.join", mpidp_reducer_set_divisor(r->core, (int)n)) < 0) return NULL;
    Py_RETURN_NONE;
}

/* shadow_pass(): this rank has run out of data (join) but the others have
 * not: take part in one pass of bucket allreduces contributing nothing, in
 * the same order as everyone else, without touching any `.grad`. */
static PyObject *reducer_shadow_pass(reducer_t *r, PyObject *unused)
{
    (void)unused;
    if (mpidp_reducer_n_ready(r->core) != 0 || r->finalized)
        return PyErr_Format(PyExc_RuntimeError, "DataParallel.join: a backward pass is still open");
    for (size_t b = 0; r->device_buckets && b < r->n_buckets; b++) {
        /* Staged buckets are copied from the device before sending. */
        PyObject *res = PyObject_CallMethod(PyTuple_GET_ITEM(r->device_buckets, b), "zero_", NULL);
        if (res == NULL) return NULL;
        Py_DECREF(res);
    }
    for (size_t i = 0; i < r->n_params; i++) {
        if (CORE(r, "DataParallel.join", mpidp_reducer_mark_ready(r->core, i, 0)) < 0) return NULL;
    }
    if (r->device_buckets && stage_full_buckets(r, 1) < 0) return NULL;
    for (size_t b = 0; b < r->n_buckets; b++)
        if (wait_core_bucket(r, b) < 0) return NULL;
    if (reset_pass(r) < 0) return NULL;
    Py_RETURN_NONE;
}

/* The buckets whose results have been delivered for a step. */
static PyObject *reducer_delivered(reducer_t *r, PyObject *arg)
{
    Py_ssize_t b = PyLong_AsSsize_t(arg);
    if (b == -1 && PyErr_Occurred()) return NULL;
    if (b < 0 || (size_t)b >= r->n_buckets) return PyErr_Format(PyExc_IndexError, "bucket %zd", b);
    return PyBool_FromLong(r->separate && r->delivered[b]);
}

static PyObject *reducer_prepare(reducer_t *r, PyObject *unused)
{
    (void)unused;
    /* A pass still open must be completed (or its step applied) before grads
     * move; in non-blocking mode DataParallel.forward decides which. */
    if (r->finalized && !r->separate && complete_pass(r) < 0) return NULL;
    if (mpidp_reducer_n_ready(r->core) != 0) Py_RETURN_NONE;
    for (size_t i = 0; i < r->n_params; i++) {
        PyObject *param = PyTuple_GET_ITEM(r->params, i);
        PyObject *grad = PyObject_GetAttr(param, str_grad);
        if (grad == NULL) return NULL;
        int none = grad == Py_None;
        Py_DECREF(grad);
        if (!none) continue;
        PyObject *view = PyTuple_GET_ITEM(r->views, i);
        PyObject *res = PyObject_CallMethod(view, "zero_", NULL);
        if (res == NULL) return NULL;
        Py_DECREF(res);
        if (PyObject_SetAttr(param, str_grad, view) < 0) return NULL;
        r->was_none[i] = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *reducer_wait_bucket(reducer_t *r, PyObject *arg)
{
    Py_ssize_t b = PyLong_AsSsize_t(arg);
    if (b == -1 && PyErr_Occurred()) return NULL;
    if (b < 0 || (size_t)b >= r->n_buckets)
        return PyErr_Format(PyExc_IndexError, "bucket %zd out of range", b);
    if (!r->finalized)
        return PyErr_Format(PyExc_RuntimeError, "wait_bucket: no finished backward pass");
    if (wait_bucket(r, (size_t)b) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *reducer_complete(reducer_t *r, PyObject *unused)
{
    (void)unused;
    if (complete_pass(r) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *reducer_hook(reducer_t *r, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || (size_t)i >= r->n_params)
        return PyErr_Format(PyExc_IndexError, "parameter %zd out of range", i);
    gradhook_t *h = PyObject_GC_New(gradhook_t, r->st->gradhook_type);
    if (h == NULL) return NULL;
    h->vectorcall = gradhook_vectorcall;
    h->reducer = (reducer_t *)Py_NewRef(r);
    h->index = i;
    PyObject_GC_Track(h);
    return (PyObject *)h;
}

static PyObject *reducer_bucket_of(reducer_t *r, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || (size_t)i >= r->n_params)
        return PyErr_Format(PyExc_IndexError, "parameter %zd out of range", i);
    return PyLong_FromSize_t(mpidp_reducer_bucket_of(r->core, (size_t)i));
}

static PyObject *reducer_get_pending(reducer_t *r, void *c)
{
    (void)c;
    /* True while a pass has started and not been completed. */
    return PyBool_FromLong(mpidp_reducer_n_ready(r->core) != 0);
}

static PyObject *reducer_get_finalized(reducer_t *r, void *c)
{
    (void)c;
    return PyBool_FromLong(r->finalized);
}

static PyObject *reducer_get_n_buckets(reducer_t *r, void *c)
{
    (void)c;
    return PyLong_FromSize_t(r->n_buckets);
}

/* Reducer(*, comm, params, views, buckets, param_bucket, param_offset,
 *         bucket_info, queue_callback, blocking, name, wire_dtype=-1, device_buckets=None,
 *         event_type=None):
 * keyword-only, so a caller cannot swap two of the many tuples unnoticed. */
static PyObject *reducer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"comm", "params", "views", "buckets", "param_bucket", "param_offset",
                             "bucket_info", "queue_callback", "blocking", "name", "wire_dtype",
                             "device_buckets", "event_type", NULL};
    PyObject *comm = NULL, *params = NULL, *views = NULL, *buckets = NULL, *pb = NULL, *po = NULL,
             *binfo = NULL, *qcb = NULL;
    int blocking = -1, wire = -1;
    const char *name = NULL;
    PyObject *device_buckets = Py_None, *event_type = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OO!O!O!O!O!O!OpsiOO:Reducer", kwlist, &comm,
                                     &PyTuple_Type, &params, &PyTuple_Type, &views, &PyTuple_Type,
                                     &buckets, &PyTuple_Type, &pb, &PyTuple_Type, &po,
                                     &PyTuple_Type, &binfo, &qcb, &blocking, &name, &wire,
                                     &device_buckets, &event_type))
        return NULL;
    /* The format makes every keyword optional; all but the last three are required. */
    const void *given[] = {comm, params, views, buckets, pb, po, binfo, qcb,
                           blocking < 0 ? NULL : &blocking, name};
    for (size_t k = 0; k < sizeof given / sizeof given[0]; k++)
        if (given[k] == NULL)
            return PyErr_Format(PyExc_TypeError, "Reducer: missing keyword argument '%s'",
                                kwlist[k]);
    if (device_buckets != Py_None &&
        (!PyTuple_Check(device_buckets) || PyTuple_GET_SIZE(device_buckets) != PyTuple_GET_SIZE(buckets)))
        return PyErr_Format(PyExc_ValueError, "Reducer: device_buckets must match buckets");
    mpidp_py_state *st = mpidp_py_state_of_type(type);
    if (st == NULL) return NULL;
    mpidp_py_comm_t *c = mpidp_py_as_comm(st, comm, "comm");
    if (c == NULL) return NULL;
    Py_ssize_t np = PyTuple_GET_SIZE(params), nb = PyTuple_GET_SIZE(buckets);
    if (PyTuple_GET_SIZE(views) != np || PyTuple_GET_SIZE(pb) != np || PyTuple_GET_SIZE(po) != np ||
        PyTuple_GET_SIZE(binfo) != nb)
        return PyErr_Format(PyExc_ValueError, "Reducer: inconsistent layout lengths");

    reducer_t *r = (reducer_t *)type->tp_alloc(type, 0);
    if (r == NULL) return NULL;
    r->st = st;
    r->module = Py_NewRef(PyType_GetModule(type));
    r->comm = Py_NewRef(comm);
    r->params = Py_NewRef(params);
    r->views = Py_NewRef(views);
    r->bucket_tensors = Py_NewRef(buckets);
    r->device_buckets = device_buckets == Py_None ? NULL : Py_NewRef(device_buckets);
    r->event_type = event_type == Py_None || r->device_buckets == NULL ? NULL : Py_NewRef(event_type);
    r->queue_callback = Py_NewRef(qcb);
    r->blocking = blocking;
    r->separate = !blocking;
    r->n_params = (size_t)np;
    r->n_buckets = (size_t)nb;

    size_t n1 = np ? (size_t)np : 1, b1 = nb ? (size_t)nb : 1;
    uint32_t *bucket_of = malloc(n1 * sizeof *bucket_of);
    size_t *offset = malloc(n1 * sizeof *offset);
    size_t *numel = malloc(n1 * sizeof *numel);
    mpidp_bucket_info_t *info = malloc(b1 * sizeof *info);
    void **data = malloc(b1 * sizeof *data);
    r->buckets = calloc(b1, sizeof *r->buckets);
    r->was_none = calloc(n1, 1);
    r->local_has = calloc(n1, 1);
    r->version = calloc(b1, sizeof *r->version);
    r->delivered = calloc(b1, 1);
    r->after = calloc(n1, 1);
    r->stage_event = calloc(b1, sizeof *r->stage_event);
    r->copy_issued = calloc(b1, 1);
    PyObject *result = NULL;
    if (!bucket_of || !offset || !numel || !info || !data || !r->buckets || !r->was_none ||
        !r->local_has || !r->version || !r->delivered || !r->after ||
        !r->stage_event || !r->copy_issued) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t b = 0; b < nb; b++) {
        PyObject *tup = PyTuple_GET_ITEM(binfo, b);
        unsigned long long bn, bp;
        int dt;
        if (!PyArg_ParseTuple(tup, "KKi", &bn, &bp, &dt)) goto done;
        info[b].numel = (size_t)bn;
        info[b].n_params = (size_t)bp;
        info[b].dtype = dt;
        if (mpidp_py_borrow(st, PyTuple_GET_ITEM(buckets, b),
                            MPIDP_TENSOR_WRITABLE | MPIDP_TENSOR_CPU_ONLY, "bucket",
                            &r->buckets[b]) < 0)
            goto done;
        if (r->buckets[b].t.numel != info[b].numel + info[b].n_params ||
            (int)r->buckets[b].t.dtype != dt) {
            PyErr_Format(PyExc_ValueError, "Reducer: bucket %zd has the wrong size or dtype", b);
            goto done;
        }
        data[b] = r->buckets[b].t.data;
    }
    if (r->device_buckets) {
        r->host_grads = PyTuple_New(nb);
        r->dev_grads = PyTuple_New(nb);
        if (r->host_grads == NULL || r->dev_grads == NULL) goto done;
        for (Py_ssize_t b = 0; b < nb; b++) {
            PyObject *h = PyObject_CallMethod(PyTuple_GET_ITEM(buckets, b), "narrow", "inn", 0,
                                              (Py_ssize_t)0, (Py_ssize_t)info[b].numel);
            if (h == NULL) goto done;
            PyTuple_SET_ITEM(r->host_grads, b, h);
            PyObject *d = PyObject_CallMethod(PyTuple_GET_ITEM(device_buckets, b), "narrow", "inn",
                                              0, (Py_ssize_t)0, (Py_ssize_t)info[b].numel);
            if (d == NULL) goto done;
            PyTuple_SET_ITEM(r->dev_grads, b, d);
        }
    }
    for (Py_ssize_t i = 0; i < np; i++) {
        bucket_of[i] = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(pb, i));
        offset[i] = PyLong_AsSize_t(PyTuple_GET_ITEM(po, i));
        if (PyErr_Occurred()) goto done;
        if (bucket_of[i] >= (uint32_t)nb) {
            PyErr_Format(PyExc_ValueError, "Reducer: parameter %zd has no bucket", i);
            goto done;
        }
        PyObject *n = PyObject_CallMethod(PyTuple_GET_ITEM(views, i), "numel", NULL);
        if (n == NULL) goto done;
        numel[i] = PyLong_AsSize_t(n);
        Py_DECREF(n);
        if (PyErr_Occurred()) goto done;
    }
    mpidp_reducer_config_t cfg = {
        .comm = c->comm, .reqs = st->reqs, .n_params = (size_t)np, .param_bucket = bucket_of,
        .param_offset = offset, .param_numel = numel, .n_buckets = (size_t)nb, .buckets = info,
        .bucket_data = data, .wire_dtype = wire, .separate = r->separate, .name = name,
        .staged = r->device_buckets != NULL};
    mpidp_error_clear();
    int rc = mpidp_reducer_create(&cfg, &r->core);
    if (rc != MPIDP_OK) {
        mpidp_py_raise(st, rc, "DataParallel");
        goto done;
    }
    result = (PyObject *)r;
done:
    free(bucket_of);
    free(offset);
    free(numel);
    free(info);
    free(data);
    if (result == NULL) Py_DECREF(r);
    return result;
}

static int reducer_traverse(reducer_t *r, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(r));
    Py_VISIT(r->module);
    Py_VISIT(r->comm);
    Py_VISIT(r->params);
    Py_VISIT(r->views);
    Py_VISIT(r->bucket_tensors);
    Py_VISIT(r->device_buckets);
    Py_VISIT(r->host_grads);
    Py_VISIT(r->dev_grads);
    Py_VISIT(r->queue_callback);
    return 0;
}

static int reducer_clear(reducer_t *r)
{
    Py_CLEAR(r->params);
    Py_CLEAR(r->views);
    Py_CLEAR(r->queue_callback);
    return 0;
}

static void reducer_dealloc(reducer_t *r)
{
    PyTypeObject *tp = Py_TYPE(r);
    PyObject_GC_UnTrack(r);
    if (r->core) {
        int finalized = 1;
        MPI_Finalized(&finalized);
        /* Buckets still in flight must land before their buffers go. */
        if (!finalized && r->finalized)
            mpidp_reducer_wait_all(r->core, mpidp_py_timeout_s);
        if (mpidp_reducer_destroy(r->core) != MPIDP_OK && !finalized) {
            /* A half-posted pass (backward raised): its buffers must stay
             * alive, so leak them rather than let MPI write into freed memory. */
            r->buckets = NULL;
            r->bucket_tensors = NULL;
        }
    }
    for (size_t b = 0; r->buckets && b < r->n_buckets; b++) mpidp_py_release(&r->buckets[b]);
    free(r->buckets);
    free(r->was_none);
    free(r->local_has);
    free(r->version);
    free(r->delivered);
    free(r->after);
    for (size_t b = 0; r->stage_event && b < r->n_buckets; b++) Py_CLEAR(r->stage_event[b]);
    free(r->stage_event);
    free(r->copy_issued);
    Py_CLEAR(r->event_type);
    reducer_clear(r);
    Py_CLEAR(r->bucket_tensors);
    Py_CLEAR(r->device_buckets);
    Py_CLEAR(r->host_grads);
    Py_CLEAR(r->dev_grads);
    Py_CLEAR(r->comm);
    Py_CLEAR(r->module);
    tp->tp_free((PyObject *)r);
    Py_DECREF(tp);
}

static PyMethodDef reducer_methods[] = {
    {"_finalize_backward", (PyCFunction)reducer_finalize_backward, METH_NOARGS,
     "Called by autograd at the end of backward: post every remaining bucket."},
    {"prepare", (PyCFunction)reducer_prepare, METH_NOARGS,
     "Before backward: point None grads at their zeroed bucket views."},
    {"wait_bucket", (PyCFunction)reducer_wait_bucket, METH_O,
     "wait_bucket(b): wait for bucket b and fix up its parameters' grads."},
    {"complete", (PyCFunction)reducer_complete, METH_NOARGS,
     "Finish the open pass (wait for every bucket); no-op when none is open."},
    {"hook", (PyCFunction)reducer_hook, METH_O, "hook(i) -> GradHook for parameter i."},
    {"deliver_for_step", (PyCFunction)reducer_deliver_for_step, METH_O,
     "Non-blocking: deliver the means of these parameters' buckets for the step."},
    {"after_step", (PyCFunction)reducer_after_step, METH_O,
     "Non-blocking: give these parameters' .grad back as the user left it."},
    {"delivered", (PyCFunction)reducer_delivered, METH_O, "delivered(b) -> bool."},
    {"set_divisor", (PyCFunction)reducer_set_divisor, METH_O,
     "set_divisor(n): average gradients over n ranks from the next pass on."},
    {"shadow_pass", (PyCFunction)reducer_shadow_pass, METH_NOARGS,
     "Take part in one pass of bucket allreduces with zero contributions (join)."},
    {"bucket_of", (PyCFunction)reducer_bucket_of, METH_O, "bucket_of(i) -> bucket index."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef reducer_getset[] = {
    {"pending", (getter)reducer_get_pending, NULL, "A pass has started and is not complete.", NULL},
    {"finalized", (getter)reducer_get_finalized, NULL, "The open pass has every bucket posted.", NULL},
    {"n_buckets", (getter)reducer_get_n_buckets, NULL, "Number of buckets.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot reducer_slots[] = {
    {Py_tp_new, reducer_new},
    {Py_tp_dealloc, reducer_dealloc},
    {Py_tp_traverse, reducer_traverse},
    {Py_tp_clear, reducer_clear},
    {Py_tp_methods, reducer_methods},
    {Py_tp_getset, reducer_getset},
    {Py_tp_doc, "DataParallel's gradient reducer (internal)."},
    {0, NULL},
};

static PyType_Spec reducer_spec = {
    .name = "mpidp._C.Reducer",
    .basicsize = sizeof(reducer_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = reducer_slots,
};

/* --- GradHook type ------------------------------------------------------ */

static int gradhook_traverse(gradhook_t *h, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(h));
    Py_VISIT(h->reducer);
    return 0;
}

static int gradhook_clear(gradhook_t *h)
{
    Py_CLEAR(h->reducer);
    return 0;
}

static void gradhook_dealloc(gradhook_t *h)
{
    PyTypeObject *tp = Py_TYPE(h);
    PyObject_GC_UnTrack(h);
    gradhook_clear(h);
    PyObject_GC_Del(h);
    Py_DECREF(tp);
}

static PyObject *gradhook_call(PyObject *self, PyObject *args, PyObject *kwds)
{
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)
        return PyErr_Format(PyExc_TypeError, "GradHook takes no keyword arguments");
    return gradhook_vectorcall(self, &PyTuple_GET_ITEM(args, 0), (size_t)PyTuple_GET_SIZE(args),
                               NULL);
}

static PyMemberDef gradhook_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(gradhook_t, vectorcall), READONLY, NULL},
    {"index", T_PYSSIZET, offsetof(gradhook_t, index), READONLY, "The parameter's index."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot gradhook_slots[] = {
    {Py_tp_dealloc, gradhook_dealloc},
    {Py_tp_traverse, gradhook_traverse},
    {Py_tp_clear, gradhook_clear},
    {Py_tp_call, gradhook_call},
    {Py_tp_members, gradhook_members},
    {Py_tp_doc, "Post-accumulate-grad hook of one parameter (internal)."},
    {0, NULL},
};

static PyType_Spec gradhook_spec = {
    .name = "mpidp._C.GradHook",
    .basicsize = sizeof(gradhook_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = gradhook_slots,
};

int mpidp_py_reducer_init(PyObject *module, mpidp_py_state *st)
{
    if (!str_grad) {
        str_grad = PyUnicode_InternFromString("grad");
        str_copy_ = PyUnicode_InternFromString("copy_");
        str_detach = PyUnicode_InternFromString("detach");
        str_finalize = PyUnicode_InternFromString("_finalize_backward");
        str_version = PyUnicode_InternFromString("_version");
        kw_non_blocking = Py_BuildValue("(s)", "non_blocking");
        if (!str_grad || !str_copy_ || !str_detach || !str_finalize || !str_version ||
            !kw_non_blocking)
            return -1;
    }
    st->reducer_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &reducer_spec, NULL);
    if (st->reducer_type == NULL || PyModule_AddType(module, st->reducer_type) < 0) return -1;
    st->gradhook_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &gradhook_spec, NULL);
    if (st->gradhook_type == NULL) return -1;
    return PyModule_AddType(module, st->gradhook_type);
}
