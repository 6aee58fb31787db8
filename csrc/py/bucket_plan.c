/* Bucket layouts for the reducer: mpidp_bucket_plan over Python sequences,
 * shared by the module function plan_buckets (Python allocates the bucket
 * tensors from its result) and Reducer() (which plans again and checks the
 * tensors it is given against the plan). */
#include "reducer.h"

#include <stdlib.h>

void mpidp_py_plan_free(mpidp_py_plan_t *p)
{
    free(p->numel), free(p->offset), free(p->dtype), free(p->bucket_of), free(p->info);
}

int mpidp_py_plan(mpidp_py_state *st, const char *what, PyObject *numel, PyObject *dtype,
                  unsigned long long first_cap, unsigned long long cap, mpidp_py_plan_t *p)
{
    *p = (mpidp_py_plan_t){0};
    PyObject *nf = PySequence_Fast(numel, "param_numel: expected a sequence of ints");
    PyObject *df = nf ? PySequence_Fast(dtype, "param_dtype: expected a sequence of ints") : NULL;
    int rc = -1;
    if (df == NULL) goto done;
    p->n = (size_t)PySequence_Fast_GET_SIZE(nf);
    if ((size_t)PySequence_Fast_GET_SIZE(df) != p->n) {
        PyErr_SetString(PyExc_ValueError, "param_dtype: expected one dtype per parameter");
        goto done;
    }
    size_t n1 = p->n ? p->n : 1;
    p->numel = malloc(n1 * sizeof *p->numel), p->offset = malloc(n1 * sizeof *p->offset);
    p->dtype = malloc(n1 * sizeof *p->dtype), p->bucket_of = malloc(n1 * sizeof *p->bucket_of);
    p->info = malloc(n1 * sizeof *p->info);
    if (!p->numel || !p->offset || !p->dtype || !p->bucket_of || !p->info) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t i = 0; i < p->n; i++) {
        p->numel[i] = PyLong_AsSize_t(PySequence_Fast_GET_ITEM(nf, i));
        p->dtype[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(df, i));
        if (PyErr_Occurred()) goto done;
    }
    rc = MPIDP_PY_CALL(st, what, mpidp_bucket_plan(p->numel, p->dtype, p->n,
                       (size_t)first_cap, (size_t)cap, p->bucket_of, p->offset, p->info,
                       &p->n_buckets));
done:
    Py_XDECREF(nf);
    Py_XDECREF(df);
    if (rc < 0) mpidp_py_plan_free(p);
    return rc;
}

/* plan_buckets(numel, dtype, first_cap_bytes, cap_bytes)
 *   -> (bucket_of, offset, ((numel, n_params, dtype), ...)): the layout
 * Reducer() plans again and checks its bucket tensors against. */
static PyObject *mod_plan_buckets(PyObject *m, PyObject *args)
{
    PyObject *numel, *dtype, *result = NULL;
    unsigned long long first_cap, cap;
    mpidp_py_plan_t p;
    if (!PyArg_ParseTuple(args, "OOKK:plan_buckets", &numel, &dtype, &first_cap, &cap) ||
        mpidp_py_plan(mpidp_py_state_of_module(m), "plan_buckets", numel, dtype, first_cap, cap, &p) < 0)
        return NULL;
    PyObject *bucket_of = PyTuple_New((Py_ssize_t)p.n), *offset = PyTuple_New((Py_ssize_t)p.n);
    PyObject *info = PyTuple_New((Py_ssize_t)p.n_buckets);
    int ok = bucket_of && offset && info;
    for (size_t i = 0; ok && i < p.n; i++) {
        PyObject *b = PyLong_FromUnsignedLong(p.bucket_of[i]), *o = PyLong_FromSize_t(p.offset[i]);
        ok = b && o;
        PyTuple_SET_ITEM(bucket_of, (Py_ssize_t)i, b ? b : Py_NewRef(Py_None));
        PyTuple_SET_ITEM(offset, (Py_ssize_t)i, o ? o : Py_NewRef(Py_None));
    }
    for (size_t b = 0; ok && b < p.n_buckets; b++) {
        PyObject *t = Py_BuildValue("(nni)", (Py_ssize_t)p.info[b].numel,
                                    (Py_ssize_t)p.info[b].n_params, p.info[b].dtype);
        ok = t != NULL;
        PyTuple_SET_ITEM(info, (Py_ssize_t)b, t ? t : Py_NewRef(Py_None));
    }
    if (ok) result = PyTuple_Pack(3, bucket_of, offset, info);
    Py_XDECREF(bucket_of), Py_XDECREF(offset), Py_XDECREF(info);
    mpidp_py_plan_free(&p);
    return result;
}

PyMethodDef mpidp_py_bucket_plan_functions[] = {
    {"plan_buckets", mod_plan_buckets, METH_VARARGS,
     "plan_buckets(numel, dtype, first_cap_bytes, cap_bytes) -> (bucket_of, offset, infos)"},
    {NULL, NULL, 0, NULL},
};
