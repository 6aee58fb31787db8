/* mpidp._C.DevComm: a device communicator (mpidp/devcomm.h) over a Comm.
 *
 *   DevComm(comm, "nccl", nccl_path, cudart_path, device)   collective
 *   DevComm(comm, "mpi")                                     a CUDA-aware MPI
 *   DevComm(comm, "standin")                                 tests, CPU memory
 *
 * allreduce_(data_ptr, count, dtype, stream, what) starts an in-place sum,
 * collective_(kind, send_ptr, recv_ptr, count, dtype, op, root, stream,
 * what) any of mpidp/devcomm.h's collectives ('allreduce', 'bcast',
 * 'allgather', 'reduce_scatter'); both return a ticket. wait(ticket) waits
 * for it under the process deadline (GIL released) and raises what failed;
 * test(ticket) -> done. The Python side (mpidp/_engines/device_reduction.py,
 * mpidp/c10d/_device.py) holds the tensors and orders the streams: pointers
 * are taken as ints here. */
#include "module.h"

#include <stdint.h>
#include <string.h>

#include "mpidp/devcomm.h"
#include "mpidp/mpi_info.h"

typedef struct {
    PyObject_HEAD
    mpidp_py_state *st;
    mpidp_devcomm_t *dc;
    PyObject *comm; /* the Comm must outlive the device communicator */
} devcomm_t;

/* The communicator, or NULL with a RuntimeError once closed. */
static mpidp_devcomm_t *open_dc(devcomm_t *d)
{
    if (d->dc == NULL) PyErr_SetString(PyExc_RuntimeError, "DevComm: closed");
    return d->dc;
}

#if PY_VERSION_HEX >= 0x030D0000
#define finalizing() Py_IsFinalizing()
#else
#define finalizing() _Py_IsFinalizing()
#endif

static PyObject *ticket_of(mpidp_req_t h)
{
    return PyLong_FromUnsignedLongLong(((unsigned long long)h.slot << 32) | h.gen);
}

static int req_of(PyObject *arg, mpidp_req_t *h)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    h->slot = (uint32_t)(v >> 32);
    h->gen = (uint32_t)v;
    return 0;
}

static PyObject *devcomm_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"comm", "kind", "nccl_path", "cudart_path", "device", NULL};
    PyObject *comm;
    const char *kind, *nccl_path = NULL, *cudart_path = NULL;
    int device = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Os|zzi:DevComm", kwlist, &comm, &kind,
                                     &nccl_path, &cudart_path, &device))
        return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(type);
    mpidp_py_comm_t *c = st ? mpidp_py_as_comm(st, comm, "comm") : NULL;
    if (c == NULL || mpidp_py_check_not_forked("DevComm") < 0) return NULL;
    int nccl = strcmp(kind, "nccl") == 0, mpi = strcmp(kind, "mpi") == 0;
    if (!nccl && !mpi && strcmp(kind, "standin") != 0)
        return PyErr_Format(PyExc_ValueError, "kind: expected 'nccl', 'mpi' or 'standin', got '%s'",
                            kind);
    if (nccl && (nccl_path == NULL || cudart_path == NULL))
        return PyErr_Format(PyExc_ValueError, "kind 'nccl' needs nccl_path and cudart_path");
    devcomm_t *d = (devcomm_t *)type->tp_alloc(type, 0);
    if (d == NULL) return NULL;
    d->st = st;
    d->comm = Py_NewRef(comm);
    int rc;
    mpidp_error_clear();
    if (nccl) {
        MPIDP_PY_WAIT(st, rc, mpidp_devcomm_create_nccl(c->comm, st->reqs, nccl_path, cudart_path,
                                                         device, mpidp_py_timeout_s, &d->dc));
    } else if (mpi) {
        rc = mpidp_devcomm_create_mpi(c->comm, st->reqs, &d->dc);
    } else {
        rc = mpidp_devcomm_create_standin(c->comm, st->reqs, &d->dc);
    }
    if (mpidp_py_check(st, rc, "DevComm") < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return (PyObject *)d;
}

