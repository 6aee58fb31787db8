/* mpidp._C.Reducer: DataParallel's gradient path.
 *
 * Python plans the buckets, allocates one flat tensor per bucket and makes a
 * view into it for every trainable parameter; the Reducer keeps all of them,
 * owns the core reducer (csrc/core/reducer.c: buckets, posting, and the
 * pass's decisions of what each `.grad` becomes) and exposes its calls one
 * by one. The methods that read and write `.grad` are csrc/py/reducer_pass.c;
 * the order of a pass's calls and staging are python/mpidp/_reducer.py. */
#include "reducer.h"

#include <stdlib.h>

#include "mpidp/mpi_info.h"

typedef mpidp_py_reducer_t reducer_t;

/* --- Reducer methods: the core's per-bucket calls and queries ----------- */

#define none_or_null mpidp_py_none_or_null

Py_ssize_t mpidp_py_index_arg(PyObject *arg, size_t limit, const char *what)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < 0 || (size_t)i >= limit) {
        PyErr_Format(PyExc_IndexError, "%s %zd out of range", what, i);
        return -1;
    }
    return i;
}

/* A method of one bucket index argument `b` that returns `result`. */
#define BUCKET_METHOD(name, result)                                             \
    static PyObject *reducer_##name(reducer_t *r, PyObject *arg)                \
    {                                                                           \
        Py_ssize_t b = mpidp_py_index_arg(arg, r->n_buckets, "bucket");         \
        if (b < 0) return NULL;                                                 \
        return result;                                                          \
    }
BUCKET_METHOD(stepped, PyBool_FromLong(mpidp_reducer_stepped(r->core, b)))
BUCKET_METHOD(delivered, PyBool_FromLong(mpidp_reducer_delivered(r->core, b)))
BUCKET_METHOD(needs_unstaging, PyBool_FromLong(mpidp_reducer_needs_unstaging(r->core, b)))
BUCKET_METHOD(staged, none_or_null(CORE(r, "DataParallel backward", mpidp_reducer_staged(r->core, b))))
BUCKET_METHOD(unstaged, none_or_null(CORE(r, "DataParallel", mpidp_reducer_unstaged(r->core, b))))
#undef BUCKET_METHOD

/* wait_bucket(b): bucket b's allreduce has completed (GIL released while waiting). */
static PyObject *reducer_wait_bucket(reducer_t *r, PyObject *arg)
{
    Py_ssize_t b = mpidp_py_index_arg(arg, r->n_buckets, "bucket");
    if (b < 0) return NULL;
    if (mpidp_reducer_bucket_state(r->core, b) == MPIDP_BUCKET_DONE) Py_RETURN_NONE;
    int rc;
    mpidp_error_clear();
    MPIDP_PY_WAIT(r->st, rc, mpidp_reducer_wait_bucket(r->core, b, mpidp_py_timeout_s));
    return none_or_null(mpidp_py_check(r->st, rc, "DataParallel gradient allreduce"));
}

/* device_deliveries(b) -> bytes: device mode, the deliveries the pass's
 * calls recorded for bucket b's members (mpidp_reducer_device_deliveries). */
static PyObject *reducer_device_deliveries(reducer_t *r, PyObject *arg)
{
    Py_ssize_t b = mpidp_py_index_arg(arg, r->n_buckets, "bucket");
    if (b < 0) return NULL;
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r->core, (size_t)b, &members);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (out == NULL) return NULL;
    if (CORE(r, "DataParallel", mpidp_reducer_device_deliveries(r->core, (size_t)b,
                                                                 (uint8_t *)PyBytes_AS_STRING(out))) < 0)
        Py_CLEAR(out);
    return out;
}

/* next_to_stage(start) -> the first full bucket >= start that waits for its
 * copy to the host, or None. */
static PyObject *reducer_next_to_stage(reducer_t *r, PyObject *arg)
{
    size_t start = PyLong_AsSize_t(arg), b;
    if (start == (size_t)-1 && PyErr_Occurred()) return NULL;
    if (start < r->n_buckets && mpidp_reducer_next_to_stage(r->core, start, &b))
        return PyLong_FromSize_t(b);
    Py_RETURN_NONE;
}

