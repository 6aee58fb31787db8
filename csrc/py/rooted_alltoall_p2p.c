/* Comm's rooted collectives (reduce, gatherv, scatterv), all-to-all and
 * point-to-point send / recv: argument parsing and DLPack intake, posting
 * through the core (mpidp/collectives.h). The torch.distributed backend
 * (python/mpidp/c10d/) is their main caller. */
#include "module.h"

#include <limits.h>

#include "mpidp/collectives.h"

/* Host tensors of any dtype the core knows. */
#define ANY_CPU (MPIDP_TENSOR_CPU_ONLY | MPIDP_TENSOR_ANY_DTYPE)

/* An int argument, or -1 with an exception (*ok = 0). */
static int int_arg(PyObject *obj, int *ok)
{
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred()) *ok = 0;
    return v < INT_MIN ? INT_MIN : v > INT_MAX ? INT_MAX : (int)v;
}

/* reduce(tensor, op, root, async_op=False): root's tensor becomes the
 * reduction of every rank's (in place); the others' are only read. */
PyObject *mpidp_py_comm_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    mpidp_py_state *st = mpidp_py_coll_begin(self, "reduce(tensor, op, root, async_op=False)",
                                             nargs, 3, 4, kwnames, "reduce");
    if (st == NULL) return NULL;
    mpidp_py_comm_t *comm = (mpidp_py_comm_t *)self;
    int ok = 1, op = int_arg(args[1], &ok), root = int_arg(args[2], &ok);
    int async_op = ok ? mpidp_py_async_arg(args, nargs, 3) : -1;
    if (async_op < 0) return NULL;
    mpidp_py_borrowed_t t;
    unsigned need = ANY_CPU | (comm->rank == root ? MPIDP_TENSOR_WRITABLE : 0u);
    if (mpidp_py_borrow(st, args[0], need, "tensor", &t) < 0) return NULL;
    mpidp_coll_t *x = NULL;
    mpidp_error_clear();
    int rc = mpidp_reduce_start(comm->comm, &t.t, op, root, st->reqs, &x);
    return mpidp_py_started(st, rc, &mpidp_coll_operation, x, &t, 1, async_op, self, args[0],
                            "reduce");
}

/* gatherv(send, recv, counts, root, async_op=False) and
 * scatterv(send, recv, counts, root, async_op=False): `whole` names the
 * argument only the root passes (recv of a gather, send of a scatter; None
 * elsewhere). A Work's result() is recv. */
static PyObject *rooted_v(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames, int scatter)
{
    const char *name = scatter ? "scatterv" : "gatherv";
    mpidp_py_state *st = mpidp_py_coll_begin(
        self, scatter ? "scatterv(send, recv, counts, root, async_op=False)"
                      : "gatherv(send, recv, counts, root, async_op=False)",
        nargs, 4, 5, kwnames, name);
    if (st == NULL) return NULL;
    mpidp_py_comm_t *comm = (mpidp_py_comm_t *)self;
    int ok = 1, root = int_arg(args[3], &ok);
    int async_op = ok ? mpidp_py_async_arg(args, nargs, 4) : -1;
    if (async_op < 0) return NULL;
    int at_root = comm->rank == root, whole = scatter ? 0 : 1;
    if (!at_root && args[whole] != Py_None)
        return PyErr_Format(PyExc_ValueError, "%s: only the root (rank %d) passes %s; pass None",
                            name, root, scatter ? "send" : "recv");
    size_t *counts = mpidp_py_counts_arg(args[2], comm->size);
    if (counts == NULL) return NULL;
    mpidp_py_borrowed_t t[2];
    size_t n = 0;
    PyObject *res = NULL;
    for (int i = 0; i < 2; i++) {
        if (i == whole && !at_root) continue;
        unsigned need = ANY_CPU | (i == 1 ? MPIDP_TENSOR_WRITABLE : 0u);
        if (mpidp_py_borrow(st, args[i], need, i ? "recv" : "send", &t[n]) < 0) {
            mpidp_py_release_all(t, n);
            goto done;
        }
        n++;
    }
    /* t[] holds send then recv, without the one this rank does not pass. */
    const mpidp_tensor_t *send = NULL, *recv = NULL;
    if (scatter) send = at_root ? &t[0].t : NULL, recv = &t[n - 1].t;
    else send = &t[0].t, recv = at_root ? &t[1].t : NULL;
    mpidp_coll_t *x = NULL;
    mpidp_error_clear();
    int rc = scatter ? mpidp_scatterv_start(comm->comm, send, recv, counts, root, st->reqs, &x)
                     : mpidp_gatherv_start(comm->comm, send, recv, counts, root, st->reqs, &x);
    res = mpidp_py_started(st, rc, &mpidp_coll_operation, x, t, n, async_op, self, args[1], name);
done:
    PyMem_Free(counts);
    return res;
}

