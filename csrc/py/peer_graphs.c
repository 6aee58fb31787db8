/* _C.graph_peers / _C.graph_book_len: the peer graphs (core/peer_graphs.c) for
 * Python. Pure functions of (graph, rank, iteration), so there is no type. */
#include "module.h"

#include "mpidp/peer_graphs.h"

static PyObject *ranks_tuple(const int *r, int n)
{
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) {
        PyObject *v = PyLong_FromLong(r[i]);
        if (v == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

/* graph_peers(kind, world, peers_per_itr, rank, iteration) -> (out_peers, in_peers) */
static PyObject *mod_graph_peers(PyObject *m, PyObject *args)
{
    mpidp_graph_t g;
    int rank;
    long long t;
    if (!PyArg_ParseTuple(args, "iiiiL:graph_peers", &g.kind, &g.world, &g.peers_per_itr, &rank, &t))
        return NULL;
    int out[MPIDP_GRAPH_MAX_PEERS], in[MPIDP_GRAPH_MAX_PEERS], n_out = 0, n_in = 0;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    if (MPIDP_PY_CALL(st, "peer graph", mpidp_graph_peers(&g, rank, t, out, &n_out, in, &n_in)) < 0)
        return NULL;
    PyObject *o = ranks_tuple(out, n_out), *i = o ? ranks_tuple(in, n_in) : NULL;
    PyObject *res = i ? PyTuple_Pack(2, o, i) : NULL;
    Py_XDECREF(o);
    Py_XDECREF(i);
    return res;
}

/* graph_book_len(kind, world, peers_per_itr) -> int (validates the graph) */
static PyObject *mod_graph_book_len(PyObject *m, PyObject *args)
{
    mpidp_graph_t g;
    if (!PyArg_ParseTuple(args, "iii:graph_book_len", &g.kind, &g.world, &g.peers_per_itr))
        return NULL;
    int len = 0;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    if (MPIDP_PY_CALL(st, "peer graph", mpidp_graph_book_len(&g, &len)) < 0) return NULL;
    return PyLong_FromLong(len);
}

PyMethodDef mpidp_py_peers_functions[] = {
    {"graph_peers", mod_graph_peers, METH_VARARGS,
     "graph_peers(kind, world, peers_per_itr, rank, iteration) -> (out_peers, in_peers)\n"
     "(mpidp/peer_graphs.h; kind: GRAPH_*)"},
    {"graph_book_len", mod_graph_book_len, METH_VARARGS,
     "graph_book_len(kind, world, peers_per_itr) -> the phone book's length (validates)"},
    {NULL, NULL, 0, NULL},
};