/* version_moved(b, version) -> bucket b's version counter moved since finalize. */
static PyObject *reducer_version_moved(reducer_t *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "version_moved(b, version)");
    Py_ssize_t b = mpidp_py_index_arg(args[0], r->n_buckets, "bucket");
    long long version = b < 0 ? -1 : PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(mpidp_reducer_version_moved(r->core, (size_t)b, version));
}

/* finalize(versions): every parameter is marked; versions: non-blocking
 * mode, each bucket's version counter now (else None). */
static PyObject *reducer_finalize(reducer_t *r, PyObject *versions)
{
    int given = versions != Py_None;
    if (given && !(PyTuple_Check(versions) && (size_t)PyTuple_GET_SIZE(versions) == r->n_buckets))
        return PyErr_Format(PyExc_TypeError, "versions: expected None or one int per bucket");
    for (size_t b = 0; given && b < r->n_buckets; b++)
        if ((r->versions[b] = PyLong_AsLongLong(PyTuple_GET_ITEM(versions, b))) == -1 && PyErr_Occurred())
            return NULL;
    if (CORE(r, "DataParallel backward", mpidp_reducer_finalize(r->core, given ? r->versions : NULL)) < 0)
        return NULL;
    return none_or_null(mpidp_py_warn_fp16_overflow());
}

static PyObject *reducer_reset(reducer_t *r, PyObject *unused)
{
    (void)unused;
    return none_or_null(CORE(r, "DataParallel", mpidp_reducer_reset(r->core)));
}

/* contribute_nothing(): join's shadow pass (mpidp_reducer_contribute_nothing). */
static PyObject *reducer_contribute_nothing(reducer_t *r, PyObject *unused)
{
    (void)unused;
    return none_or_null(CORE(r, "DataParallel.join", mpidp_reducer_contribute_nothing(r->core)));
}

/* set_divisor(n): average over n ranks from the next pass on (join). */
static PyObject *reducer_set_divisor(reducer_t *r, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    return none_or_null(CORE(r, "DataParallel.join", mpidp_reducer_set_divisor(r->core, (int)n)));
}

static PyObject *reducer_get_paused(reducer_t *r, void *c) { (void)c; return PyBool_FromLong(mpidp_reducer_paused(r->core)); }
static PyObject *reducer_get_held(reducer_t *r, void *c) { (void)c; return PyBool_FromLong(mpidp_reducer_held(r->core)); }

static int reducer_set_paused(reducer_t *r, PyObject *value, void *c)
{
    (void)c;
    int v = value ? PyObject_IsTrue(value) : -1;
    if (v < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "paused cannot be deleted");
    return v < 0 ? -1 : CORE(r, "DataParallel.no_sync", mpidp_reducer_set_paused(r->core, v));
}

static PyObject *reducer_get_finalized(reducer_t *r, void *c) { (void)c; return PyBool_FromLong(mpidp_reducer_finalized(r->core)); }
static PyObject *reducer_get_n_ready(reducer_t *r, void *c) { (void)c; return PyLong_FromSize_t(mpidp_reducer_n_ready(r->core)); }
static PyObject *reducer_get_n_buckets(reducer_t *r, void *c) { (void)c; return PyLong_FromSize_t(r->n_buckets); }
static PyObject *reducer_get_divisor(reducer_t *r, void *c) { (void)c; return PyLong_FromLong(mpidp_reducer_divisor(r->core)); }

/* Reducer(*, comm, params, views, buckets, param_numel, param_dtype, first_cap, cap,
 *         blocking, name, wire_dtype=-1, staged=False, hier_comms=None,
 *         on_backward_opened=None):
 * keyword-only, so a caller cannot swap two of the many arguments unnoticed.
 * The core plans the bucket layout from the parameters' sizes and dtypes and
 * the caps (as plan_buckets gave Python to allocate `buckets`) and checks
 * each bucket tensor against it. staged: the .grad views live in device
 * buckets that Python copies to and from `buckets` (the core then waits for
 * `staged(b)` before posting). device: the caller reduces the .grad buckets
 * where they live and the core sums the flags only (mpidp/reducer.h);
 * on_bucket_full(reducer) is then called whenever a hook filled a bucket,
 * to start its sum.
 * on_backward_opened(reducer, i): called by the
 * gradient hook that opens a backward (the owner's: it completes a pass still
 * open and asks autograd to say when the backward ends). */
