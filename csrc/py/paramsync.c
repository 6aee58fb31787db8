/* mpidp._C.ParamSync: the glue of the parameter-sync engine (core/paramsync.c,
 * mpidp/paramsync.h), which DASO's global average uses. It borrows the
 * parameters (CPU float32 tensors) for the engine's lifetime, forwards each
 * call, releases the GIL over whole-model passes and turns statuses into
 * exceptions; the engine owns the reference copy, the wire buffer and the
 * state of the sync in flight. */
#include "module.h"


#include "mpidp/paramsync.h"

typedef struct {
    PyObject_HEAD
    mpidp_py_state *st;
    PyObject *comm;
    PyObject *what;              /* str naming the sync in messages ("DASO global sync") */
    mpidp_py_f32s_t params;      /* borrowed for the engine's lifetime */
    mpidp_paramsync_t *core;
} paramsync_t;

#define WHAT(s) PyUnicode_AsUTF8((s)->what)

/* One sweep over the parameters, `call` (a core status), into `rc` (0 or
 * -1 with the exception). Large ones release the GIL. */
#define PASS(s, rc, call)                                                       \
    do {                                                                        \
        int big_ = mpidp_paramsync_numel((s)->core) >= (1u << 16);              \
        PyThreadState *ts_ = big_ ? PyEval_SaveThread() : NULL;                 \
        mpidp_error_clear();                                                    \
        int status_ = (call);                                                   \
        if (ts_) PyEval_RestoreThread(ts_);                                     \
        (rc) = mpidp_py_check((s)->st, status_, WHAT(s));                       \
    } while (0)

/* Completes the sync in flight (GIL released while waiting). */
static int wait_sync(paramsync_t *s)
{
    int rc;
    mpidp_error_clear();
    MPIDP_PY_WAIT(s->st, rc, mpidp_paramsync_wait(s->core, mpidp_py_timeout_s));
    return mpidp_py_check(s->st, rc, WHAT(s));
}

static PyObject *paramsync_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"comm", "params", "wire_dtype", "chunk_elems", "what", NULL};
    PyObject *comm, *params, *what = NULL;
    int wire;
    Py_ssize_t chunk;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!in|$U:ParamSync", kwlist, &comm,
                                     &PyTuple_Type, &params, &wire, &chunk, &what))
        return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(type);
    mpidp_py_comm_t *c = st ? mpidp_py_as_comm(st, comm, "comm") : NULL;
    if (c == NULL) return NULL;
    /* wire and chunk are the engine's to check (mpidp_paramsync_create). */
    paramsync_t *s = (paramsync_t *)type->tp_alloc(type, 0);
    if (s == NULL) return NULL;
    s->st = st;
    s->comm = Py_NewRef(comm);
    s->what = what ? Py_NewRef(what) : PyUnicode_FromString("parameter sync");
    int ok = s->what && PyUnicode_AsUTF8(s->what) &&
             mpidp_py_f32s_borrow(st, params, "params", &s->params) == 0;
    if (ok) {
        mpidp_paramsync_config_t cfg = {
            .comm = c->comm, .reqs = st->reqs, .n_params = s->params.n,
            .params = s->params.data, .numel = s->params.numel, .wire = wire,
            .chunk_elems = (size_t)chunk, .drain_timeout_s = mpidp_py_timeout_s, .what = WHAT(s)};
        ok = MPIDP_PY_CALL(st, "paramsync", mpidp_paramsync_create(&cfg, &s->core)) == 0;
    }
    if (!ok) Py_CLEAR(s);
    return (PyObject *)s;
}

static PyObject *paramsync_set_reference(paramsync_t *s, PyObject *unused)
{
    (void)unused;
    int rc;
    PASS(s, rc, mpidp_paramsync_set_reference(s->core));
    return mpidp_py_none_or_null(rc);
}

static PyObject *paramsync_abandon(paramsync_t *s, PyObject *unused)
{
    (void)unused;
    int rc;
    PASS(s, rc, mpidp_paramsync_abandon(s->core));
    return mpidp_py_none_or_null(rc);
}

