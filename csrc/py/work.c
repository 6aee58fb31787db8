/* mpidp._C.Work: the handle of an asynchronous operation -- a collective
 * started with async_op, or a peer exchange.
 *
 * A Work owns its operation and the tensors it reads and writes, and keeps
 * them until the operation completes. An allreduce's chunks beyond the first
 * are posted as earlier ones complete, which happens in wait() and
 * is_completed(). If the Work is dropped earlier, its destructor waits (with
 * the usual deadline) so that MPI never writes into freed memory. */
#include "module.h"

#include <stdio.h>

#include "mpidp/mpi_info.h"
#include "mpidp/status.h"

typedef struct {
    PyObject_HEAD
    mpidp_handle_t h;   /* the operation, and how it ended (mpidp/operation.h) */
    mpidp_py_borrowed_t *tensors; /* PyMem array of n, released once h.op is freed */
    size_t n;
    PyObject *comm;     /* the Comm must outlive the operation */
    PyObject *result;   /* what result() returns */
} work_t;

/* Releases the tensors once the core freed the operation. */
static void release_if_freed(work_t *w)
{
    if (w->h.op == NULL) mpidp_py_release_all(w->tensors, w->n);
}

PyObject *mpidp_py_work_new(mpidp_py_state *st, const mpidp_operation_t *ops, void *x,
                            mpidp_py_borrowed_t *keepalive, size_t n, PyObject *comm,
                            PyObject *result)
{
    work_t *w = PyObject_New(work_t, st->work_type);
    mpidp_py_borrowed_t *tensors = w ? PyMem_Malloc((n ? n : 1) * sizeof *tensors) : NULL;
    if (tensors == NULL) {
        /* Cannot hand the operation out: finish it here. */
        int ended = 0;
        mpidp_operation_finish(ops, x, mpidp_py_timeout_s, &ended);
        if (ended) mpidp_py_release_all(keepalive, n);
        if (w) PyObject_Free(w), Py_DECREF(st->work_type);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < n; i++) {
        tensors[i] = keepalive[i];
        keepalive[i].capsule = NULL;
    }
    mpidp_handle_init(&w->h, ops, x);
    w->tensors = tensors;
    w->n = n;
    w->comm = Py_XNewRef(comm);
    w->result = Py_NewRef(result);
    return (PyObject *)w;
}

/* Waits for the operation (deadline: `timeout` seconds, None: MPIDP_TIMEOUT).
 * 0, or -1 with the exception -- also on every wait after a failure, so that
 * a caught error cannot turn into an unreduced result() later. */
static int wait_for(work_t *self, PyObject *timeout_obj)
{
    double timeout = mpidp_py_timeout_s;
    if (timeout_obj != Py_None && (timeout = PyFloat_AsDouble(timeout_obj)) == -1.0 && PyErr_Occurred())
        return -1;
    mpidp_py_state *st = mpidp_py_state_of_type(Py_TYPE(self));
    int rc;
    mpidp_error_clear();
    MPIDP_PY_WAIT(st, rc, mpidp_handle_wait(&self->h, timeout));
    release_if_freed(self);
    return mpidp_py_check(st, rc, "Work.wait");
}

static PyObject *work_wait(work_t *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:wait", kwlist, &timeout)) return NULL;
    return mpidp_py_none_or_null(wait_for(self, timeout));
}

/* result(): waits, then the tensor the operation wrote (None if none). */
static PyObject *work_result(work_t *self, PyObject *unused)
{
    (void)unused;
    return wait_for(self, Py_None) < 0 ? NULL : Py_NewRef(self->result);
}

static PyObject *work_is_completed(work_t *self, PyObject *unused)
{
    (void)unused;
    int done = 0;
    mpidp_error_clear();
    int rc = mpidp_handle_test(&self->h, &done);
    release_if_freed(self);
    if (rc != MPIDP_OK) return mpidp_py_raise(mpidp_py_state_of_type(Py_TYPE(self)), rc, "Work.is_completed");
    return PyBool_FromLong(done);
}

static void work_dealloc(work_t *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    /* Finished here so that MPI never writes into freed tensors; after
     * MPI_Finalize nothing can be tested: the tensors are leaked. */
    if (self->h.op != NULL && !mpidp_mpi_finalized()) {
        int rc = mpidp_handle_drop(&self->h, mpidp_py_timeout_s);
        if (rc != MPIDP_OK && !self->h.done)
            fprintf(stderr, "mpidp: a dropped Work could not complete: %s\n", mpidp_error_detail());
    }
    if (self->h.op != NULL)
        for (size_t i = 0; i < self->n; i++) self->tensors[i].capsule = NULL;
    mpidp_py_release_all(self->tensors, self->n);
    PyMem_Free(self->tensors);
    Py_CLEAR(self->comm);
    Py_CLEAR(self->result);
    PyObject_Free(self);
    Py_DECREF(tp);
}

static PyMethodDef work_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))work_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None): block until the operation has completed (deadline: MPIDP_TIMEOUT)."},
    {"is_completed", (PyCFunction)work_is_completed, METH_NOARGS,
     "is_completed() -> bool, without blocking (and progresses MPI)."},
    {"result", (PyCFunction)work_result, METH_NOARGS,
     "result() -> the tensor the operation wrote (the reduced or broadcast tensor, the\n"
     "gathered or scattered output), after waiting for it; None for a barrier."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot work_slots[] = {
    {Py_tp_dealloc, work_dealloc},
    {Py_tp_methods, work_methods},
    {Py_tp_doc, "Handle of an asynchronous mpidp operation: wait(), is_completed()."},
    {0, NULL},
};

PyType_Spec mpidp_py_work_spec = {
    .name = "mpidp._C.Work",
    .basicsize = sizeof(work_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = work_slots,
};