static PyObject *reducer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"comm", "params", "views", "buckets", "param_numel", "param_dtype",
                             "first_cap", "cap", "blocking", "name", "wire_dtype", "staged",
                             "hier_comms", "on_backward_opened", "device", "on_bucket_full", NULL};
    PyObject *comm = NULL, *params = NULL, *views = NULL, *buckets = NULL, *pn = NULL, *pd = NULL;
    PyObject *hier = Py_None, *on_backward = Py_None, *on_full = Py_None;
    unsigned long long first_cap = 0, cap = 0;
    int blocking = -1, wire = -1, staged = 0, device = 0;
    const char *name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OO!O!O!OOKKpsipOOpO:Reducer", kwlist, &comm,
                                     &PyTuple_Type, &params, &PyTuple_Type, &views, &PyTuple_Type,
                                     &buckets, &pn, &pd, &first_cap, &cap, &blocking, &name,
                                     &wire, &staged, &hier, &on_backward, &device, &on_full))
        return NULL;
    if (on_backward != Py_None && !PyCallable_Check(on_backward))
        return PyErr_Format(PyExc_TypeError, "on_backward_opened: expected a callable or None");
    if (device && !PyCallable_Check(on_full))
        return PyErr_Format(PyExc_TypeError, "on_bucket_full: device mode needs a callable");
    /* The format makes every keyword optional; all but the last two are required. */
    const void *given[] = {comm, params, views, buckets, pn, pd, first_cap ? &first_cap : NULL,
                           cap ? &cap : NULL, blocking < 0 ? NULL : &blocking, name};
    for (size_t k = 0; k < sizeof given / sizeof given[0]; k++)
        if (given[k] == NULL)
            return PyErr_Format(PyExc_TypeError, "Reducer: missing keyword argument '%s'",
                                kwlist[k]);
    Py_ssize_t np = PyTuple_GET_SIZE(params), nb = PyTuple_GET_SIZE(buckets);
    mpidp_py_state *st = mpidp_py_state_of_type(type);
    mpidp_py_comm_t *c = st ? mpidp_py_as_comm(st, comm, "comm") : NULL;
    /* hier_comms: None, or the node (scatter), cross-node and node (gather) Comms. */
    mpidp_py_comm_t *h[3] = {NULL, NULL, NULL};
    if (c && hier != Py_None) {
        if (!PyTuple_Check(hier) || PyTuple_GET_SIZE(hier) != 3)
            return PyErr_Format(PyExc_TypeError, "hier_comms: expected None or 3 Comms");
        for (int k = 0; k < 3; k++)
            if ((h[k] = mpidp_py_as_comm(st, PyTuple_GET_ITEM(hier, k), "hier_comms")) == NULL)
                return NULL;
    }
    mpidp_py_sizes_t sz;
    if (c == NULL || mpidp_py_sizes(pn, pd, &sz) < 0) return NULL;
    mpidp_tensor_t *tensors = NULL;
    reducer_t *r = NULL;
    if (PyTuple_GET_SIZE(views) != np || sz.n != (size_t)np) {
        PyErr_Format(PyExc_ValueError, "Reducer: %zd params, %zd views and %zu sizes do not "
                     "match", np, PyTuple_GET_SIZE(views), sz.n);
        goto done;
    }
    r = (reducer_t *)type->tp_alloc(type, 0);
    if (r == NULL) goto done;
    r->st = st;
    r->comm = Py_NewRef(comm);
    r->hier_comms = Py_NewRef(hier);
    r->params = Py_NewRef(params);
    r->views = Py_NewRef(views);
    r->bucket_tensors = Py_NewRef(buckets);
    r->on_backward = Py_NewRef(on_backward);
    r->device = device;
    r->on_full = Py_NewRef(on_full);
    r->n_params = (size_t)np;
    r->buckets = calloc(nb ? (size_t)nb : 1, sizeof *r->buckets);
    r->seen = calloc(np ? (size_t)np : 1, 1);
    r->act = calloc(np ? (size_t)np : 1, 1);
    r->versions = calloc(nb ? (size_t)nb : 1, sizeof *r->versions);
    tensors = malloc((nb ? (size_t)nb : 1) * sizeof *tensors);
    if (!r->buckets || !r->seen || !r->act || !r->versions || !tensors) {
        PyErr_NoMemory();
        goto fail;
    }
    /* Host memory and writability are the core's to check, naming the bucket. */
    if (mpidp_py_borrow_all(st, buckets, 0, -1, "buckets", r->buckets) < 0) goto fail;
    r->n_buckets = (size_t)nb;
    for (Py_ssize_t b = 0; b < nb; b++) tensors[b] = r->buckets[b].t;
    mpidp_reducer_config_t cfg = {
        .comm = c->comm, .reqs = st->reqs, .n_params = (size_t)np, .param_numel = sz.numel,
        .param_dtype = sz.dtype, .first_cap = (size_t)first_cap, .cap = (size_t)cap,
        .n_buckets = (size_t)nb, .bucket_tensors = tensors, .wire_dtype = wire,
        .separate = !blocking, .name = name, .staged = staged, .device = device,
        .drain_timeout_s = mpidp_py_timeout_s, .hierarchical = h[0] != NULL,
        .hier_node_scatter = h[0] ? h[0]->comm : MPI_COMM_NULL,
        .hier_cross = h[1] ? h[1]->comm : MPI_COMM_NULL,
        .hier_node_gather = h[2] ? h[2]->comm : MPI_COMM_NULL};
    if (CORE(r, "DataParallel", mpidp_reducer_create(&cfg, &r->core)) == 0) goto done;
