/* mpidp._C.BackgroundAverager: the glue of the background averaging engine
 * (core/bgavg.c, mpidp/bgavg.h) that AsyncModelAverageAlgorithm runs. It
 * borrows the parameters for the thread's lifetime, releases the GIL while
 * taking the weight lock or joining the thread (the thread never takes the
 * GIL), and turns the thread's failure into an exception when asked. */
#include "module.h"

#include "mpidp/bgavg.h"

#define WHAT "AsyncModelAverageAlgorithm"

typedef struct {
    PyObject_HEAD
    mpidp_py_state *st;
    mpidp_py_f32s_t params;      /* borrowed: the thread writes them */
    mpidp_bgavg_t *core;
} bgavg_t;

static PyObject *bgavg_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"comm", "params", "interval_s", NULL};
    PyObject *comm, *params;
    double interval;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!d:BackgroundAverager", kwlist, &comm,
                                     &PyTuple_Type, &params, &interval) ||
        mpidp_py_check_not_forked(WHAT) < 0)
        return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(type);
    mpidp_py_comm_t *c = st ? mpidp_py_as_comm(st, comm, "comm") : NULL;
    if (c == NULL) return NULL;
    bgavg_t *s = (bgavg_t *)type->tp_alloc(type, 0);
    if (s == NULL) return NULL;
    s->st = st;
    int ok = mpidp_py_f32s_borrow(st, params, "params", &s->params) == 0;
    if (ok) {
        mpidp_bgavg_opts_t o = {.segs = s->params.data, .lens = s->params.numel,
                                .n_segs = s->params.n, .interval_s = interval,
                                .timeout_s = mpidp_py_timeout_s,
                                .abort_on_timeout = mpidp_py_abort_on_timeout, .what = WHAT};
        ok = MPIDP_PY_CALL(st, WHAT, mpidp_bgavg_start(c->comm, &o, &s->core)) == 0;
    }
    if (!ok) Py_CLEAR(s);
    return (PyObject *)s;
}

/* The thread's failure, if it ended with one, as the exception. */
static int check_thread(bgavg_t *s)
{
    return MPIDP_PY_CALL(s->st, WHAT, mpidp_bgavg_status(s->core));
}

static PyObject *bgavg_lock(bgavg_t *s, PyObject *unused)
{
    (void)unused;
    if (check_thread(s) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS mpidp_bgavg_lock(s->core);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *bgavg_unlock(bgavg_t *s, PyObject *unused)
{
    (void)unused;
    mpidp_bgavg_unlock(s->core);
    Py_RETURN_NONE;
}

static PyObject *bgavg_stop(bgavg_t *s, PyObject *unused)
{
    (void)unused;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = mpidp_bgavg_stop(s->core);
    Py_END_ALLOW_THREADS
    return mpidp_py_none_or_null(MPIDP_PY_CALL(s->st, WHAT, rc));
}

static PyObject *bgavg_check(bgavg_t *s, PyObject *unused)
{
    (void)unused;
    return mpidp_py_none_or_null(check_thread(s));
}

static PyObject *bgavg_get_rounds(bgavg_t *s, void *c)
{
    (void)c;
    return PyLong_FromLongLong((long long)mpidp_bgavg_rounds(s->core));
}

static int bgavg_traverse(bgavg_t *s, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(s));
    Py_VISIT(s->params.tuple);
    return 0;
}

static void bgavg_dealloc(bgavg_t *s)
{
    PyTypeObject *tp = Py_TYPE(s);
    PyObject_GC_UnTrack(s);
    /* A thread still running writes into the parameters: the engine refuses
     * to go, and they stay borrowed (Python stops it before dropping it; this
     * is only reached when that went wrong). */
    if (mpidp_bgavg_free(s->core) == MPIDP_OK) mpidp_py_f32s_release(&s->params);
    tp->tp_free((PyObject *)s);
    Py_DECREF(tp);
}

static PyMethodDef bgavg_methods[] = {
    {"lock", (PyCFunction)bgavg_lock, METH_NOARGS,
     "Take the weight lock (raises the thread's failure first, if it ended with one)."},
    {"unlock", (PyCFunction)bgavg_unlock, METH_NOARGS, "Release the weight lock."},
    {"stop", (PyCFunction)bgavg_stop, METH_NOARGS,
     "Stop the thread at a round every rank agrees on and join it (collective); raises "
     "its failure."},
    {"check", (PyCFunction)bgavg_check, METH_NOARGS, "Raise the thread's failure, if any."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef bgavg_getset[] = {
    {"rounds", (getter)bgavg_get_rounds, NULL, "Averaging rounds completed.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot bgavg_slots[] = {
    {Py_tp_new, bgavg_new},
    {Py_tp_dealloc, bgavg_dealloc},
    {Py_tp_traverse, bgavg_traverse},
    {Py_tp_methods, bgavg_methods},
    {Py_tp_getset, bgavg_getset},
    {Py_tp_doc, "BackgroundAverager(comm, params, interval_s): a thread averaging params "
                "over comm every interval (internal)."},
    {0, NULL},
};

PyType_Spec mpidp_py_bgavg_spec = {
    .name = "mpidp._C.BackgroundAverager",
    .basicsize = sizeof(bgavg_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = bgavg_slots,
};
