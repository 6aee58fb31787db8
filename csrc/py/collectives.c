/* Comm's collectives: argument parsing, DLPack intake (any dtype the core
 * knows: which op suits which dtype is the core's check) and posting through
 * the core. Every collective is a core operation (mpidp/operation.h): with
 * async_op a Work owns it, else it runs to its end here with the GIL
 * released. */
#include "module.h"

#include <limits.h>

#include "mpidp/agree.h"
#include "mpidp/allreduce.h"
#include "mpidp/collectives.h"
#include "mpidp/peer_exchange.h"

/* Host tensors of any dtype the core knows. */
#define ANY_CPU (MPIDP_TENSOR_CPU_ONLY | MPIDP_TENSOR_ANY_DTYPE)

/* The module state for Comm method `usage` (its signature, for messages)
 * called with `nargs` positional arguments (`min` to `max` allowed) and no
 * keywords, in a process that may communicate; NULL with an exception. */
mpidp_py_state *mpidp_py_coll_begin(PyObject *self, const char *usage, Py_ssize_t nargs, Py_ssize_t min,
                             Py_ssize_t max, PyObject *kwnames, const char *what)
{
    if (kwnames != NULL || nargs < min || nargs > max) {
        PyErr_Format(PyExc_TypeError, "Comm.%s takes %zd%s positional arguments (%zd given)",
                     usage, min, max > min ? " or more" : "", nargs);
        return NULL;
    }
    if (mpidp_py_check_not_forked(what) < 0) return NULL;
    return mpidp_py_state_of_type(Py_TYPE(self));
}

/* The optional trailing async_op argument: 0, 1, or -1 with an exception. */
int mpidp_py_async_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t at)
{
    return nargs > at ? PyObject_IsTrue(args[at]) : 0;
}

/* What a started collective becomes: with status `rc` != MPIDP_OK nothing
 * was posted (the n tensors are released, the status raised); with
 * async_op a Work that owns the operation, its tensors and the Comm, and
 * whose result() is `result`; else the operation runs to its end here
 * (mpidp_operation_finish, GIL released) and the tensors are released once
 * the core freed it. */
PyObject *mpidp_py_started(mpidp_py_state *st, int rc, const mpidp_operation_t *ops, void *x,
                         mpidp_py_borrowed_t *t, size_t n, int async_op, PyObject *comm,
                         PyObject *result, const char *what)
{
    if (rc != MPIDP_OK) {
        mpidp_py_release_all(t, n);
        return mpidp_py_raise(st, rc, what);
    }
    if (async_op) return mpidp_py_work_new(st, ops, x, t, n, comm, result);
    int ended = 0;
    MPIDP_PY_WAIT(st, rc, mpidp_operation_finish(ops, x, mpidp_py_timeout_s, &ended));
    if (ended) mpidp_py_release_all(t, n);
    if (rc != MPIDP_OK) return mpidp_py_raise(st, rc, what);
    return mpidp_py_none_or_null(mpidp_py_warn_fp16_overflow());
}

PyObject *mpidp_py_comm_allreduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    mpidp_py_state *st = mpidp_py_coll_begin(self, "allreduce(tensor, op, wire_dtype, async_op)", nargs, 4, 4,
                               kwnames, "allreduce");
    if (st == NULL) return NULL;
    int op = PyLong_AsLong(args[1]);
    int wire = PyLong_AsLong(args[2]);
    int async_op = mpidp_py_async_arg(args, nargs, 3);
    if (PyErr_Occurred() || async_op < 0) return NULL;
    mpidp_py_borrowed_t tensor;
    if (mpidp_py_borrow(st, args[0], ANY_CPU | MPIDP_TENSOR_WRITABLE, "tensor", &tensor) < 0)
        return NULL;
    mpidp_allreduce_opts_t opts = mpidp_allreduce_default_opts(tensor.t.dtype, op, wire,
                                                                mpidp_py_timeout_s, "mpidp.allreduce");
    /* An async allreduce posts every chunk now: chunks posted later, from
     * whichever wait the program calls first, could start in different
     * orders on different ranks beside another operation in flight, and MPI
     * matches collectives by order (the blocking call waits at once). */
    if (async_op) opts.max_in_flight = 0;
    mpidp_allreduce_t *x = NULL;
    mpidp_error_clear();
    int rc = mpidp_allreduce_start(((mpidp_py_comm_t *)self)->comm, &tensor.t, &opts, st->reqs, &x);
    return mpidp_py_started(st, rc, &mpidp_allreduce_operation, x, &tensor, 1, async_op, self, args[0],
                   "allreduce");
}

