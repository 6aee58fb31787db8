/* The reducer's methods that read and write `.grad`: the glue observes what
 * each `.grad` is (mpidp_grad_seen_t), the core decides (csrc/core/reducer_pass.c,
 * "the pass" in mpidp/reducer.h), and the glue applies its actions
 * (mpidp_grad_action_t). These are the per-parameter loops, kept in C
 * because a Python loop would cost about 0.5 us per parameter per step; the
 * per-bucket order of calls is python/mpidp/_reducer.py.
 *
 *   grad_arrived(i, param)  the hot path, every parameter's gradient hook:
 *                  the one that opens a backward calls the on_backward_opened
 *                  callback the reducer was built with, (reducer, i), and
 *                  returns True (what happened; called as a node hook, None);
 *                  a foreign `.grad` is copied in; the core marks the
 *                  parameter and posts full buckets (while paused, for
 *                  no_sync, it only records that the view holds a gradient);
 *   prepare()      before backward: None grads -> their zeroed bucket views;
 *   mark_unhooked() end of backward: parameters no hook marked are marked
 *                  (zero contribution), so every bucket is posted on every rank;
 *   apply_missing_grads(b), apply_accumulate(b, version, accumulated),
 *   apply_deliver_for_step(b, version), apply_deliver_now(b, version),
 *   apply_after_step(b)  the core's per-bucket decision of the same name,
 *                  applied to the bucket's parameters. */
#include "reducer.h"

#include "grad_hook_api.h"

static PyObject *str_grad, *str_copy_, *str_detach, *str_zero_, *str_to_dense;

int mpidp_py_reducer_pass_init(void)
{
    if (str_grad) return 0;
    str_grad = PyUnicode_InternFromString("grad");
    str_copy_ = PyUnicode_InternFromString("copy_");
    str_detach = PyUnicode_InternFromString("detach");
    str_zero_ = PyUnicode_InternFromString("zero_");
    str_to_dense = PyUnicode_InternFromString("to_dense");
    return str_grad && str_copy_ && str_detach && str_zero_ && str_to_dense ? 0 : -1;
}

/* The hooks' progress interval: MPIDP_HOOK_PROGRESS=0 turns it off (-1). */
static double hook_progress_every(void)
{
    return mpidp_py_hook_progress ? MPIDP_HOOK_PROGRESS_EVERY_S : -1.0;
}

/* obj.name(), result dropped: 0, or -1 with the exception set. */
static int call_method0(PyObject *obj, PyObject *name)
{
    PyObject *res = PyObject_CallMethodNoArgs(obj, name);
    Py_XDECREF(res);
    return res ? 0 : -1;
}

