/* mpidp._C.Reducer and mpidp._C.GradHook: DataParallel's gradient path.
 *
 * Python plans the buckets, allocates one flat tensor per bucket and makes a
 * view into it for every trainable parameter; the Reducer keeps all of them,
 * owns the core reducer (csrc/core/reducer.c: buckets, posting, and the
 * pass's decisions of what each `.grad` becomes) and exposes one pass's
 * steps to DataParallel. What a pass does, and how the glue carries out the
 * core's decisions, is in csrc/py/reducer_pass.c; the per-parameter hook
 * in csrc/py/gradhook.c. */
#include "reducer.h"

#include <stdlib.h>
#include <string.h>

#include "mpidp/bucket.h"
#include "mpidp/status.h"

typedef mpidp_py_reducer_t reducer_t;

/* --- Reducer methods ---------------------------------------------------- */

static PyObject *none_or_null(int rc)
{
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *reducer_finalize_backward(reducer_t *r, PyObject *unused)
{
    (void)unused;
    return none_or_null(mpidp_py_reducer_finalize(r));
}

static PyObject *reducer_prepare(reducer_t *r, PyObject *unused)
{
    (void)unused;
    return none_or_null(mpidp_py_reducer_prepare(r));
}

static PyObject *reducer_complete(reducer_t *r, PyObject *unused)
{
    (void)unused;
    return none_or_null(mpidp_py_reducer_complete(r));
}

static PyObject *reducer_shadow_pass(reducer_t *r, PyObject *unused)
{
    (void)unused;
    return none_or_null(mpidp_py_reducer_shadow_pass(r));
}

/* An index argument below `limit`, or -1 with an exception. */
static Py_ssize_t index_arg(PyObject *arg, size_t limit, const char *what)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < 0 || (size_t)i >= limit) {
        PyErr_Format(PyExc_IndexError, "%s %zd out of range", what, i);
        return -1;
    }
    return i;
}

static PyObject *reducer_deliver_for_step(reducer_t *r, PyObject *arg)
{
    Py_ssize_t b = index_arg(arg, r->n_buckets, "bucket");
    return b < 0 ? NULL : none_or_null(mpidp_py_reducer_deliver(r, (size_t)b));
}

static PyObject *reducer_after_step(reducer_t *r, PyObject *arg)
{
    Py_ssize_t b = index_arg(arg, r->n_buckets, "bucket");
    return b < 0 ? NULL : none_or_null(mpidp_py_reducer_after_step(r, (size_t)b));
}

/* stepped(b): the optimizer step was applied to bucket b in the open pass. */
static PyObject *reducer_stepped(reducer_t *r, PyObject *arg)
{
    Py_ssize_t b = index_arg(arg, r->n_buckets, "bucket");
    return b < 0 ? NULL : PyBool_FromLong(mpidp_reducer_stepped(r->core, (size_t)b));
}

static PyObject *reducer_deliver_now(reducer_t *r, PyObject *unused)
{
    (void)unused;
    return none_or_null(mpidp_py_reducer_deliver_now(r));
}

static PyObject *reducer_edited(reducer_t *r, PyObject *unused)
{
    (void)unused;
    int edited = mpidp_py_reducer_edited(r);
    return edited < 0 ? NULL : PyBool_FromLong(edited);
}