PyObject *mpidp_py_comm_bcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    mpidp_py_state *st = mpidp_py_coll_begin(self, "bcast(tensor, root, async_op=False)", nargs, 2, 3, kwnames,
                               "bcast");
    if (st == NULL) return NULL;
    mpidp_py_comm_t *comm = (mpidp_py_comm_t *)self;
    int root = PyLong_AsLong(args[1]);
    int async_op = mpidp_py_async_arg(args, nargs, 2);
    if (PyErr_Occurred() || async_op < 0) return NULL;
    unsigned need = ANY_CPU | (comm->rank == root ? 0u : MPIDP_TENSOR_WRITABLE);
    mpidp_py_borrowed_t tensor;
    if (mpidp_py_borrow(st, args[0], need, "tensor", &tensor) < 0) return NULL;
    mpidp_coll_t *x = NULL;
    mpidp_error_clear();
    int rc = mpidp_bcast_start(comm->comm, &tensor.t, root, st->reqs, &x);
    return mpidp_py_started(st, rc, &mpidp_coll_operation, x, &tensor, 1, async_op, self, args[0], "bcast");
}

/* The counts tuple of a vector collective: one int >= 0 per rank, or -1. */
size_t *mpidp_py_counts_arg(PyObject *obj, int size)
{
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != size) {
        PyErr_Format(PyExc_ValueError, "counts: expected a tuple of %d ints (one per rank)", size);
        return NULL;
    }
    size_t *c = PyMem_Malloc((size_t)size * sizeof *c + 1);
    for (int r = 0; c && r < size; r++)
        if ((c[r] = PyLong_AsSize_t(PyTuple_GET_ITEM(obj, r))) == (size_t)-1 && PyErr_Occurred()) {
            PyMem_Free(c);
            return NULL;
        }
    if (c == NULL) PyErr_NoMemory();
    return c;
}

/* allgather(send, recv, async_op=False), allgatherv(send, recv, counts,
 * async_op=False) and reduce_scatter(send, recv, counts, op, async_op=False),
 * told apart by `n_args`, their arguments before async_op (2, 3, 4). Both
 * tensors are borrowed until the operation ends; a Work's result() is recv. */
static PyObject *gather_or_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames, const char *usage, const char *name,
                                   Py_ssize_t n_args)
{
    mpidp_py_state *st = mpidp_py_coll_begin(self, usage, nargs, n_args, n_args + 1, kwnames, name);
    if (st == NULL) return NULL;
    mpidp_py_comm_t *comm = (mpidp_py_comm_t *)self;
    int scatter = n_args == 4, vector = n_args >= 3;
    int op = scatter ? (int)PyLong_AsLong(args[3]) : 0;
    int async_op = mpidp_py_async_arg(args, nargs, n_args);
    if (PyErr_Occurred() || async_op < 0) return NULL;
    size_t *counts = vector ? mpidp_py_counts_arg(args[2], comm->size) : NULL;
    if (vector && counts == NULL) return NULL;
    mpidp_py_borrowed_t t[2];
    PyObject *res = NULL;
    if (mpidp_py_borrow(st, args[0], ANY_CPU, "tensor", &t[0]) < 0) goto done;
    if (mpidp_py_borrow(st, args[1], ANY_CPU | MPIDP_TENSOR_WRITABLE, "out", &t[1]) < 0) {
        mpidp_py_release(&t[0]);
        goto done;
    }
    mpidp_coll_t *x = NULL;
    mpidp_error_clear();
    int rc = scatter  ? mpidp_reduce_scatter_start(comm->comm, &t[0].t, &t[1].t, counts, op, st->reqs, &x)
             : vector ? mpidp_allgatherv_start(comm->comm, &t[0].t, &t[1].t, counts, st->reqs, &x)
                      : mpidp_allgather_start(comm->comm, &t[0].t, &t[1].t, st->reqs, &x);
    res = mpidp_py_started(st, rc, &mpidp_coll_operation, x, t, 2, async_op, self, args[1], name);
done:
    PyMem_Free(counts);
    return res;
}

PyObject *mpidp_py_comm_allgather(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    return gather_or_scatter(self, args, nargs, kwnames, "allgather(tensor, out, async_op=False)",
                             "allgather", 2);
}

PyObject *mpidp_py_comm_allgatherv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames)
{
    return gather_or_scatter(self, args, nargs, kwnames,
                             "allgatherv(tensor, out, counts, async_op=False)", "allgatherv", 3);
}

PyObject *mpidp_py_comm_reduce_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwnames)
{
    return gather_or_scatter(self, args, nargs, kwnames,
                             "reduce_scatter(tensor, out, counts, op, async_op=False)",
                             "reduce_scatter", 4);
}

PyObject *mpidp_py_comm_barrier(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    mpidp_py_state *st = mpidp_py_coll_begin(self, "barrier(async_op=False)", nargs, 0, 1, kwnames, "barrier");
    int async_op = st ? mpidp_py_async_arg(args, nargs, 0) : -1;
    if (async_op < 0) return NULL;
    mpidp_coll_t *x = NULL;
    mpidp_error_clear();
    int rc = mpidp_barrier_start(((mpidp_py_comm_t *)self)->comm, st->reqs, &x);
    return mpidp_py_started(st, rc, &mpidp_coll_operation, x, NULL, 0, async_op, self, Py_None, "barrier");
}

/* agree(fields, timeout_s=None) -> bool (mpidp/agree.h): every rank passed
 * the same tuple of ints. timeout_s: a deadline shorter than MPIDP_TIMEOUT
 * (a torch.distributed group's own). */