/* What parameter i's .grad is (mpidp_grad_seen_t), or -1. */
static int observe_one(mpidp_py_reducer_t *r, size_t i)
{
    if (r->observe_fn) {
        static const int seen[] = {[MPIDP_GRAD_HOOK_NONE] = MPIDP_SEEN_NONE,
                                   [MPIDP_GRAD_HOOK_VIEW] = MPIDP_SEEN_VIEW,
                                   [MPIDP_GRAD_HOOK_OTHER] = MPIDP_SEEN_OTHER};
        return seen[r->observe_fn(r->observe_ctx, i)];
    }
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
     * copying it would make the bucket view part of that graph. to_dense():
     * a sparse gradient (nn.Embedding(sparse=True)) is reduced as dense; a
     * dense one is returned as it is. */
    PyObject *detached = grad ? PyObject_CallMethodNoArgs(grad, str_detach) : NULL;
    Py_XDECREF(grad);
    PyObject *plain = detached ? PyObject_CallMethodNoArgs(detached, str_to_dense) : NULL;
    Py_XDECREF(detached);
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
        return call_method0(view, str_zero_) < 0 ? -1 : PyObject_SetAttr(param, str_grad, view);
    case MPIDP_GRAD_ADOPT: return adopt(r, i);
    case MPIDP_GRAD_ZERO_ONLY: return call_method0(view, str_zero_);
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

#define none_or_null mpidp_py_none_or_null

/* What parameter i's `.grad` holds, after adopting a foreign tensor into the
 * view: 1 a gradient, 0 None, -1 error. */
static int take_grad(mpidp_py_reducer_t *r, size_t i, PyObject *param)
{
    PyObject *grad = PyObject_GetAttr(param, str_grad);
    if (grad == NULL) return -1;
    int has = grad != Py_None, foreign = has && grad != PyTuple_GET_ITEM(r->views, i);
    Py_DECREF(grad);
    return foreign && adopt(r, i) < 0 ? -1 : has;
}

/* Device mode: a full bucket waits for Python to start its sum on the device. */
static int bucket_waits(const mpidp_py_reducer_t *r)
{
    return r->device && mpidp_reducer_next_to_stage(r->core, 0, NULL);
}

/* The owner's on_bucket_full(reducer): starts the full buckets' sums (GIL held). */
static int call_bucket_full(PyObject *self)
{
    PyObject *res = PyObject_CallOneArg(((mpidp_py_reducer_t *)self)->on_full, self);
    Py_XDECREF(res);
    return res ? 0 : -1;
}

PyObject *mpidp_py_reducer_grad_arrived(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    mpidp_py_reducer_t *r = (mpidp_py_reducer_t *)self;
    /* 4: called as a node post hook, (i, param) bound, (grad_inputs, grad_outputs) ignored. */
    if (nargs != 2 && nargs != 4)
        return PyErr_Format(PyExc_TypeError, "grad_arrived(i, param) takes 2 arguments");
    if (mpidp_py_forked) return none_or_null(mpidp_py_check_not_forked("DataParallel backward"));
    Py_ssize_t i = mpidp_py_index_arg(args[0], r->n_params, "parameter");
    if (i < 0) return NULL;
    int opened = mpidp_reducer_opens_backward(r->core);
    if (opened && r->on_backward && r->on_backward != Py_None) {
        /* First hook of a new backward: the owner finishes a pass still open
         * and asks autograd to tell it when this backward ends. */
        PyObject *res = PyObject_CallFunctionObjArgs(r->on_backward, self, args[0], NULL);
        if (res == NULL) return NULL;
        Py_DECREF(res);
    }
    int has = take_grad(r, (size_t)i, args[1]);
    if (has < 0 || CORE(r, "DataParallel backward",
                        mpidp_reducer_grad_hooked(r->core, (size_t)i, has, hook_progress_every())) < 0)
        return NULL;
    if (bucket_waits(r) && call_bucket_full(self) < 0) return NULL;
    /* As a node post hook (4 arguments) it must return None: autograd reads a
     * result as replacement gradients. */
    if (opened && nargs == 2) Py_RETURN_TRUE;
    Py_RETURN_NONE;
}

PyObject *mpidp_py_reducer_prepare(PyObject *self, PyObject *unused)
{
    (void)unused;
    mpidp_py_reducer_t *r = (mpidp_py_reducer_t *)self;
    if (observe(r, NULL, r->n_params, r->seen) < 0 ||
        CORE(r, "DataParallel", mpidp_reducer_prepare(r->core, r->seen, r->act)) < 0)
        return NULL;
    return none_or_null(apply(r, NULL, r->n_params, r->act));
}

PyObject *mpidp_py_reducer_mark_unhooked(PyObject *self, PyObject *unused)
{
    (void)unused;
    mpidp_py_reducer_t *r = (mpidp_py_reducer_t *)self;
    for (size_t i = 0; i < r->n_params; i++) {
        if (mpidp_reducer_is_ready(r->core, i)) continue;
        int seen = observe_one(r, i);
        if (seen < 0 || apply_one(r, i, mpidp_reducer_unhooked_action(r->core, i, seen)) < 0 ||
            CORE(r, "DataParallel backward", mpidp_reducer_mark_unhooked(r->core, i, seen)) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* The per-bucket decisions: each reads bucket b (observing its members'
 * `.grad` first where the core's function reads them), calls the core's
 * function of the same name and applies its actions. */

/* Bucket b's members into *members / *n (observed into r->seen when
 * `observe_them`): b, or -1 with an exception. */
static Py_ssize_t bucket_members(mpidp_py_reducer_t *r, PyObject *arg, int observe_them,
                                 const size_t **members, size_t *n)
{
    Py_ssize_t b = mpidp_py_index_arg(arg, r->n_buckets, "bucket");
    if (b < 0) return -1;
    *n = mpidp_reducer_bucket_params(r->core, (size_t)b, members);
    return observe_them && observe(r, *members, *n, r->seen) < 0 ? -1 : b;
}

/* After the core's call rc: its actions applied to the members. */
static PyObject *applied(mpidp_py_reducer_t *r, int rc, const size_t *members, size_t n)
{
    if (rc < 0 || apply(r, members, n, r->act) < 0) return NULL;
    Py_RETURN_NONE;
}

/* (b, version[, accumulated]) of the decisions that take them; 0 or -1. */
static int bucket_version_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                               const char *usage, long long *version, long *accumulated)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s", usage);
        return -1;
    }
    *version = PyLong_AsLongLong(args[1]);
    if (want > 2) *accumulated = PyLong_AsLong(args[2]);
    return PyErr_Occurred() ? -1 : 0;
}

PyObject *mpidp_py_reducer_apply_missing_grads(PyObject *self, PyObject *arg)
{
    mpidp_py_reducer_t *r = (mpidp_py_reducer_t *)self;
    const size_t *members;
    size_t n;
    Py_ssize_t b = bucket_members(r, arg, 0, &members, &n);
    if (b < 0) return NULL;
    return applied(r, CORE(r, "DataParallel", mpidp_reducer_missing_grads(r->core, (size_t)b,
                                                                          r->act)), members, n);
}

PyObject *mpidp_py_reducer_apply_accumulate(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    mpidp_py_reducer_t *r = (mpidp_py_reducer_t *)self;
    long long version;
    long accumulated;
    const size_t *members;
    size_t n;
    if (bucket_version_args(args, nargs, 3, "apply_accumulate(b, version, accumulated)", &version,
                            &accumulated) < 0)
        return NULL;
    Py_ssize_t b = bucket_members(r, args[0], 1, &members, &n);
    if (b < 0) return NULL;
    return applied(r, CORE(r, "DataParallel",
                           mpidp_reducer_accumulate(r->core, (size_t)b, version, accumulated,
                                                    r->seen, r->act)), members, n);
}

PyObject *mpidp_py_reducer_apply_deliver_for_step(PyObject *self, PyObject *const *args,
                                                  Py_ssize_t nargs)
{
    mpidp_py_reducer_t *r = (mpidp_py_reducer_t *)self;
    long long version;
    const size_t *members;
    size_t n;
    if (bucket_version_args(args, nargs, 2, "apply_deliver_for_step(b, version)", &version,
                            NULL) < 0)
        return NULL;
    Py_ssize_t b = bucket_members(r, args[0], 1, &members, &n);
    if (b < 0) return NULL;
    return applied(r, CORE(r, "DataParallel",
                           mpidp_reducer_deliver_for_step(r->core, (size_t)b, version, r->seen,
                                                          r->act)), members, n);
}

PyObject *mpidp_py_reducer_apply_deliver_now(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    mpidp_py_reducer_t *r = (mpidp_py_reducer_t *)self;
    long long version;
    const size_t *members;
    size_t n;
    if (bucket_version_args(args, nargs, 2, "apply_deliver_now(b, version)", &version, NULL) < 0)
        return NULL;
    Py_ssize_t b = bucket_members(r, args[0], 1, &members, &n);
    if (b < 0) return NULL;
    return applied(r, CORE(r, "DataParallel",
                           mpidp_reducer_deliver_now(r->core, (size_t)b, version, r->seen, r->act)),
                   members, n);
}

/* apply_after_step(b) -> True when b was the pass's last bucket (reset it). */
PyObject *mpidp_py_reducer_apply_after_step(PyObject *self, PyObject *arg)
{
    mpidp_py_reducer_t *r = (mpidp_py_reducer_t *)self;
    const size_t *members;
    size_t n;
    int over = 0;
    Py_ssize_t b = bucket_members(r, arg, 0, &members, &n);
    if (b < 0) return NULL;
    PyObject *res = applied(r, CORE(r, "DataParallel",
                                    mpidp_reducer_after_step(r->core, (size_t)b, r->act, &over)),
                            members, n);
    if (res == NULL) return NULL;
    Py_DECREF(res);
    return PyBool_FromLong(over);
}

/* end_blocking_backward(): a blocking pass whose buckets are not staged
 * ends here in one call: mark_unhooked, then the core's end_blocking (waits
 * with the GIL released), then its actions: one call rather than one per
 * step, since its cost counts in the per-parameter hook figure
 * (docs/design-notes.md, "One C call ends a blocking backward"). */
PyObject *mpidp_py_reducer_end_blocking_backward(PyObject *self, PyObject *unused)
{
    mpidp_py_reducer_t *r = (mpidp_py_reducer_t *)self;
    PyObject *res = mpidp_py_reducer_mark_unhooked(self, unused);
    if (res == NULL) return NULL;
    Py_DECREF(res);
    int rc;
    mpidp_error_clear();
    MPIDP_PY_WAIT(r->st, rc, mpidp_reducer_end_blocking(r->core, mpidp_py_timeout_s, r->act));
    if (mpidp_py_check(r->st, rc, "DataParallel gradient allreduce") < 0 ||
        mpidp_py_warn_fp16_overflow() < 0)
        return NULL;
    return none_or_null(apply(r, mpidp_reducer_members(r->core), r->n_params, r->act));
}

/* --- The C API of the C++ gradient hook (grad_hook_api.h) ---------------- */

static Py_ssize_t hook_n_params(PyObject *obj)
{
    mpidp_py_state *st = mpidp_py_state_of_type(Py_TYPE(obj));
    if (st == NULL || !PyObject_TypeCheck(obj, st->reducer_type)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "reducer: expected an mpidp._C.Reducer");
        return -1;
    }
    return (Py_ssize_t)((mpidp_py_reducer_t *)obj)->n_params;
}

static PyObject *hook_param(PyObject *obj, size_t i)
{
    return PyTuple_GET_ITEM(((mpidp_py_reducer_t *)obj)->params, (Py_ssize_t)i);
}

static PyObject *hook_view(PyObject *obj, size_t i)
{
    return PyTuple_GET_ITEM(((mpidp_py_reducer_t *)obj)->views, (Py_ssize_t)i);
}

/* grad_arrived's common case: what it does when take_grad finds the view. */
static int hook_arrived(PyObject *self, size_t i, int *status)
{
    mpidp_py_reducer_t *r = (mpidp_py_reducer_t *)self;
    if (mpidp_py_forked || i >= r->n_params || mpidp_reducer_opens_backward(r->core)) return 0;
    mpidp_error_clear();
    int rc = mpidp_reducer_grad_hooked(r->core, i, 1, hook_progress_every());
    *status = rc;
    if (rc != MPIDP_OK) return -1;
    return bucket_waits(r) ? 2 : 1;
}

static int hook_bucket_full(PyObject *self) { return call_bucket_full(self); }

static void hook_raise(PyObject *self, int status)
{
    mpidp_py_raise(((mpidp_py_reducer_t *)self)->st, status, "DataParallel backward");
}

static void hook_set_observer(PyObject *self, mpidp_grad_hook_observer_t observe, void *ctx)
{
    mpidp_py_reducer_t *r = (mpidp_py_reducer_t *)self;
    r->observe_fn = observe;
    r->observe_ctx = observe ? ctx : NULL;
}

static const mpidp_grad_hook_api_t hook_api = {MPIDP_GRAD_HOOK_API_VERSION, hook_n_params,
                                               hook_param, hook_view, hook_arrived, hook_raise,
                                               hook_set_observer, hook_bucket_full};

PyObject *mpidp_py_grad_hook_api_capsule(void)
{
    return PyCapsule_New((void *)&hook_api, MPIDP_GRAD_HOOK_API_CAPSULE, NULL);
}
