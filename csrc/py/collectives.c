/* Comm.allreduce / bcast / allgather / barrier: argument parsing, DLPack
 * intake (any dtype the core knows: which op suits which dtype is the core's
 * check), posting through the core, and waiting with the GIL released. */
#include "module.h"

#include <limits.h>

#include "mpidp/allreduce.h"
#include "mpidp/collectives.h"
#include "mpidp/peerx.h"

/* Host tensors of any dtype the core knows. */
#define ANY_CPU (MPIDP_TENSOR_CPU_ONLY | MPIDP_TENSOR_ANY_DTYPE)

/* Waits for a posted request (no Work needed): returns None or raises. */
static PyObject *wait_req(mpidp_py_state *st, mpidp_req_t req, mpidp_py_borrowed_t *tensor,
                          const char *what)
{
    int rc;
    MPIDP_PY_WAIT(st, rc, mpidp_reqtable_wait(st->reqs, req, mpidp_py_timeout_s));
    if (tensor) mpidp_py_release(tensor);
    if (rc != MPIDP_OK) return mpidp_py_raise(st, rc, what);
    Py_RETURN_NONE;
}

/* Runs a posted operation to its end (mpidp_operation_finish, GIL released);
 * its n tensors are released once the core freed it. None, or NULL. */
static PyObject *finish_now(mpidp_py_state *st, const mpidp_operation_t *ops, void *x,
                            mpidp_py_borrowed_t *t, size_t n, const char *what)
{
    int rc, ended = 0;
    MPIDP_PY_WAIT(st, rc, mpidp_operation_finish(ops, x, mpidp_py_timeout_s, &ended));
    if (ended) mpidp_py_release_all(t, n);
    if (rc != MPIDP_OK) return mpidp_py_raise(st, rc, what);
    return mpidp_py_none_or_null(mpidp_py_warn_fp16_overflow());
}

PyObject *mpidp_py_comm_allreduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    if (kwnames != NULL || nargs != 4)
        return PyErr_Format(PyExc_TypeError, "Comm.allreduce(tensor, op, wire_dtype, async_op) "
                            "takes 4 positional arguments");
    if (mpidp_py_check_not_forked("allreduce") < 0) return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(Py_TYPE(self));
    if (st == NULL) return NULL;
    mpidp_py_comm_t *comm = (mpidp_py_comm_t *)self;
    int op = PyLong_AsLong(args[1]);
    int wire = PyLong_AsLong(args[2]);
    int async_op = PyObject_IsTrue(args[3]);
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
    int rc = mpidp_allreduce_start(comm->comm, &tensor.t, &opts, st->reqs, &x);
    if (rc != MPIDP_OK) {
        mpidp_py_release(&tensor);
        return mpidp_py_raise(st, rc, "allreduce");
    }
    if (async_op) return mpidp_py_work_new(st, &mpidp_allreduce_operation, x, &tensor, 1, self);
    return finish_now(st, &mpidp_allreduce_operation, x, &tensor, 1, "allreduce");
}

PyObject *mpidp_py_comm_bcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    if (kwnames != NULL || nargs != 2)
        return PyErr_Format(PyExc_TypeError, "Comm.bcast(tensor, root) takes 2 positional arguments");
    if (mpidp_py_check_not_forked("bcast") < 0) return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(Py_TYPE(self));
    if (st == NULL) return NULL;
    mpidp_py_comm_t *comm = (mpidp_py_comm_t *)self;
    int root = PyLong_AsLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    unsigned need = ANY_CPU | (comm->rank == root ? 0u : MPIDP_TENSOR_WRITABLE);
    mpidp_py_borrowed_t tensor;
    if (mpidp_py_borrow(st, args[0], need, "tensor", &tensor) < 0) return NULL;
    mpidp_error_clear();
    mpidp_req_t req;
    int rc = mpidp_bcast_start(comm->comm, &tensor.t, root, st->reqs, &req);
    if (rc != MPIDP_OK) {
        mpidp_py_release(&tensor);
        return mpidp_py_raise(st, rc, "bcast");
    }
    return wait_req(st, req, &tensor, "bcast");
}

