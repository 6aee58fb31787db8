/* Borrowing tensors through DLPack (see DESIGN.md, "Tensors in C").
 *
 * We ask the producer for a versioned capsule (DLPack >= 1.0 has a read-only
 * flag) and fall back to the legacy one. The capsule is *not* renamed to
 * "used_dltensor": holding it borrows the memory, and releasing it runs the
 * producer's deleter, so the tensor can never be freed while the core still
 * uses its pointer. */
#include "module.h"

#include <stdlib.h>
#include <string.h>

#include "mpidp/dlpack.h"
#include "mpidp/status.h"

/* The exception being raised, normalised, taken from the error indicator. */
static PyObject *take_exception(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

static PyObject *get_capsule(PyObject *obj, const char *argname)
{
    /* A capsule its caller made (torch._C._to_dlpack_versioned: the
     * torch.distributed backend's hot path skips Tensor.__dlpack__'s Python
     * checks for the host tensors it made itself). */
    if (PyCapsule_CheckExact(obj)) {
        Py_INCREF(obj);
        return obj;
    }
    PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
    if (method == NULL) {
        PyErr_Clear();
        return PyErr_Format(PyExc_TypeError,
                            "%s: expected a tensor (torch.Tensor, or any object with "
                            "__dlpack__), got %.100s", argname, Py_TYPE(obj)->tp_name);
    }
    PyObject *kwargs = Py_BuildValue("{s:(ii)}", "max_version", 1, 0);
    PyObject *empty = PyTuple_New(0);
    PyObject *capsule = (kwargs && empty) ? PyObject_Call(method, empty, kwargs) : NULL;
    Py_XDECREF(kwargs);
    Py_XDECREF(empty);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        /* An older producer without max_version. */
        PyErr_Clear();
        capsule = PyObject_CallNoArgs(method);
    }
    Py_DECREF(method);
    if (capsule == NULL) {
        /* Re-raise the producer's refusal naming the argument. A BufferError
         * (requires grad, conjugate bit, ...) means a tensor we cannot take as
         * it is: a bad argument, so ValueError. */
        PyObject *exc = take_exception();
        PyObject *type = exc == NULL ? PyExc_TypeError
                         : PyErr_GivenExceptionMatches(exc, PyExc_BufferError) ? PyExc_ValueError
                                                                              : (PyObject *)Py_TYPE(exc);
        PyErr_Format(type, "%s: cannot export the tensor through DLPack: %S", argname,
                     exc ? exc : Py_None);
        Py_XDECREF(exc);
    }
    return capsule;
}

int mpidp_py_borrow(mpidp_py_state *st, PyObject *obj, unsigned requirements,
                    const char *argname, mpidp_py_borrowed_t *out)
{
    out->capsule = NULL;
    PyObject *capsule = get_capsule(obj, argname);
    if (capsule == NULL) return -1;
    const mpidp_dl_tensor_t *dl = NULL;
    int read_only = 0;
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        mpidp_dl_managed_tensor_versioned_t *m = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (m->version.major != 1) {
            Py_DECREF(capsule);
            PyErr_Format(PyExc_TypeError, "%s: DLPack version %u.%u is not supported (need 1.x)",
                         argname, m->version.major, m->version.minor);
            return -1;
        }
        dl = &m->dl_tensor;
        read_only = (m->flags & MPIDP_DLPACK_FLAG_READ_ONLY) != 0;
    } else if (PyCapsule_IsValid(capsule, "dltensor")) {
        mpidp_dl_managed_tensor_t *m = PyCapsule_GetPointer(capsule, "dltensor");
        dl = &m->dl_tensor;
    } else {
        Py_DECREF(capsule);
        PyErr_Format(PyExc_TypeError, "%s: expected an unused DLPack capsule (from "
                     "__dlpack__ or passed as it is), got a used or foreign one", argname);
        return -1;
    }
    mpidp_error_clear();
    int rc = mpidp_tensor_from_dlpack(dl, read_only, requirements, &out->t);
    if (rc != MPIDP_OK) {
        Py_DECREF(capsule);
        char what[128];
        PyOS_snprintf(what, sizeof what, "%s", argname);
        mpidp_py_raise(st, rc, what);
        return -1;
    }
    out->capsule = capsule;
    return 0;
}

void mpidp_py_release(mpidp_py_borrowed_t *b)
{
    Py_CLEAR(b->capsule);
}

int mpidp_py_borrow_all(mpidp_py_state *st, PyObject *tuple, unsigned requirements, int dtype,
                        const char *what, mpidp_py_borrowed_t *out)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++) {
        char name[64];
        PyOS_snprintf(name, sizeof name, "%s[%zd]", what, i);
        int rc = mpidp_py_borrow(st, PyTuple_GET_ITEM(tuple, i), requirements, name, &out[i]);
        if (rc == 0 && dtype >= 0 && (int)out[i].t.dtype != dtype) {
            PyErr_Format(PyExc_TypeError, "%s: expected %s, got %s", name,
                         mpidp_dtype_name(dtype), mpidp_dtype_name(out[i].t.dtype));
            mpidp_py_release(&out[i]);
            rc = -1;
        }
        if (rc < 0) {
            mpidp_py_release_all(out, (size_t)i);
            return -1;
        }
    }
    return 0;
}

void mpidp_py_release_all(mpidp_py_borrowed_t *b, size_t n)
{
    for (size_t i = 0; b && i < n; i++) mpidp_py_release(&b[i]);
}

int mpidp_py_f32s_borrow(mpidp_py_state *st, PyObject *tuple, const char *what, mpidp_py_f32s_t *out)
{
    memset(out, 0, sizeof *out);
    if (!PyTuple_Check(tuple)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a tuple of tensors", what);
        return -1;
    }
    size_t n = (size_t)PyTuple_GET_SIZE(tuple), n1 = n ? n : 1;
    out->b = calloc(n1, sizeof *out->b);
    out->data = calloc(n1, sizeof *out->data);
    out->numel = calloc(n1, sizeof *out->numel);
    if (out->b == NULL || out->data == NULL || out->numel == NULL) {
        PyErr_NoMemory();
    } else if (mpidp_py_borrow_all(st, tuple, MPIDP_TENSOR_WRITABLE | MPIDP_TENSOR_CPU_ONLY,
                                   MPIDP_F32, what, out->b) == 0) {
        for (size_t i = 0; i < n; i++) out->data[i] = out->b[i].t.data, out->numel[i] = out->b[i].t.numel;
        out->n = n;
        out->tuple = Py_NewRef(tuple);
        return 0;
    }
    free(out->b);
    free(out->data);
    free(out->numel);
    memset(out, 0, sizeof *out);
    return -1;
}

void mpidp_py_f32s_release(mpidp_py_f32s_t *f)
{
    mpidp_py_release_all(f->b, f->n);
    free(f->b);
    free(f->data);
    free(f->numel);
    Py_CLEAR(f->tuple);
    memset(f, 0, sizeof *f);
}