PyObject *mpidp_py_comm_agree(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    mpidp_py_state *st = mpidp_py_coll_begin(self, "agree(fields, timeout_s=None)", nargs, 1, 2,
                                             kwnames, "agree");
    if (st == NULL) return NULL;
    double timeout_s = mpidp_py_timeout_s;
    if (nargs > 1 && args[1] != Py_None) {
        double t = PyFloat_AsDouble(args[1]);
        if (t == -1.0 && PyErr_Occurred()) return NULL;
        if (!(t > 0)) return PyErr_Format(PyExc_ValueError, "timeout_s: expected > 0, got %g", t);
        if (t < timeout_s) timeout_s = t;
    }
    PyObject *fields = args[0];
    Py_ssize_t n = PyTuple_Check(fields) ? PyTuple_GET_SIZE(fields) : -1;
    if (n < 1 || n > MPIDP_AGREE_MAX_FIELDS)
        return PyErr_Format(PyExc_TypeError, "fields: expected a tuple of 1 to %d ints",
                            MPIDP_AGREE_MAX_FIELDS);
    int64_t sig[MPIDP_AGREE_MAX_FIELDS];
    for (Py_ssize_t i = 0; i < n; i++) {
        sig[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(fields, i));
        if (sig[i] == -1 && PyErr_Occurred()) return NULL;
    }
    int agreed = 0, rc;
    mpidp_error_clear();
    MPIDP_PY_WAIT(st, rc, mpidp_agree(((mpidp_py_comm_t *)self)->comm, sig, (size_t)n, st->reqs,
                                      timeout_s, &agreed));
    if (rc != MPIDP_OK) return mpidp_py_raise(st, rc, "agree");
    return PyBool_FromLong(agreed);
}

/* A tuple of at most MPIDP_PEERX_MAX_PEERS ranks into out[]; -1 with an exception. */
static int peers_arg(PyObject *obj, const char *argname, int *out)
{
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) > MPIDP_PEERX_MAX_PEERS) {
        PyErr_Format(PyExc_TypeError, "%s: expected a tuple of at most %d ranks", argname,
                     MPIDP_PEERX_MAX_PEERS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); i++) {
        long r = PyLong_AsLong(PyTuple_GET_ITEM(obj, i));
        if (r == -1 && PyErr_Occurred()) return -1;
        out[i] = r < INT_MIN ? INT_MIN : r > INT_MAX ? INT_MAX : (int)r; /* the core names it */
    }
    return (int)PyTuple_GET_SIZE(obj);
}

/* peer_exchange(send, out_peers, recvs, in_peers) -> Work: `send` to every
 * rank of out_peers and, from in_peers[i], into recvs[i] (host tensors, each
 * recv as many bytes as send). Every rank of the communicator calls it, in
 * the same order, peers or not. */
PyObject *mpidp_py_comm_peer_exchange(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                      PyObject *kwnames)
{
    mpidp_py_state *st = mpidp_py_coll_begin(self, "peer_exchange(send, out_peers, recvs, in_peers)", nargs, 4,
                               4, kwnames, "peer_exchange");
    if (st == NULL) return NULL;
    int out[MPIDP_PEERX_MAX_PEERS], in[MPIDP_PEERX_MAX_PEERS];
    int n_out = peers_arg(args[1], "out_peers", out);
    int n_in = n_out < 0 ? -1 : peers_arg(args[3], "in_peers", in);
    if (n_in < 0) return NULL;
    if (!PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != n_in)
        return PyErr_Format(PyExc_TypeError, "recvs: expected a tuple of %d tensors (one per "
                            "in-peer)", n_in);
    mpidp_py_borrowed_t t[1 + MPIDP_PEERX_MAX_PEERS];
    if (mpidp_py_borrow(st, args[0], ANY_CPU, "send", &t[0]) < 0) return NULL;
    if (mpidp_py_borrow_all(st, args[2], ANY_CPU | MPIDP_TENSOR_WRITABLE, -1, "recvs", t + 1) < 0) {
        mpidp_py_release(&t[0]);
        return NULL;
    }
    void *recv[MPIDP_PEERX_MAX_PEERS];
    size_t recv_bytes[MPIDP_PEERX_MAX_PEERS];
    for (int i = 0; i < n_in; i++) {
        recv[i] = t[1 + i].t.data;
        recv_bytes[i] = t[1 + i].t.numel * mpidp_dtype_size(t[1 + i].t.dtype);
    }
    mpidp_peerx_spec_t spec = {.out = out, .n_out = n_out, .in = in, .n_in = n_in,
                               .send = t[0].t.data, .recv = recv, .recv_bytes = recv_bytes,
                               .bytes = t[0].t.numel * mpidp_dtype_size(t[0].t.dtype),
                               .drain_timeout_s = mpidp_py_timeout_s, .what = "peer exchange"};
    mpidp_peerx_t *x = NULL;
    mpidp_error_clear();
    int rc = mpidp_peerx_start(((mpidp_py_comm_t *)self)->comm, &spec, st->reqs, &x);
    return mpidp_py_started(st, rc, &mpidp_peerx_operation, x, t, 1 + (size_t)n_in, 1, self, Py_None,
                   "peer_exchange");
}