fail:
    Py_CLEAR(r);
done:
    free(tensors);
    mpidp_py_sizes_free(&sz);
    return (PyObject *)r;
}

static int reducer_traverse(reducer_t *r, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(r));
    Py_VISIT(r->comm);
    Py_VISIT(r->hier_comms);
    Py_VISIT(r->params);
    Py_VISIT(r->views);
    Py_VISIT(r->bucket_tensors);
    Py_VISIT(r->on_backward);
    Py_VISIT(r->on_full);
    return 0;
}

static int reducer_clear(reducer_t *r)
{
    Py_CLEAR(r->params);
    Py_CLEAR(r->views);
    Py_CLEAR(r->on_backward);
    Py_CLEAR(r->on_full);
    return 0;
}

static void reducer_dealloc(reducer_t *r)
{
    PyTypeObject *tp = Py_TYPE(r);
    PyObject_GC_UnTrack(r);
    /* Buckets still in flight after close keep their memory while MPI runs
     * (mpidp_reducer_close): leaked, so that MPI never writes into freed memory. */
    if (mpidp_reducer_close(r->core, mpidp_py_timeout_s) != MPIDP_OK && !mpidp_mpi_finalized()) {
        r->buckets = NULL;
        r->bucket_tensors = NULL;
    }
    for (size_t b = 0; r->buckets && b < r->n_buckets; b++) mpidp_py_release(&r->buckets[b]);
    free(r->buckets);
    free(r->seen);
    free(r->act);
    free(r->versions);
    reducer_clear(r);
    Py_CLEAR(r->bucket_tensors);
    Py_CLEAR(r->comm);
    Py_CLEAR(r->hier_comms);
    tp->tp_free((PyObject *)r);
    Py_DECREF(tp);
}