PyObject *mpidp_py_comm_gatherv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    return rooted_v(self, args, nargs, kwnames, 0);
}

PyObject *mpidp_py_comm_scatterv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    return rooted_v(self, args, nargs, kwnames, 1);
}

/* alltoallv(send, recv, send_counts, recv_counts, async_op=False). */
PyObject *mpidp_py_comm_alltoallv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    mpidp_py_state *st = mpidp_py_coll_begin(
        self, "alltoallv(send, recv, send_counts, recv_counts, async_op=False)", nargs, 4, 5,
        kwnames, "alltoallv");
    if (st == NULL) return NULL;
    mpidp_py_comm_t *comm = (mpidp_py_comm_t *)self;
    int async_op = mpidp_py_async_arg(args, nargs, 4);
    if (async_op < 0) return NULL;
    size_t *sc = mpidp_py_counts_arg(args[2], comm->size);
    size_t *rcs = sc ? mpidp_py_counts_arg(args[3], comm->size) : NULL;
    PyObject *res = NULL;
    mpidp_py_borrowed_t t[2];
    if (rcs == NULL) goto done;
    if (mpidp_py_borrow(st, args[0], ANY_CPU, "send", &t[0]) < 0) goto done;
    if (mpidp_py_borrow(st, args[1], ANY_CPU | MPIDP_TENSOR_WRITABLE, "recv", &t[1]) < 0) {
        mpidp_py_release(&t[0]);
        goto done;
    }
    mpidp_coll_t *x = NULL;
    mpidp_error_clear();
    int rc = mpidp_alltoallv_start(comm->comm, &t[0].t, &t[1].t, sc, rcs, st->reqs, &x);
    res = mpidp_py_started(st, rc, &mpidp_coll_operation, x, t, 2, async_op, self, args[1],
                           "alltoallv");
done:
    PyMem_Free(sc);
    PyMem_Free(rcs);
    return res;
}

/* send(tensor, peer, tag) -> Work. */
PyObject *mpidp_py_comm_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    mpidp_py_state *st = mpidp_py_coll_begin(self, "send(tensor, peer, tag)", nargs, 3, 3,
                                             kwnames, "send");
    if (st == NULL) return NULL;
    int ok = 1, peer = int_arg(args[1], &ok), tag = int_arg(args[2], &ok);
    if (!ok) return NULL;
    mpidp_py_borrowed_t t;
    if (mpidp_py_borrow(st, args[0], ANY_CPU, "tensor", &t) < 0) return NULL;
    mpidp_coll_t *x = NULL;
    mpidp_error_clear();
    int rc = mpidp_send_start(((mpidp_py_comm_t *)self)->comm, &t.t, peer, tag, st->reqs, &x);
    return mpidp_py_started(st, rc, &mpidp_coll_operation, x, &t, 1, 1, self, Py_None, "send");
}

/* recv(tensor, peer, tag, source) -> Work: peer -1 receives from any rank;
 * `source`, a one-element int32 tensor, holds the sender once complete. */
PyObject *mpidp_py_comm_recv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    mpidp_py_state *st = mpidp_py_coll_begin(self, "recv(tensor, peer, tag, source)", nargs, 4,
                                             4, kwnames, "recv");
    if (st == NULL) return NULL;
    int ok = 1, peer = int_arg(args[1], &ok), tag = int_arg(args[2], &ok);
    if (!ok) return NULL;
    mpidp_py_borrowed_t t[2];
    if (mpidp_py_borrow(st, args[0], ANY_CPU | MPIDP_TENSOR_WRITABLE, "tensor", &t[0]) < 0)
        return NULL;
    if (mpidp_py_borrow(st, args[3], ANY_CPU | MPIDP_TENSOR_WRITABLE, "source", &t[1]) < 0) {
        mpidp_py_release(&t[0]);
        return NULL;
    }
    if (t[1].t.dtype != MPIDP_I32 || t[1].t.numel != 1) {
        mpidp_py_release_all(t, 2);
        return PyErr_Format(PyExc_TypeError, "source: expected a one-element int32 tensor");
    }
    mpidp_coll_t *x = NULL;
    mpidp_error_clear();
    int rc = mpidp_recv_start(((mpidp_py_comm_t *)self)->comm, &t[0].t, peer, tag, t[1].t.data,
                              st->reqs, &x);
    return mpidp_py_started(st, rc, &mpidp_coll_operation, x, t, 2, 1, self, args[0], "recv");
}