PyObject *mpidp_py_comm_allgather(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    if (kwnames != NULL || nargs != 2)
        return PyErr_Format(PyExc_TypeError, "Comm.allgather(tensor, out) takes 2 positional arguments");
    if (mpidp_py_check_not_forked("allgather") < 0) return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(Py_TYPE(self));
    if (st == NULL) return NULL;
    mpidp_py_borrowed_t t[2];
    if (mpidp_py_borrow(st, args[0], ANY_CPU, "tensor", &t[0]) < 0) return NULL;
    if (mpidp_py_borrow(st, args[1], ANY_CPU | MPIDP_TENSOR_WRITABLE, "out", &t[1]) < 0) {
        mpidp_py_release(&t[0]);
        return NULL;
    }
    mpidp_error_clear();
    mpidp_req_t req;
    int rc = mpidp_allgather_start(((mpidp_py_comm_t *)self)->comm, &t[0].t, &t[1].t, st->reqs, &req);
    PyObject *res = rc == MPIDP_OK ? wait_req(st, req, &t[1], "allgather")
                                   : (mpidp_py_release(&t[1]), mpidp_py_raise(st, rc, "allgather"));
    mpidp_py_release(&t[0]);
    return res;
}

/* The counts tuple of a vector collective: one int >= 0 per rank, or -1. */
static size_t *counts_arg(PyObject *obj, int size)
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

/* reduce_scatter(send, recv, counts, op) and allgatherv(send, recv, counts):
 * blocking; both tensors borrowed for the call. */
static PyObject *vector_collective(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                   int scatter)
{
    const char *name = scatter ? "reduce_scatter" : "allgatherv";
    if (nargs != (scatter ? 4 : 3))
        return PyErr_Format(PyExc_TypeError, "Comm.%s takes %d positional arguments", name,
                            scatter ? 4 : 3);
    if (mpidp_py_check_not_forked(name) < 0) return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(Py_TYPE(self));
    mpidp_py_comm_t *comm = (mpidp_py_comm_t *)self;
    int op = scatter ? (int)PyLong_AsLong(args[3]) : 0;
    size_t *counts = st && !PyErr_Occurred() ? counts_arg(args[2], comm->size) : NULL;
    if (counts == NULL) return NULL;
    mpidp_py_borrowed_t t[2];
    PyObject *res = NULL;
    if (mpidp_py_borrow(st, args[0], ANY_CPU, "tensor", &t[0]) < 0) goto done;
    if (mpidp_py_borrow(st, args[1], ANY_CPU | MPIDP_TENSOR_WRITABLE, "out", &t[1]) < 0) {
        mpidp_py_release(&t[0]);
        goto done;
    }
    mpidp_vcoll_t *x = NULL;
    mpidp_error_clear();
    int rc = scatter
                 ? mpidp_reduce_scatter_start(comm->comm, &t[0].t, &t[1].t, counts, op, st->reqs, &x)
                 : mpidp_allgatherv_start(comm->comm, &t[0].t, &t[1].t, counts, st->reqs, &x);
    if (rc == MPIDP_OK) {
        res = finish_now(st, &mpidp_vcoll_operation, x, t, 2, name);
    } else {
        mpidp_py_release_all(t, 2);
        res = mpidp_py_raise(st, rc, name);
    }
done:
    PyMem_Free(counts);
    return res;
}

PyObject *mpidp_py_comm_reduce_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwnames)
{
    if (kwnames != NULL) return PyErr_Format(PyExc_TypeError, "Comm.reduce_scatter takes no keywords");
    return vector_collective(self, args, nargs, 1);
}

PyObject *mpidp_py_comm_allgatherv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames)
{
    if (kwnames != NULL) return PyErr_Format(PyExc_TypeError, "Comm.allgatherv takes no keywords");
    return vector_collective(self, args, nargs, 0);
}

PyObject *mpidp_py_comm_barrier(PyObject *self, PyObject *unused)
{
    (void)unused;
    if (mpidp_py_check_not_forked("barrier") < 0) return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(Py_TYPE(self));
    if (st == NULL) return NULL;
    mpidp_error_clear();
    mpidp_req_t req;
    int rc = mpidp_barrier_start(((mpidp_py_comm_t *)self)->comm, st->reqs, &req);
    if (rc != MPIDP_OK) return mpidp_py_raise(st, rc, "barrier");
    return wait_req(st, req, NULL, "barrier");
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
    if (kwnames != NULL || nargs != 4)
        return PyErr_Format(PyExc_TypeError, "Comm.peer_exchange(send, out_peers, recvs, "
                            "in_peers) takes 4 positional arguments");
    if (mpidp_py_check_not_forked("peer_exchange") < 0) return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(Py_TYPE(self));
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
    if (rc != MPIDP_OK) {
        mpidp_py_release_all(t, 1 + (size_t)n_in);
        return mpidp_py_raise(st, rc, "peer_exchange");
    }
    return mpidp_py_work_new(st, &mpidp_peerx_operation, x, t, 1 + (size_t)n_in, self);
}