static PyObject *paramsync_restore(paramsync_t *s, PyObject *unused)
{
    (void)unused;
    int rc;
    PASS(s, rc, mpidp_paramsync_restore(s->core));
    return mpidp_py_none_or_null(rc);
}

/* send(zero=False): with zero, contribute nothing (a node whose ranks have
 * all run out of data during join(): it answers the collective with zeros). */
static PyObject *paramsync_send(paramsync_t *s, PyObject *args)
{
    int zero = 0, rc;
    if (!PyArg_ParseTuple(args, "|p:send", &zero) || mpidp_py_check_not_forked(WHAT(s)) < 0)
        return NULL;
    PASS(s, rc, mpidp_paramsync_send(s->core, zero));
    if (rc < 0) return NULL;
    return mpidp_py_none_or_null(mpidp_py_warn_fp16_overflow());
}

static PyObject *paramsync_test(paramsync_t *s, PyObject *unused)
{
    (void)unused;
    int done = 0;
    if (MPIDP_PY_CALL(s->st, WHAT(s), mpidp_paramsync_test(s->core, &done)) < 0) return NULL;
    return PyBool_FromLong(done);
}

static PyObject *paramsync_wait(paramsync_t *s, PyObject *unused)
{
    (void)unused;
    return mpidp_py_none_or_null(wait_sync(s));
}

/* merge(a, b, c): completes the sync, then p = a*p + b*sum + c*ref. */
static PyObject *paramsync_merge(paramsync_t *s, PyObject *args)
{
    float a, b, c;
    int rc = -1;
    if (!PyArg_ParseTuple(args, "fff:merge", &a, &b, &c)) return NULL;
    if (wait_sync(s) == 0) PASS(s, rc, mpidp_paramsync_merge(s->core, a, b, c));
    return mpidp_py_none_or_null(rc);
}

/* merge_average(n_senders, batches_waited): completes the sync, then merges
 * with Heat's staleness weights (mpidp_paramsync_merge_weights). */
static PyObject *paramsync_merge_average(paramsync_t *s, PyObject *args)
{
    int n;
    long long btw;
    float a, b, c;
    int rc = -1;
    if (!PyArg_ParseTuple(args, "iL:merge_average", &n, &btw) ||
        MPIDP_PY_CALL(s->st, WHAT(s), mpidp_paramsync_merge_weights(n, btw, &a, &b, &c)) < 0)
        return NULL;
    if (wait_sync(s) == 0) PASS(s, rc, mpidp_paramsync_merge(s->core, a, b, c));
    return mpidp_py_none_or_null(rc);
}

/* grad_into(grads, scale): completes the sync, then grads[i] = scale * sum. */
static PyObject *paramsync_grad_into(paramsync_t *s, PyObject *args)
{
    PyObject *grads;
    float scale;
    mpidp_py_f32s_t g;
    if (!PyArg_ParseTuple(args, "O!f:grad_into", &PyTuple_Type, &grads, &scale) ||
        mpidp_py_f32s_borrow(s->st, grads, "grads", &g) < 0)
        return NULL;
    int rc = -1;
    if (wait_sync(s) == 0) PASS(s, rc, mpidp_paramsync_grad_into(s->core, g.n, g.data, g.numel, scale));
    mpidp_py_f32s_release(&g);
    return mpidp_py_none_or_null(rc);
}

static PyObject *paramsync_get_numel(paramsync_t *s, void *c) { (void)c; return PyLong_FromSize_t(mpidp_paramsync_numel(s->core)); }
static PyObject *paramsync_get_pending(paramsync_t *s, void *c) { (void)c; return PyBool_FromLong(mpidp_paramsync_pending(s->core)); }
static PyObject *paramsync_get_wire_bytes(paramsync_t *s, void *c) { (void)c; return PyLong_FromSize_t(mpidp_paramsync_wire_bytes(s->core)); }