/* set_divisor(n): average over n ranks from the next pass on (join). */
static PyObject *reducer_set_divisor(reducer_t *r, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (CORE(r, "DataParallel.join", mpidp_reducer_set_divisor(r->core, (int)n)) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *reducer_hook(reducer_t *r, PyObject *arg)
{
    Py_ssize_t i = index_arg(arg, r->n_params, "parameter");
    if (i < 0) return NULL;
    return mpidp_py_gradhook_new(r, (size_t)i);
}

static PyObject *reducer_get_finalized(reducer_t *r, void *c)
{
    (void)c;
    return PyBool_FromLong(mpidp_reducer_finalized(r->core));
}

static PyObject *reducer_get_n_buckets(reducer_t *r, void *c)
{
    (void)c;
    return PyLong_FromSize_t(r->n_buckets);
}

/* Reducer(*, comm, params, views, buckets, param_bucket, param_offset, param_numel,
 *         bucket_info, queue_callback, blocking, name, wire_dtype=-1, staging=None,
 *         event_type=None):
 * keyword-only, so a caller cannot swap two of the many tuples unnoticed.
 * staging: (device_buckets, host_grads, device_grads): the buckets the .grad
 * views live in, and the gradient parts of the host and device buckets. */
static PyObject *reducer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"comm", "params", "views", "buckets", "param_bucket", "param_offset",
                             "param_numel", "bucket_info", "queue_callback", "blocking", "name",
                             "wire_dtype", "staging", "event_type", NULL};
    PyObject *comm = NULL, *params = NULL, *views = NULL, *buckets = NULL, *pb = NULL, *po = NULL,
             *pn = NULL, *binfo = NULL, *qcb = NULL;
    int blocking = -1, wire = -1;
    const char *name = NULL;
    PyObject *staging = Py_None, *event_type = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OO!O!O!O!O!O!O!OpsiOO:Reducer", kwlist, &comm,
                                     &PyTuple_Type, &params, &PyTuple_Type, &views, &PyTuple_Type,
                                     &buckets, &PyTuple_Type, &pb, &PyTuple_Type, &po,
                                     &PyTuple_Type, &pn, &PyTuple_Type, &binfo, &qcb, &blocking,
                                     &name, &wire, &staging, &event_type))
        return NULL;
    /* The format makes every keyword optional; all but the last three are required. */
    const void *given[] = {comm, params, views, buckets, pb, po, pn, binfo, qcb,
                           blocking < 0 ? NULL : &blocking, name};
    for (size_t k = 0; k < sizeof given / sizeof given[0]; k++)
        if (given[k] == NULL)
            return PyErr_Format(PyExc_TypeError, "Reducer: missing keyword argument '%s'",
                                kwlist[k]);
    Py_ssize_t np = PyTuple_GET_SIZE(params), nb = PyTuple_GET_SIZE(buckets);
    int staged = staging != Py_None;
    if (staged && !(PyTuple_Check(staging) && PyTuple_GET_SIZE(staging) == 3 &&
                    PyTuple_Check(PyTuple_GET_ITEM(staging, 0)) &&
                    PyTuple_GET_SIZE(PyTuple_GET_ITEM(staging, 0)) == nb &&
                    PyTuple_Check(PyTuple_GET_ITEM(staging, 1)) &&
                    PyTuple_GET_SIZE(PyTuple_GET_ITEM(staging, 1)) == nb &&
                    PyTuple_Check(PyTuple_GET_ITEM(staging, 2)) &&
                    PyTuple_GET_SIZE(PyTuple_GET_ITEM(staging, 2)) == nb))
        return PyErr_Format(PyExc_ValueError, "Reducer: staging must be three tuples, one entry "
                            "per bucket");
    mpidp_py_state *st = mpidp_py_state_of_type(type);
    if (st == NULL) return NULL;
    mpidp_py_comm_t *c = mpidp_py_as_comm(st, comm, "comm");
    if (c == NULL) return NULL;
    if (PyTuple_GET_SIZE(views) != np || PyTuple_GET_SIZE(pb) != np || PyTuple_GET_SIZE(po) != np ||
        PyTuple_GET_SIZE(pn) != np || PyTuple_GET_SIZE(binfo) != nb)
        return PyErr_Format(PyExc_ValueError, "Reducer: inconsistent layout lengths");

    reducer_t *r = (reducer_t *)type->tp_alloc(type, 0);
    if (r == NULL) return NULL;
    r->st = st;
    r->module = Py_NewRef(PyType_GetModule(type));
    r->comm = Py_NewRef(comm);
    r->params = Py_NewRef(params);
    r->views = Py_NewRef(views);
    r->bucket_tensors = Py_NewRef(buckets);
    if (staged) {
        r->device_buckets = Py_NewRef(PyTuple_GET_ITEM(staging, 0));
        r->host_grads = Py_NewRef(PyTuple_GET_ITEM(staging, 1));
        r->dev_grads = Py_NewRef(PyTuple_GET_ITEM(staging, 2));
    }
    r->event_type = event_type == Py_None || r->device_buckets == NULL ? NULL : Py_NewRef(event_type);
    r->queue_callback = Py_NewRef(qcb);
    r->blocking = blocking;
    r->n_params = (size_t)np;
    r->n_buckets = (size_t)nb;

    size_t n1 = np ? (size_t)np : 1, b1 = nb ? (size_t)nb : 1;
    uint32_t *bucket_of = malloc(n1 * sizeof *bucket_of);
    size_t *offset = malloc(n1 * sizeof *offset);
    size_t *numel = malloc(n1 * sizeof *numel);
    mpidp_bucket_info_t *info = malloc(b1 * sizeof *info);
    void **data = malloc(b1 * sizeof *data);
    r->buckets = calloc(b1, sizeof *r->buckets);
    r->seen = calloc(n1, 1);
    r->act = calloc(n1, 1);
    r->versions = calloc(b1, sizeof *r->versions);
    r->stage_event = calloc(b1, sizeof *r->stage_event);
    r->copy_issued = calloc(b1, 1);
    PyObject *result = NULL;
    if (!bucket_of || !offset || !numel || !info || !data || !r->buckets || !r->seen ||
        !r->act || !r->versions || !r->stage_event || !r->copy_issued) {
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
    for (Py_ssize_t i = 0; i < np; i++) {
        bucket_of[i] = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(pb, i));
        offset[i] = PyLong_AsSize_t(PyTuple_GET_ITEM(po, i));
        numel[i] = PyLong_AsSize_t(PyTuple_GET_ITEM(pn, i));
        if (PyErr_Occurred()) goto done;
        if (bucket_of[i] >= (uint32_t)nb) {
            PyErr_Format(PyExc_ValueError, "Reducer: parameter %zd has no bucket", i);
            goto done;
        }
    }
    mpidp_reducer_config_t cfg = {
        .comm = c->comm, .reqs = st->reqs, .n_params = (size_t)np, .param_bucket = bucket_of,
        .param_offset = offset, .param_numel = numel, .n_buckets = (size_t)nb, .buckets = info,
        .bucket_data = data, .wire_dtype = wire, .separate = !blocking, .name = name,
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
        if (!finalized && mpidp_reducer_finalized(r->core))
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
    free(r->seen);
    free(r->act);
    free(r->versions);
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
    {"complete", (PyCFunction)reducer_complete, METH_NOARGS,
     "Finish the open pass (wait for every bucket); no-op when none is open."},
    {"hook", (PyCFunction)reducer_hook, METH_O, "hook(i) -> GradHook for parameter i."},
    {"deliver_for_step", (PyCFunction)reducer_deliver_for_step, METH_O,
     "Non-blocking: deliver_for_step(b): bucket b's mean into .grad for the step."},
    {"after_step", (PyCFunction)reducer_after_step, METH_O,
     "Non-blocking: after_step(b): bucket b's .grad back as the user left it."},
    {"stepped", (PyCFunction)reducer_stepped, METH_O,
     "Non-blocking: stepped(b) -> the step was applied to bucket b in the open pass."},
    {"deliver_now", (PyCFunction)reducer_deliver_now, METH_NOARGS,
     "Non-blocking, between backward and step: the means into .grad now; the pass ends."},
    {"edited", (PyCFunction)reducer_edited, METH_NOARGS,
     "Non-blocking: True when gradients were changed in place since the end of backward."},
    {"set_divisor", (PyCFunction)reducer_set_divisor, METH_O,
     "set_divisor(n): average gradients over n ranks from the next pass on."},
    {"shadow_pass", (PyCFunction)reducer_shadow_pass, METH_NOARGS,
     "Take part in one pass of bucket allreduces with zero contributions (join)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef reducer_getset[] = {
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

int mpidp_py_reducer_init(PyObject *module, mpidp_py_state *st)
{
    if (mpidp_py_reducer_pass_init() < 0) return -1;
    st->reducer_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &reducer_spec, NULL);
    if (st->reducer_type == NULL || PyModule_AddType(module, st->reducer_type) < 0) return -1;
    return mpidp_py_gradhook_init(module, st);
}
