/* Module functions over the conversion kernels: one entry, convert(), that
 * borrows the tensors and hands them to the core's mpidp_convert (which checks
 * dtypes, sizes and devices and picks the SIMD or CUDA kernels), and the
 * queries of which SIMD path runs.
 *
 * Where a call runs is decided in Python (python/mpidp/kernels.py: device,
 * device guard, torch's current stream); this file only sees a stream handle,
 * or None for host tensors. */
#include "module.h"

#include "mpidp/convert.h"
#include "mpidp/cuda.h"
#include "mpidp/mpiops.h"
#include "mpidp/pack.h"
#include "mpidp/status.h"

/* Below this many elements releasing the GIL costs more than it frees. */
#define GIL_FREE_ELEMS (1 << 16)

/* convert(op, dst, src, ref, a, b, c, path, stream): all nine positional, as
 * mpidp.kernels passes them. ref: a tensor or None; a, b, c: floats; path: a
 * SIMD path's name or None (host only); stream: None for host tensors, else
 * an int cudaStream_t. */
static PyObject *mod_convert(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9)
        return PyErr_Format(PyExc_TypeError, "convert takes 9 positional arguments (%zd given)",
                            nargs);
    int op = PyLong_AsLong(args[0]);
    const char *fname = mpidp_convert_name(op);
    if (fname == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "convert: unknown op %R", args[0]);
        return NULL;
    }
    double coef[3];
    for (int k = 0; k < 3; k++)
        if ((coef[k] = PyFloat_AsDouble(args[4 + k])) == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *path = args[7], *stream_obj = args[8];
    int on_host = stream_obj == Py_None;
    void *stream = on_host ? NULL : PyLong_AsVoidPtr(stream_obj);
    if (stream == NULL && PyErr_Occurred()) return NULL;
    const mpidp_pack_kernels_t *host = NULL;
    mpidp_error_clear();
    if (path != Py_None) {
        const char *name = PyUnicode_AsUTF8(path);
        if (name == NULL) return NULL;
        if (mpidp_pack_kernels_for(name, &host) != MPIDP_OK)
            return PyErr_Format(PyExc_ValueError, "path: %s", mpidp_error_detail());
    }
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    static const char *const names[5][3] = {{"dst", "src", "ref"}, {"dst", "src", "ref"},
                                            {"inout", "src", "ref"}, {"dst", "src", "ref"},
                                            {"dst", "src", "ref"}};
    mpidp_py_borrowed_t t[3];
    int n_borrowed = 0, rc = MPIDP_OK;
    PyObject *result = NULL;
    for (int k = 0; k < 3 && args[1 + k] != Py_None; k++) {
        /* Any dtype: the core checks each operand's for the op, by name. */
        unsigned need = (k == 0 ? MPIDP_TENSOR_WRITABLE : 0u) | (on_host ? MPIDP_TENSOR_CPU_ONLY : 0u) |
                        MPIDP_TENSOR_ANY_DTYPE;
        if (mpidp_py_borrow(st, args[1 + k], need, names[op][k], &t[k]) < 0) goto done;
        n_borrowed++;
    }
    if (n_borrowed < 2) {
        PyErr_Format(PyExc_TypeError, "%s: %s: expected a tensor, got None", fname,
                     names[op][n_borrowed]);
        goto done;
    }
    const mpidp_tensor_t *ref = n_borrowed == 3 ? &t[2].t : NULL;
    if (t[0].t.numel >= GIL_FREE_ELEMS) {
        Py_BEGIN_ALLOW_THREADS
        rc = mpidp_convert(op, &t[0].t, &t[1].t, ref, (float)coef[0], (float)coef[1],
                           (float)coef[2], host, stream);
        Py_END_ALLOW_THREADS
    } else {
        rc = mpidp_convert(op, &t[0].t, &t[1].t, ref, (float)coef[0], (float)coef[1],
                           (float)coef[2], host, stream);
    }
    if (rc == MPIDP_OK) result = Py_NewRef(Py_None);
    else mpidp_py_raise(st, rc, fname);
done:
    while (n_borrowed > 0) mpidp_py_release(&t[--n_borrowed]);
    return result;
}

static PyObject *mod_simd_path(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    return PyUnicode_FromString(mpidp_pack_path());
}

static PyObject *mod_simd_fallback_reason(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    return PyUnicode_FromString(mpidp_pack_fallback_reason());
}

/* The paths this CPU can run, best last. */
static PyObject *mod_simd_paths(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    PyObject *out = PyList_New(0);
    const char *name;
    for (size_t i = 0; out && (name = mpidp_pack_path_name(i)) != NULL; i++) {
        const mpidp_pack_kernels_t *k;
        if (mpidp_pack_kernels_for(name, &k) != MPIDP_OK) continue;
        PyObject *s = PyUnicode_FromString(name);
        if (s == NULL || PyList_Append(out, s) < 0) Py_CLEAR(out);
        Py_XDECREF(s);
    }
    mpidp_error_clear();
    return out;
}

static PyObject *mod_cuda_available(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    return PyBool_FromLong(mpidp_cuda_available());
}

/* Fortran handles (MPI_Type_c2f / MPI_Op_c2f) of mpidp's bf16 and fp16 datatypes
 * and their sum op, for tools that drive them through mpi4py
 * (MPI.Datatype.f2py, MPI.Op.f2py; never Free() them): the benchmarks compare
 * the native op with a Python op under the same MPI algorithm. */
static PyObject *mod_mpi_half_handles(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    MPI_Datatype b = mpidp_mpi_bf16_type(), h = mpidp_mpi_fp16_type();
    MPI_Op op = mpidp_mpi_half_sum_op();
    if (b == MPI_DATATYPE_NULL || h == MPI_DATATYPE_NULL || op == MPI_OP_NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mpidp's MPI datatypes and op are not initialised");
        return NULL;
    }
    return Py_BuildValue("{s:i,s:i,s:i}", "bfloat16", (int)MPI_Type_c2f(b), "float16",
                         (int)MPI_Type_c2f(h), "sum", (int)MPI_Op_c2f(op));
}

PyMethodDef mpidp_py_kernel_methods[] = {
    {"convert", (PyCFunction)(void (*)(void))mod_convert, METH_FASTCALL,
     "convert(op, dst, src, ref, a, b, c, path, stream): one conversion kernel call (op one\n"
     "of the CONVERT_* codes); use mpidp.kernels, which decides\n"
     "the device and stream."},
    {"simd_path", mod_simd_path, METH_NOARGS, "The conversion kernels' SIMD path in use."},
    {"simd_paths", mod_simd_paths, METH_NOARGS, "The SIMD paths this CPU can run."},
    {"simd_fallback_reason", mod_simd_fallback_reason, METH_NOARGS,
     "Why a better path failed its start-up self-check (empty if none did)."},
    {"mpi_half_handles", mod_mpi_half_handles, METH_NOARGS,
     "Fortran handles of mpidp's MPI bf16/fp16 datatypes and half sum op, as a dict\n"
     "{'bfloat16', 'float16', 'sum'}: use with mpi4py's Datatype.f2py / Op.f2py, never Free()."},
    {"cuda_available", mod_cuda_available, METH_NOARGS,
     "True when mpidp was built with its CUDA kernels and a CUDA device is usable."},
    {NULL, NULL, 0, NULL},
};