/* allreduce_(data_ptr, count, dtype, stream, what) -> ticket */
static PyObject *devcomm_allreduce_(devcomm_t *d, PyObject *args)
{
    unsigned long long ptr, count, stream;
    int dtype;
    const char *what;
    if (!PyArg_ParseTuple(args, "KKiKs:allreduce_", &ptr, &count, &dtype, &stream, &what))
        return NULL;
    if (mpidp_py_check_not_forked("device allreduce") < 0 || open_dc(d) == NULL) return NULL;
    mpidp_req_t h;
    if (MPIDP_PY_CALL(d->st, "device allreduce",
                      mpidp_devcomm_allreduce_start(d->dc, (void *)(uintptr_t)ptr, (size_t)count,
                                                    dtype, (void *)(uintptr_t)stream, what, &h)) < 0)
        return NULL;
    return ticket_of(h);
}

/* collective_(kind, send_ptr, recv_ptr, count, dtype, op, root, stream, what) -> ticket */
static PyObject *devcomm_collective_(devcomm_t *d, PyObject *args)
{
    static const char *kinds[] = {"allreduce", "bcast", "allgather", "reduce_scatter"};
    const char *kind, *what;
    unsigned long long send, recv, count, stream;
    int dtype, op, root;
    if (!PyArg_ParseTuple(args, "sKKKiiiKs:collective_", &kind, &send, &recv, &count, &dtype, &op,
                          &root, &stream, &what))
        return NULL;
    mpidp_devop_t o = {.send = (const void *)(uintptr_t)send, .recv = (void *)(uintptr_t)recv,
                       .count = (size_t)count, .dtype = dtype, .op = op, .root = root};
    for (int k = 0; k < 4; k++)
        if (strcmp(kind, kinds[k]) == 0) o.kind = (mpidp_devop_kind_t)(MPIDP_DEVOP_ALLREDUCE + k);
    if (o.kind == 0)
        return PyErr_Format(PyExc_ValueError, "kind: expected 'allreduce', 'bcast', 'allgather' "
                            "or 'reduce_scatter', got '%s'", kind);
    if (mpidp_py_check_not_forked(what) < 0 || open_dc(d) == NULL) return NULL;
    mpidp_req_t h;
    if (MPIDP_PY_CALL(d->st, what, mpidp_devcomm_start(d->dc, &o, (void *)(uintptr_t)stream,
                                                      what, &h)) < 0)
        return NULL;
    return ticket_of(h);
}

static PyObject *devcomm_wait(devcomm_t *d, PyObject *arg)
{
    mpidp_req_t h;
    if (req_of(arg, &h) < 0 || open_dc(d) == NULL) return NULL;
    int rc;
    mpidp_error_clear();
    MPIDP_PY_WAIT(d->st, rc, mpidp_devcomm_wait(d->dc, h, mpidp_py_timeout_s));
    return mpidp_py_none_or_null(mpidp_py_check(d->st, rc, "device allreduce"));
}

static PyObject *devcomm_test(devcomm_t *d, PyObject *arg)
{
    mpidp_req_t h;
    int done = 0;
    if (req_of(arg, &h) < 0 ||
        MPIDP_PY_CALL(d->st, "device allreduce", mpidp_reqtable_test(d->st->reqs, h, &done)) < 0)
        return NULL;
    return PyBool_FromLong(done);
}

/* check(): raises why the communicator was aborted (the watchdog's
 * deadline, NCCL's error, a failed wait), else returns None. */
static PyObject *devcomm_check(devcomm_t *d, PyObject *unused)
{
    (void)unused;
    if (open_dc(d) == NULL) return NULL;
    return mpidp_py_none_or_null(MPIDP_PY_CALL(d->st, "device allreduce", mpidp_devcomm_status(d->dc)));
}

static PyObject *devcomm_abort(devcomm_t *d, PyObject *unused)
{
    (void)unused;
    if (d->dc) mpidp_devcomm_abort(d->dc);
    Py_RETURN_NONE;
}