#define METHOD(name, flags, doc) {#name, (PyCFunction)(void (*)(void))reducer_##name, flags, doc}
static PyMethodDef reducer_methods[] = {
    {"grad_arrived", (PyCFunction)(void (*)(void))mpidp_py_reducer_grad_arrived, METH_FASTCALL,
     "grad_arrived(i, param): parameter i's gradient hook (the hot path)."},
    {"prepare", mpidp_py_reducer_prepare, METH_NOARGS,
     "Before backward: point None grads at their zeroed bucket views."},
    {"mark_unhooked", mpidp_py_reducer_mark_unhooked, METH_NOARGS,
     "End of backward: mark the parameters no hook marked."},
    {"apply_missing_grads", mpidp_py_reducer_apply_missing_grads, METH_O,
     "apply_missing_grads(b): blocking pass done: .grad of bucket b as the mean left it."},
    {"apply_accumulate", (PyCFunction)(void (*)(void))mpidp_py_reducer_apply_accumulate,
     METH_FASTCALL, "apply_accumulate(b, version, accumulated): no step due: add the mean."},
    {"apply_deliver_for_step", (PyCFunction)(void (*)(void))mpidp_py_reducer_apply_deliver_for_step,
     METH_FASTCALL, "apply_deliver_for_step(b, version): bucket b's mean into .grad for the step."},
    {"apply_deliver_now", (PyCFunction)(void (*)(void))mpidp_py_reducer_apply_deliver_now,
     METH_FASTCALL, "apply_deliver_now(b, version): between backward and step: the mean now."},
    {"apply_after_step", mpidp_py_reducer_apply_after_step, METH_O,
     "apply_after_step(b) -> pass over: .grad back as the user left it after the step."},
    {"end_blocking_backward", mpidp_py_reducer_end_blocking_backward, METH_NOARGS,
     "Blocking, unstaged: mark_unhooked, finalize, wait and fix every bucket, reset."},
    METHOD(finalize, METH_O, "finalize(versions): every parameter is marked (versions: "
           "non-blocking, each bucket's version counter; else None)."),
    METHOD(wait_bucket, METH_O, "wait_bucket(b): until bucket b's allreduce completed."),
    METHOD(next_to_stage, METH_O, "next_to_stage(start) -> full bucket >= start to copy to the host, or None."),
    METHOD(staged, METH_O, "staged(b): bucket b's gradients are in its host bucket."),
    METHOD(needs_unstaging, METH_O, "needs_unstaging(b) -> bucket b's mean must be copied back."),
    METHOD(unstaged, METH_O, "unstaged(b): bucket b's mean was copied back."),
    METHOD(device_deliveries, METH_O, "device_deliveries(b) -> bytes: device mode, per member "
           "of bucket b: 0 none, 1 copy, 2 add the mean from the communication buffer."),
    METHOD(stepped, METH_O, "stepped(b) -> the step was applied to bucket b in the open pass."),
    METHOD(delivered, METH_O, "delivered(b) -> bucket b's mean is in .grad for the step."),
    METHOD(version_moved, METH_FASTCALL, "version_moved(b, version) -> changed since finalize."),
    METHOD(reset, METH_NOARGS, "End the pass."),
    METHOD(contribute_nothing, METH_NOARGS, "join: post every bucket with no contribution."),
    METHOD(set_divisor, METH_O, "set_divisor(n): average over n ranks from the next pass on."),
    {NULL, NULL, 0, NULL},
};
#undef METHOD

static PyGetSetDef reducer_getset[] = {
    {"finalized", (getter)reducer_get_finalized, NULL, "The open pass has every bucket posted.", NULL},
    {"n_ready", (getter)reducer_get_n_ready, NULL, "Parameters marked in the open pass.", NULL},
    {"n_buckets", (getter)reducer_get_n_buckets, NULL, "Number of buckets.", NULL},
    {"divisor", (getter)reducer_get_divisor, NULL, "Ranks the open pass averages over.", NULL},
    {"paused", (getter)reducer_get_paused, (setter)reducer_set_paused,
     "no_sync: hooks hold gradients for the next pass instead of reducing them.", NULL},
    {"held", (getter)reducer_get_held, NULL,
     "A paused backward held gradients that no pass has reduced yet.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot reducer_slots[] = {
    {Py_tp_new, reducer_new},
    {Py_tp_dealloc, reducer_dealloc},
    {Py_tp_traverse, reducer_traverse},
    {Py_tp_clear, reducer_clear},
    {Py_tp_methods, reducer_methods},
    {Py_tp_getset, reducer_getset},
    {Py_tp_doc, "DataParallel's gradient reducer: the .grad loops and the core's decisions "
                "(internal; python/mpidp/_reducer.py orders the calls)."},
    {0, NULL},
};

/* BASETYPE: python/mpidp/_reducer.py subclasses it with the pass's flows. */
PyType_Spec mpidp_py_reducer_spec = {
    .name = "mpidp._C.Reducer",
    .basicsize = sizeof(reducer_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_BASETYPE,
    .slots = reducer_slots,
};