static int paramsync_traverse(paramsync_t *s, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(s));
    Py_VISIT(s->params.tuple);
    return 0;
}

static void paramsync_dealloc(paramsync_t *s)
{
    PyTypeObject *tp = Py_TYPE(s);
    PyObject_GC_UnTrack(s);
    /* A sync that cannot end leaves the engine's buffers leaked, not freed
     * (mpidp_paramsync_close); the parameters are free to go either way. */
    mpidp_paramsync_close(s->core, mpidp_py_timeout_s);
    mpidp_py_f32s_release(&s->params);
    Py_CLEAR(s->comm);
    Py_CLEAR(s->what);
    tp->tp_free((PyObject *)s);
    Py_DECREF(tp);
}

/* paramsync_merge_weights(n_senders, batches_waited) -> (a, b, c): Heat's
 * staleness weights as the core computes them (float32), for engines that
 * merge elsewhere (python/mpidp/_device_paramsync.py). A module function. */
PyObject *mpidp_py_paramsync_merge_weights(PyObject *m, PyObject *args)
{
    (void)m;
    int n;
    long long btw;
    float a, b, c;
    if (!PyArg_ParseTuple(args, "iL:paramsync_merge_weights", &n, &btw)) return NULL;
    mpidp_error_clear();
    int rc = mpidp_paramsync_merge_weights(n, btw, &a, &b, &c);
    if (rc != MPIDP_OK) return mpidp_py_raise(mpidp_py_state_of_module(m), rc, "merge weights");
    return Py_BuildValue("(ddd)", (double)a, (double)b, (double)c);
}

static PyMethodDef paramsync_methods[] = {
    {"set_reference", (PyCFunction)paramsync_set_reference, METH_NOARGS,
     "ref = the parameters now (every rank must hold the same values)."},
    {"send", (PyCFunction)paramsync_send, METH_VARARGS,
     "send(zero=False): pack p - ref (or zeros) into the wire buffer and post the allreduce."},
    {"test", (PyCFunction)paramsync_test, METH_NOARGS, "Progress; True once complete."},
    {"wait", (PyCFunction)paramsync_wait, METH_NOARGS, "Complete the sync in flight."},
    {"merge", (PyCFunction)paramsync_merge, METH_VARARGS,
     "merge(a, b, c): complete, then p = a*p + b*sum_of_differences + c*ref."},
    {"merge_average", (PyCFunction)paramsync_merge_average, METH_VARARGS,
     "merge_average(n_senders, batches_waited): complete, then merge with Heat's staleness weights."},
    {"grad_into", (PyCFunction)paramsync_grad_into, METH_VARARGS,
     "grad_into(grads, scale): complete, then grads[i] = scale * sum_of_differences."},
    {"restore", (PyCFunction)paramsync_restore, METH_NOARGS, "p = ref."},
    {"abandon", (PyCFunction)paramsync_abandon, METH_NOARGS,
     "Forget a sync whose requests have all ended (recovery ended them); refused while one is "
     "live."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef paramsync_getset[] = {
    {"numel", (getter)paramsync_get_numel, NULL, "Elements synced.", NULL},
    {"pending", (getter)paramsync_get_pending, NULL, "A sync is in flight.", NULL},
    {"wire_bytes", (getter)paramsync_get_wire_bytes, NULL, "Bytes this rank sends per sync.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot paramsync_slots[] = {
    {Py_tp_new, paramsync_new},
    {Py_tp_dealloc, paramsync_dealloc},
    {Py_tp_traverse, paramsync_traverse},
    {Py_tp_methods, paramsync_methods},
    {Py_tp_getset, paramsync_getset},
    {Py_tp_doc, "DASO's global parameter sync (internal)."},
    {0, NULL},
};

PyType_Spec mpidp_py_paramsync_spec = {
    .name = "mpidp._C.ParamSync",
    .basicsize = sizeof(paramsync_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = paramsync_slots,
};
