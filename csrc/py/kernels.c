/* Module functions over the conversion kernels: which SIMD path runs, and
 * direct calls of any path's kernels on tensors (used by the tests, which
 * compare every path with the reference and with torch, and by the
 * benchmarks). Large calls release the GIL. */
#include "module.h"

#include "mpidp/pack.h"
#include "mpidp/status.h"

/* Below this many elements releasing the GIL costs more than it frees. */
#define GIL_FREE_ELEMS (1 << 16)

static int kernels_for(PyObject *path, const mpidp_pack_kernels_t **out)
{
    if (path == NULL || path == Py_None) {
        *out = mpidp_pack_kernels();
        return 0;
    }
    const char *name = PyUnicode_AsUTF8(path);
    if (name == NULL) return -1;
    mpidp_error_clear();
    if (mpidp_pack_kernels_for(name, out) != MPIDP_OK) {
        PyErr_Format(PyExc_ValueError, "path: %s", mpidp_error_detail());
        return -1;
    }
    return 0;
}

/* Borrows `obj` as a CPU tensor of one of `dtypes` (bit mask of 1 << dtype). */
static int borrow(PyObject *m, PyObject *obj, unsigned dtypes, int writable, const char *name,
                  mpidp_py_borrowed_t *out)
{
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    unsigned need = MPIDP_TENSOR_CPU_ONLY | (writable ? MPIDP_TENSOR_WRITABLE : 0u);
    if (mpidp_py_borrow(st, obj, need, name, out) < 0) return -1;
    if (!(dtypes & (1u << out->t.dtype))) {
        PyErr_Format(PyExc_TypeError, "%s: unexpected dtype %s", name,
                     mpidp_dtype_name(out->t.dtype));
        mpidp_py_release(out);
        return -1;
    }
    return 0;
}

static int same_numel(const mpidp_py_borrowed_t *a, const mpidp_py_borrowed_t *b, const char *what)
{
    if (a->t.numel != b->t.numel) {
        PyErr_Format(PyExc_ValueError, "%s: tensors differ in size (%zu vs %zu elements)", what,
                     a->t.numel, b->t.numel);
        return -1;
    }
    return 0;
}

#define HALF (1u << MPIDP_BF16 | 1u << MPIDP_F16)
#define F32 (1u << MPIDP_F32)

/* pack(dst, src, ref=None, scale=1.0, path=None): dst (bf16/fp16) = cast(scale * (src - ref)) */
static PyObject *mod_pack(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"dst", "src", "ref", "scale", "path", NULL};
    PyObject *dst_o, *src_o, *ref_o = Py_None, *path = Py_None;
    float scale = 1.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OfO:pack", kwlist, &dst_o, &src_o, &ref_o,
                                     &scale, &path))
        return NULL;
    const mpidp_pack_kernels_t *k;
    if (kernels_for(path, &k) < 0) return NULL;
    mpidp_py_borrowed_t dst = {0}, src = {0}, ref = {0};
    PyObject *result = NULL;
    if (borrow(m, dst_o, HALF, 1, "dst", &dst) < 0 || borrow(m, src_o, F32, 0, "src", &src) < 0 ||
        (ref_o != Py_None && borrow(m, ref_o, F32, 0, "ref", &ref) < 0) ||
        same_numel(&dst, &src, "pack") < 0 || (ref.capsule && same_numel(&dst, &ref, "pack") < 0))
        goto done;
    void (*fn)(uint16_t *, const float *, const float *, float, size_t) =
        dst.t.dtype == MPIDP_BF16 ? k->pack_bf16 : k->pack_fp16;
    if (dst.t.numel >= GIL_FREE_ELEMS) {
        Py_BEGIN_ALLOW_THREADS fn(dst.t.data, src.t.data, ref.capsule ? ref.t.data : NULL, scale,
                                  dst.t.numel);
        Py_END_ALLOW_THREADS
    } else {
        fn(dst.t.data, src.t.data, ref.capsule ? ref.t.data : NULL, scale, dst.t.numel);
    }
    result = Py_NewRef(Py_None);
done:
    mpidp_py_release(&dst);
    mpidp_py_release(&src);
    mpidp_py_release(&ref);
    return result;
}

/* unpack(dst, src, ref=None, a=0, b=1, c=0, path=None):
 *   dst (fp32) = a*dst + b*widen(src) + c*ref */