/* close(): waits for what is in flight (aborting what does not end by the
 * deadline) and frees the communicator; later calls raise. */
static PyObject *devcomm_close(devcomm_t *d, PyObject *unused)
{
    (void)unused;
    mpidp_devcomm_t *dc = d->dc;
    d->dc = NULL;
    if (dc) {
        Py_BEGIN_ALLOW_THREADS
        mpidp_devcomm_destroy(dc, mpidp_mpi_finalized() ? 0 : mpidp_py_timeout_s);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *devcomm_get_kind(devcomm_t *d, void *c)
{
    (void)c;
    if (open_dc(d) == NULL) return NULL;
    switch (mpidp_devcomm_kind(d->dc)) {
    case MPIDP_DEVCOMM_NCCL: return PyUnicode_FromString("nccl");
    case MPIDP_DEVCOMM_MPI: return PyUnicode_FromString("mpi");
    default: return PyUnicode_FromString("standin");
    }
}

static PyObject *devcomm_get_version(devcomm_t *d, void *c)
{
    (void)c;
    if (open_dc(d) == NULL) return NULL;
    return PyLong_FromLong(mpidp_devcomm_version(d->dc));
}

static PyObject *devcomm_get_aborted(devcomm_t *d, void *c)
{
    (void)c;
    return PyBool_FromLong(mpidp_devcomm_aborted(d->dc));
}

static void devcomm_dealloc(devcomm_t *d)
{
    PyTypeObject *tp = Py_TYPE(d);
    /* At interpreter shutdown the CUDA runtime may already be gone: the
     * process is ending, and the communicator is left to it (close() at
     * exit, _device_reduction.py, normally came first). */
    if (d->dc && !finalizing())
        mpidp_devcomm_destroy(d->dc, mpidp_mpi_finalized() ? 0 : mpidp_py_timeout_s);
    Py_CLEAR(d->comm);
    tp->tp_free((PyObject *)d);
    Py_DECREF(tp);
}

static PyMethodDef devcomm_methods[] = {
    {"allreduce_", (PyCFunction)devcomm_allreduce_, METH_VARARGS,
     "allreduce_(data_ptr, count, dtype, stream, what) -> ticket: start an in-place sum."},
    {"collective_", (PyCFunction)devcomm_collective_, METH_VARARGS,
     "collective_(kind, send_ptr, recv_ptr, count, dtype, op, root, stream, what) -> ticket."},
    {"wait", (PyCFunction)devcomm_wait, METH_O, "wait(ticket): until the sum is over; raises its failure."},
    {"test", (PyCFunction)devcomm_test, METH_O, "test(ticket) -> the sum is over."},
    {"check", (PyCFunction)devcomm_check, METH_NOARGS, "Raise why the communicator was aborted, if it was."},
    {"abort", (PyCFunction)devcomm_abort, METH_NOARGS, "End what is in flight; refuse new sums."},
    {"close", (PyCFunction)devcomm_close, METH_NOARGS, "Wait for what is in flight, then free."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef devcomm_getset[] = {
    {"kind", (getter)devcomm_get_kind, NULL, "'nccl' or 'standin'.", NULL},
    {"version", (getter)devcomm_get_version, NULL, "NCCL's version code (0 for the stand-in).", NULL},
    {"aborted", (getter)devcomm_get_aborted, NULL, "The communicator was aborted.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot devcomm_slots[] = {
    {Py_tp_new, devcomm_new},
    {Py_tp_dealloc, devcomm_dealloc},
    {Py_tp_methods, devcomm_methods},
    {Py_tp_getset, devcomm_getset},
    {Py_tp_doc, "A device communicator: NCCL, or its MPI stand-in for tests (internal; "
                "python/mpidp/_device_reduction.py)."},
    {0, NULL},
};

PyType_Spec mpidp_py_devcomm_spec = {
    .name = "mpidp._C.DevComm",
    .basicsize = sizeof(devcomm_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = devcomm_slots,
};
