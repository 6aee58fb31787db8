/* Bucket layouts for Python: plan_buckets (Python allocates the bucket
 * tensors from its result, then hands them to Reducer(), whose core plans
 * again and checks them), and the reading of the parameters' sizes and dtypes
 * that both take. */
#include "reducer.h"

#include <stdlib.h>

void mpidp_py_sizes_free(mpidp_py_sizes_t *s)
{
    free(s->numel), free(s->dtype);
    *s = (mpidp_py_sizes_t){0};
}

int mpidp_py_sizes(PyObject *numel, PyObject *dtype, mpidp_py_sizes_t *s)
{
    *s = (mpidp_py_sizes_t){0};
    PyObject *nf = PySequence_Fast(numel, "param_numel: expected a sequence of ints");
    PyObject *df = nf ? PySequence_Fast(dtype, "param_dtype: expected a sequence of ints") : NULL;
    int rc = -1;
    if (df == NULL) goto done;
    s->n = (size_t)PySequence_Fast_GET_SIZE(nf);
    if ((size_t)PySequence_Fast_GET_SIZE(df) != s->n) {
        PyErr_SetString(PyExc_ValueError, "param_dtype: expected one dtype per parameter");
        goto done;
    }
    s->numel = malloc((s->n ? s->n : 1) * sizeof *s->numel);
    s->dtype = malloc((s->n ? s->n : 1) * sizeof *s->dtype);
    if (!s->numel || !s->dtype) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t i = 0; i < s->n; i++) {
        s->numel[i] = PyLong_AsSize_t(PySequence_Fast_GET_ITEM(nf, i));
        s->dtype[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(df, i));
        if (PyErr_Occurred()) goto done;
    }
    rc = 0;
done:
    Py_XDECREF(nf);
    Py_XDECREF(df);
    if (rc < 0) mpidp_py_sizes_free(s);
    return rc;
}

/* plan_buckets(numel, dtype, first_cap_bytes, cap_bytes)
 *   -> (bucket_of, offset, ((numel, n_params, dtype), ...)) */
static PyObject *mod_plan_buckets(PyObject *m, PyObject *args)
{
    PyObject *numel, *dtype, *result = NULL;
    unsigned long long first_cap, cap;
    mpidp_py_sizes_t s;
    if (!PyArg_ParseTuple(args, "OOKK:plan_buckets", &numel, &dtype, &first_cap, &cap) ||
        mpidp_py_sizes(numel, dtype, &s) < 0)
        return NULL;
    size_t n1 = s.n ? s.n : 1, nb = 0;
    uint32_t *bucket = malloc(n1 * sizeof *bucket);
    size_t *offset = malloc(n1 * sizeof *offset);
    mpidp_bucket_info_t *info = malloc(n1 * sizeof *info);
    if (!bucket || !offset || !info) PyErr_NoMemory();
    else if (MPIDP_PY_CALL(mpidp_py_state_of_module(m), "plan_buckets",
                           mpidp_bucket_plan(s.numel, s.dtype, s.n, (size_t)first_cap,
                                             (size_t)cap, bucket, offset, info, &nb)) == 0) {
        PyObject *b_of = PyTuple_New((Py_ssize_t)s.n), *off = PyTuple_New((Py_ssize_t)s.n);
        PyObject *infos = PyTuple_New((Py_ssize_t)nb);
        int ok = b_of && off && infos;
        for (size_t i = 0; ok && i < s.n; i++) {
            PyObject *b = PyLong_FromUnsignedLong(bucket[i]), *o = PyLong_FromSize_t(offset[i]);
            ok = b && o;
            PyTuple_SET_ITEM(b_of, (Py_ssize_t)i, b ? b : Py_NewRef(Py_None));
            PyTuple_SET_ITEM(off, (Py_ssize_t)i, o ? o : Py_NewRef(Py_None));
        }
        for (size_t b = 0; ok && b < nb; b++) {
            PyObject *t = Py_BuildValue("(nni)", (Py_ssize_t)info[b].numel,
                                        (Py_ssize_t)info[b].n_params, info[b].dtype);
            ok = t != NULL;
            PyTuple_SET_ITEM(infos, (Py_ssize_t)b, t ? t : Py_NewRef(Py_None));
        }
        if (ok) result = PyTuple_Pack(3, b_of, off, infos);
        Py_XDECREF(b_of), Py_XDECREF(off), Py_XDECREF(infos);
    }
    free(bucket), free(offset), free(info);
    mpidp_py_sizes_free(&s);
    return result;
}

PyMethodDef mpidp_py_bucket_plan_functions[] = {
    {"plan_buckets", mod_plan_buckets, METH_VARARGS,
     "plan_buckets(numel, dtype, first_cap_bytes, cap_bytes) -> (bucket_of, offset, infos)"},
    {NULL, NULL, 0, NULL},
};