static PyObject *mod_unpack(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"dst", "src", "ref", "a", "b", "c", "path", NULL};
    PyObject *dst_o, *src_o, *ref_o = Py_None, *path = Py_None;
    float a = 0.0f, b = 1.0f, c = 0.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OfffO:unpack", kwlist, &dst_o, &src_o,
                                     &ref_o, &a, &b, &c, &path))
        return NULL;
    const mpidp_pack_kernels_t *k;
    if (kernels_for(path, &k) < 0) return NULL;
    mpidp_py_borrowed_t dst = {0}, src = {0}, ref = {0};
    PyObject *result = NULL;
    if (borrow(m, dst_o, F32, 1, "dst", &dst) < 0 ||
        borrow(m, src_o, HALF | F32, 0, "src", &src) < 0 ||
        (ref_o != Py_None && borrow(m, ref_o, F32, 0, "ref", &ref) < 0) ||
        same_numel(&dst, &src, "unpack") < 0 || (ref.capsule && same_numel(&dst, &ref, "unpack") < 0))
        goto done;
    const float *r = ref.capsule ? ref.t.data : NULL;
    size_t n = dst.t.numel;
    Py_BEGIN_ALLOW_THREADS
    if (src.t.dtype == MPIDP_F32) k->merge_f32(dst.t.data, src.t.data, r, a, b, c, n);
    else if (src.t.dtype == MPIDP_BF16) k->unpack_bf16(dst.t.data, src.t.data, r, a, b, c, n);
    else k->unpack_fp16(dst.t.data, src.t.data, r, a, b, c, n);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    mpidp_py_release(&dst);
    mpidp_py_release(&src);
    mpidp_py_release(&ref);
    return result;
}

/* sum16(inout, src, path=None): inout = half(widen(inout) + widen(src)) */
static PyObject *mod_sum16(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"inout", "src", "path", NULL};
    PyObject *io_o, *src_o, *path = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O:sum16", kwlist, &io_o, &src_o, &path))
        return NULL;
    const mpidp_pack_kernels_t *k;
    if (kernels_for(path, &k) < 0) return NULL;
    mpidp_py_borrowed_t io = {0}, src = {0};
    PyObject *result = NULL;
    if (borrow(m, io_o, HALF, 1, "inout", &io) < 0 || borrow(m, src_o, HALF, 0, "src", &src) < 0 ||
        same_numel(&io, &src, "sum16") < 0)
        goto done;
    if (io.t.dtype != src.t.dtype) {
        PyErr_SetString(PyExc_TypeError, "sum16: inout and src must have the same dtype");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (io.t.dtype == MPIDP_BF16) k->sum_bf16(io.t.data, src.t.data, io.t.numel);
    else k->sum_fp16(io.t.data, src.t.data, io.t.numel);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    mpidp_py_release(&io);
    mpidp_py_release(&src);
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
    static const char *names[] = {"ref", "avx2", "avx512", "avx512_bf16"};
    PyObject *out = PyList_New(0);
    for (size_t i = 0; out && i < sizeof names / sizeof names[0]; i++) {
        const mpidp_pack_kernels_t *k;
        if (mpidp_pack_kernels_for(names[i], &k) != MPIDP_OK) continue;
        PyObject *s = PyUnicode_FromString(names[i]);
        if (s == NULL || PyList_Append(out, s) < 0) Py_CLEAR(out);
        Py_XDECREF(s);
    }
    mpidp_error_clear();
    return out;
}

PyMethodDef mpidp_py_kernel_methods[] = {
    {"pack", (PyCFunction)(void (*)(void))mod_pack, METH_VARARGS | METH_KEYWORDS,
     "pack(dst, src, ref=None, scale=1.0, path=None): dst = bf16/fp16(scale * (src - ref))"},
    {"unpack", (PyCFunction)(void (*)(void))mod_unpack, METH_VARARGS | METH_KEYWORDS,
     "unpack(dst, src, ref=None, a=0, b=1, c=0, path=None): dst = a*dst + b*src + c*ref"},
    {"sum16", (PyCFunction)(void (*)(void))mod_sum16, METH_VARARGS | METH_KEYWORDS,
     "sum16(inout, src, path=None): the native MPI op's elementwise half sum"},
    {"simd_path", mod_simd_path, METH_NOARGS, "The conversion kernels' SIMD path in use."},
    {"simd_paths", mod_simd_paths, METH_NOARGS, "The SIMD paths this CPU can run."},
    {"simd_fallback_reason", mod_simd_fallback_reason, METH_NOARGS,
     "Why a better path failed its start-up self-check (empty if none did)."},
    {NULL, NULL, 0, NULL},
};
