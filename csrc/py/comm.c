/* mpidp._C.Comm: communicator intake from mpi4py.
 *
 * This is the only file that includes mpi4py's C API: import_mpi4py() fills
 * function pointers that are static to this translation unit. A Comm holds
 * MPI_Comm_dup of the user's communicator with MPI_ERRORS_RETURN set, so that
 * (1) our collectives never match messages of the user's own traffic and (2) an
 * MPI failure returns a code that becomes mpidp.CommError instead of killing
 * the process from inside MPI. */
#include "module.h"

#include <mpi4py/mpi4py.h>

#include "mpidp/comm.h"
#include "mpidp/status.h"

static int mpi4py_ready = 0;

int mpidp_py_import_mpi4py(void)
{
    if (!mpi4py_ready) {
        if (import_mpi4py() < 0) return -1;
        mpi4py_ready = 1;
    }
    return 0;
}

static PyObject *comm_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"comm", NULL};
    PyObject *source;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Comm", kwlist, &source)) return NULL;
    if (mpidp_py_check_not_forked("Comm") < 0) return NULL;
    if (mpidp_py_import_mpi4py() < 0) return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(type);
    if (st == NULL) return NULL;
    if (!PyObject_TypeCheck(source, &PyMPIComm_Type))
        return PyErr_Format(PyExc_TypeError, "comm: expected an mpi4py communicator "
                            "(e.g. MPI.COMM_WORLD), got %.100s", Py_TYPE(source)->tp_name);
    MPI_Comm *user = PyMPIComm_Get(source);
    if (user == NULL) return NULL;
    if (*user == MPI_COMM_NULL)
        return PyErr_Format(PyExc_ValueError, "comm: the communicator is MPI.COMM_NULL");

    mpidp_py_comm_t *self = (mpidp_py_comm_t *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    int status, in_flight = 0;
    mpidp_error_clear();
    MPIDP_PY_WAIT(st, status, mpidp_comm_dup(*user, st->reqs, mpidp_py_timeout_s, &self->comm,
                                             &self->rank, &self->size, &in_flight));
    if (status != MPIDP_OK) {
        /* Posted but not finished: MPI will write the new handle into
         * self->comm when it completes, so self must never be freed. */
        if (!in_flight) Py_DECREF(self);
        return mpidp_py_raise(st, status, "Comm");
    }
    return (PyObject *)self;
}

static void comm_dealloc(mpidp_py_comm_t *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    mpidp_comm_free(&self->comm);   /* nothing after MPI_Finalize (mpi4py's, at exit) */
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

mpidp_py_comm_t *mpidp_py_as_comm(mpidp_py_state *st, PyObject *obj, const char *argname)
{
    if (!PyObject_TypeCheck(obj, st->comm_type)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an mpidp._C.Comm, got %.100s", argname,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return (mpidp_py_comm_t *)obj;
}

static PyObject *comm_get_rank(mpidp_py_comm_t *self, void *c) { (void)c; return PyLong_FromLong(self->rank); }
static PyObject *comm_get_size(mpidp_py_comm_t *self, void *c) { (void)c; return PyLong_FromLong(self->size); }

static PyObject *comm_py2f(mpidp_py_comm_t *self, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLong((long)MPI_Comm_c2f(self->comm));
}

static PyGetSetDef comm_getset[] = {
    {"rank", (getter)comm_get_rank, NULL, "This process's rank in the communicator.", NULL},
    {"size", (getter)comm_get_size, NULL, "Number of processes in the communicator.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef comm_methods[] = {
#define COLLECTIVE(name, doc)                                                   \
    {#name, (PyCFunction)(void (*)(void))mpidp_py_comm_##name, METH_FASTCALL | METH_KEYWORDS, doc}
    COLLECTIVE(allreduce, "allreduce(tensor, op, wire_dtype, async_op) -> Work | None (in place)"),
    COLLECTIVE(bcast, "bcast(tensor, root, async_op=False) -> Work | None (in place)"),
    COLLECTIVE(allgather, "allgather(tensor, out, async_op=False) -> Work | None: every rank's\n"
               "tensor into out, in rank order"),
    COLLECTIVE(reduce_scatter, "reduce_scatter(tensor, out, counts, op, async_op=False) -> Work |\n"
               "None: out = the sum (OP_SUM) or mean (OP_AVG) of block `rank` of every rank's\n"
               "tensor; counts: elements per rank"),
    COLLECTIVE(allgatherv, "allgatherv(tensor, out, counts, async_op=False) -> Work | None:\n"
               "every rank's tensor (counts[r] elements) into out, in rank order"),
    COLLECTIVE(peer_exchange, "peer_exchange(send, out_peers, recvs, in_peers) -> Work: send to\n"
               "each rank of out_peers, receive recvs[i] from in_peers[i] (every rank calls it,\n"
               "in the same order)"),
    COLLECTIVE(barrier, "barrier(async_op=False) -> Work | None"),
    COLLECTIVE(reduce, "reduce(tensor, op, root, async_op=False) -> Work | None: root's tensor\n"
               "becomes the reduction of every rank's (in place)"),
    COLLECTIVE(gatherv, "gatherv(send, recv, counts, root, async_op=False) -> Work | None: every\n"
               "rank's send (counts[r] elements) into root's recv, in rank order (None elsewhere)"),
    COLLECTIVE(scatterv, "scatterv(send, recv, counts, root, async_op=False) -> Work | None:\n"
               "block r of root's send (None elsewhere) into rank r's recv"),
    COLLECTIVE(alltoallv, "alltoallv(send, recv, send_counts, recv_counts, async_op=False) ->\n"
               "Work | None: block r of send to rank r, rank r's block for this rank into recv"),
    COLLECTIVE(send, "send(tensor, peer, tag) -> Work"),
    COLLECTIVE(recv, "recv(tensor, peer, tag, source) -> Work: peer -1 = any rank; the sender\n"
               "lands in source (a one-element int32 tensor)"),
    COLLECTIVE(agree, "agree(fields) -> bool: whether every rank passed the same tuple of ints\n"
               "(each in (-2**63, 2**63)); blocking, with the deadline of every wait"),
#undef COLLECTIVE
    {"py2f", (PyCFunction)comm_py2f, METH_NOARGS, "The Fortran handle of the duplicate."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot comm_slots[] = {
    {Py_tp_new, comm_new},
    {Py_tp_dealloc, comm_dealloc},
    {Py_tp_getset, comm_getset},
    {Py_tp_methods, comm_methods},
    {Py_tp_doc, "Comm(mpi4py_comm): mpidp's duplicate of an mpi4py communicator."},
    {0, NULL},
};

PyType_Spec mpidp_py_comm_spec = {
    .name = "mpidp._C.Comm",
    .basicsize = sizeof(mpidp_py_comm_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = comm_slots,
};
