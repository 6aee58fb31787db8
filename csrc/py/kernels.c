/* Module functions over the conversion kernels: which SIMD path runs, and
 * direct calls of any path's kernels on tensors (used by the tests, which
 * compare every path with the reference and with torch, and by the
 * benchmarks).
 *
 * pack / unpack / sum16 take CPU tensors (run by the chosen SIMD path, or the
 * one named by `path`) or CUDA tensors (run by the CUDA kernels of
 * mpidp/cuda.h, enqueued on a stream and not waited for). All tensors of one
 * call must be on one device: where each lives is read with is_cuda and
 * get_device() (torch) or __dlpack_device__() before anything is exported, so
 * mixing devices is a ValueError naming both arguments rather than whatever
 * the producer says.
 *
 * CUDA calls run with the tensors' device current (a torch.cuda.device guard
 * when torch's current device is another one: mpidp's kernels launch on the
 * calling thread's current device) and, unless `stream` is given, on torch's
 * current stream of that device, so they are ordered after the torch work that
 * produced the inputs, like any torch op. Large CPU calls release the GIL; CUDA
 * calls only enqueue work and keep it.
 *
 * Lifetime on CUDA: the tensors are borrowed only while the kernel is
 * enqueued. That is safe on the stream the tensors were allocated on (torch's
 * caching allocator reuses a freed block in that stream's order); on another
 * stream the caller keeps them alive until the stream has run the kernel, as
 * with any torch work on a side stream. */
#include "module.h"

#include <string.h>

#include "mpidp/cuda.h"
#include "mpidp/mpiops.h"
#include "mpidp/pack.h"
#include "mpidp/status.h"

/* Below this many elements releasing the GIL costs more than it frees. */
#define GIL_FREE_ELEMS (1 << 16)

/* DLPack device types (mpidp/dlpack.h), as __dlpack_device__() reports them. */
#define DL_CPU 1
#define DL_CUDA 2
#define DL_CUDA_HOST 3
#define DL_CUDA_MANAGED 13

#define HALF (1u << MPIDP_BF16 | 1u << MPIDP_F16)
#define F32 (1u << MPIDP_F32)

/* At most this many tensors take part in one call. */
#define MAX_TENSORS 3

/* Keeps the exception in flight across a call that may itself raise. */
typedef struct {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc;
#else
    PyObject *type, *value, *tb;
#endif
} saved_exc_t;

static void exc_save(saved_exc_t *s)
{
#if PY_VERSION_HEX >= 0x030C0000
    s->exc = PyErr_GetRaisedException();
#else
    PyErr_Fetch(&s->type, &s->value, &s->tb);
#endif
}

static int exc_pending(const saved_exc_t *s)
{
#if PY_VERSION_HEX >= 0x030C0000
    return s->exc != NULL;
#else
    return s->type != NULL;
#endif
}

static void exc_restore(saved_exc_t *s)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(s->exc);
#else
    PyErr_Restore(s->type, s->value, s->tb);
#endif
}

/* One call of pack / unpack / sum16: where its tensors live, the stream and
 * device guard of a CUDA call, and the borrowed tensors. */
typedef struct {
    PyObject *module;
    const char *fname;       /* "pack", "unpack", "sum16" */
    int cuda;                /* 0: host memory (CPU or pinned), 1: CUDA device memory */
    int device_id;           /* CUDA only */
    void *stream;            /* CUDA only: the cudaStream_t to launch on */
    PyObject *guard;         /* an entered torch.cuda.device, or NULL */
    const mpidp_pack_kernels_t *k; /* CPU only */
    mpidp_py_borrowed_t t[MAX_TENSORS];
    int n_borrowed;
} call_t;

static void describe(int cuda, int device_id, char *buf, size_t len)
{
    if (cuda) PyOS_snprintf(buf, len, "cuda:%d", device_id);
    else PyOS_snprintf(buf, len, "cpu");
}

/* Where `obj` lives: *known = 0 when that cannot be told before exporting it
 * (borrowing then reports what is wrong), or when it is a device mpidp does
 * not take. torch tensors answer through is_cuda / get_device(), C getters
 * that cost ~0.1 us; anything else through __dlpack_device__() (~3 us for a
 * torch tensor, whose implementation is Python). */
static int peek_device(PyObject *obj, const char *name, int *known, int *cuda, int *device_id)
{
    *known = 0;
    PyObject *is_cuda = PyObject_GetAttrString(obj, "is_cuda");
    if (is_cuda != NULL && PyBool_Check(is_cuda)) {
        int on_cuda = is_cuda == Py_True;
        Py_DECREF(is_cuda);
        long id = 0;
        if (on_cuda) {
            PyObject *d = PyObject_CallMethod(obj, "get_device", NULL);
            id = d ? PyLong_AsLong(d) : -1;
            Py_XDECREF(d);
            if (id == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
        }
        *known = 1;
        *cuda = on_cuda;
        *device_id = (int)id;
        return 0;
    }
    Py_XDECREF(is_cuda);
    PyErr_Clear();
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack_device__");
    if (meth == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *r = PyObject_CallNoArgs(meth);
    Py_DECREF(meth);
    if (r == NULL) return -1;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
        PyErr_Format(PyExc_TypeError, "%s: __dlpack_device__() returned %R, expected a tuple "
                     "(device_type, device_id)", name, r);
        Py_DECREF(r);
        return -1;
    }
    long type = PyLong_AsLong(PyTuple_GET_ITEM(r, 0));
    long id = type == -1 && PyErr_Occurred() ? -1 : PyLong_AsLong(PyTuple_GET_ITEM(r, 1));
    Py_DECREF(r);
    if (PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s: __dlpack_device__() did not return two ints", name);
        return -1;
    }
    if (type == DL_CPU || type == DL_CUDA_HOST) {
        *known = 1;
        *cuda = 0;
        *device_id = 0;
    } else if (type == DL_CUDA || type == DL_CUDA_MANAGED) {
        *known = 1;
        *cuda = 1;
        *device_id = (int)id;
    }
    return 0;
}

/* Makes the call's CUDA device current (through torch, whose current device is
 * the CUDA runtime's) and picks the stream: `stream_obj` when given, else
 * torch's current stream of that device. Without a usable torch.cuda (another
 * producer's arrays on a CPU-only torch), nothing is switched and the default
 * is the legacy default stream. */
static int cuda_setup(call_t *c, PyObject *stream_obj)
{
    if (stream_obj != Py_None) {
        if (!PyLong_Check(stream_obj) || PyBool_Check(stream_obj)) {
            PyErr_Format(PyExc_TypeError, "stream: expected an int (a cudaStream_t, e.g. "
                         "torch.cuda.current_stream().cuda_stream) or None, got %.100s",
                         Py_TYPE(stream_obj)->tp_name);
            return -1;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(stream_obj, &overflow);
        if (v == -1 && overflow == 0 && PyErr_Occurred()) return -1;
        if (overflow < 0 || (overflow == 0 && v < 0)) {
            PyErr_Format(PyExc_ValueError, "stream: expected a cudaStream_t handle (>= 0; 0 is "
                         "the legacy default stream), got %R", stream_obj);
            return -1;
        }
        c->stream = PyLong_AsVoidPtr(stream_obj);
        if (c->stream == NULL && PyErr_Occurred()) return -1;
    } else {
        c->stream = NULL;
    }
    PyObject *tc = PyImport_ImportModule("torch.cuda");
    if (tc == NULL) {
        /* No torch: the caller's producer (CuPy, ...) owns the device state. */
        PyErr_Clear();
        return 0;
    }
    int rc = -1;
    PyObject *avail = PyObject_CallMethod(tc, "is_available", NULL);
    int ok = avail ? PyObject_IsTrue(avail) : -1;
    Py_XDECREF(avail);
    if (ok < 0) goto done;
    if (!ok) {
        rc = 0;
        goto done;
    }
    PyObject *cur = PyObject_CallMethod(tc, "current_device", NULL);
    long cur_id = cur ? PyLong_AsLong(cur) : -1;
    Py_XDECREF(cur);
    if (cur_id == -1 && PyErr_Occurred()) goto done;
    if (cur_id != c->device_id) {
        PyObject *guard = PyObject_CallMethod(tc, "device", "i", c->device_id);
        PyObject *entered = guard ? PyObject_CallMethod(guard, "__enter__", NULL) : NULL;
        if (entered == NULL) {
            Py_XDECREF(guard);
            goto done;
        }
        Py_DECREF(entered);
        c->guard = guard;
    }
    if (stream_obj == Py_None) {
        PyObject *s = PyObject_CallMethod(tc, "current_stream", "i", c->device_id);
        PyObject *h = s ? PyObject_GetAttrString(s, "cuda_stream") : NULL;
        Py_XDECREF(s);
        if (h == NULL) goto done;
        c->stream = PyLong_AsVoidPtr(h);
        Py_DECREF(h);
        if (c->stream == NULL && PyErr_Occurred()) goto done;
    }
    rc = 0;
done:
    Py_DECREF(tc);
    return rc;
}

/* Decides where the call runs. objs/names: the tensor arguments (NULL or None
 * entries are skipped). Checks that every tensor is on the first one's device,
 * that `path` is only given for CPU tensors and `stream` only for CUDA ones. */
static int call_begin(call_t *c, PyObject *m, const char *fname, PyObject *const objs[],
                      const char *const names[], int n, PyObject *stream_obj, PyObject *path)
{
    memset(c, 0, sizeof *c);
    c->module = m;
    c->fname = fname;
    int have = 0;
    const char *first = NULL;
    for (int i = 0; i < n; i++) {
        if (objs[i] == NULL || objs[i] == Py_None) continue;
        int known, cuda, id;
        if (peek_device(objs[i], names[i], &known, &cuda, &id) < 0) return -1;
        if (!known) continue;
        if (!have) {
            have = 1;
            first = names[i];
            c->cuda = cuda;
            c->device_id = id;
        } else if (cuda != c->cuda || (cuda && id != c->device_id)) {
            char a[32], b[32];
            describe(c->cuda, c->device_id, a, sizeof a);
            describe(cuda, id, b, sizeof b);
            PyErr_Format(PyExc_ValueError, "%s: %s is on %s but %s is on %s; all tensors of "
                         "one call must be on one device", fname, first, a, names[i], b);
            return -1;
        }
    }
    if (path != Py_None && !PyUnicode_Check(path)) {
        PyErr_Format(PyExc_TypeError, "path: expected a str (one of mpidp._C.simd_paths()) or "
                     "None, got %.100s", Py_TYPE(path)->tp_name);
        return -1;
    }
    if (c->cuda) {
        if (path != Py_None) {
            PyErr_Format(PyExc_ValueError, "path: selects a CPU kernel path, but the tensors "
                         "are on cuda:%d (CUDA tensors always run the CUDA kernels); pass "
                         "path=None", c->device_id);
            return -1;
        }
        return cuda_setup(c, stream_obj);
    }
    if (stream_obj != Py_None) {
        PyErr_SetString(PyExc_ValueError, "stream: only CUDA tensors run on a stream, and "
                        "these tensors are in host memory; pass stream=None");
        return -1;
    }
    if (path == Py_None) {
        c->k = mpidp_pack_kernels();
        return 0;
    }
    const char *name = PyUnicode_AsUTF8(path);
    if (name == NULL) return -1;
    mpidp_error_clear();
    if (mpidp_pack_kernels_for(name, &c->k) != MPIDP_OK) {
        PyErr_Format(PyExc_ValueError, "path: %s", mpidp_error_detail());
        return -1;
    }
    return 0;
}

/* Borrows `obj` (writable if asked) as one of `dtypes` (bit mask of 1 << dtype)
 * on the call's device. Returns the borrowed tensor, or NULL with an exception
 * naming `name` (a producer's refusal to export is a ValueError: see dlpack.c). */
static mpidp_py_borrowed_t *call_borrow(call_t *c, PyObject *obj, unsigned dtypes, int writable,
                                        const char *name)
{
    mpidp_py_state *st = mpidp_py_state_of_module(c->module);
    mpidp_py_borrowed_t *b = &c->t[c->n_borrowed];
    unsigned need = (writable ? MPIDP_TENSOR_WRITABLE : 0u) | (c->cuda ? 0u : MPIDP_TENSOR_CPU_ONLY);
    if (mpidp_py_borrow(st, obj, need, name, b) < 0) return NULL;
    c->n_borrowed++;
    if (c->cuda != (b->t.device == MPIDP_DEV_CUDA) || (c->cuda && b->t.device_id != c->device_id)) {
        /* The object had no __dlpack_device__ (or it disagreed with the capsule). */
        char a[32], d[32];
        describe(c->cuda, c->device_id, a, sizeof a);
        describe(b->t.device == MPIDP_DEV_CUDA, b->t.device_id, d, sizeof d);
        PyErr_Format(PyExc_ValueError, "%s: %s is on %s, the call's other tensors on %s; all "
                     "tensors of one call must be on one device", c->fname, name, d, a);
        return NULL;
    }
    if (!(dtypes & (1u << b->t.dtype))) {
        PyErr_Format(PyExc_TypeError, "%s: unexpected dtype %s", name,
                     mpidp_dtype_name(b->t.dtype));
        return NULL;
    }
    return b;
}

/* Releases the tensors and leaves the device guard. Returns `result`, or NULL
 * (result dropped) when leaving the guard raised and nothing else had. */
static PyObject *call_end(call_t *c, PyObject *result)
{
    for (int i = 0; i < c->n_borrowed; i++) mpidp_py_release(&c->t[i]);
    c->n_borrowed = 0;
    if (c->guard != NULL) {
        saved_exc_t e;
        exc_save(&e);
        PyObject *r = PyObject_CallMethod(c->guard, "__exit__", "OOO", Py_None, Py_None, Py_None);
        Py_CLEAR(c->guard);
        if (r != NULL) {
            Py_DECREF(r);
            exc_restore(&e);
        } else if (exc_pending(&e)) {
            PyErr_Clear(); /* the original error is the one to report */
            exc_restore(&e);
        } else {
            Py_CLEAR(result);
        }
    }
    return result;
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

/* A float argument, with an error that names it (PyArg's "f" does not). */
static int float_arg(PyObject *obj, const char *name, float *out)
{
    if (obj == NULL) return 0;
    double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s: expected a real number, got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = (float)v;
    return 0;
}

/* Reports a failed CUDA launch (or "built without CUDA") as an exception. */
static int cuda_check(call_t *c, int rc)
{
    if (rc == MPIDP_OK) return 0;
    mpidp_py_raise(mpidp_py_state_of_module(c->module), rc, c->fname);
    return -1;
}

/* pack(dst, src, ref=None, scale=1.0, path=None, stream=None):
 *   dst (bf16/fp16) = cast(scale * (src - ref)) */
static PyObject *mod_pack(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"dst", "src", "ref", "scale", "path", "stream", NULL};
    PyObject *dst_o, *src_o, *ref_o = Py_None, *scale_o = NULL, *path = Py_None,
             *stream_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OOOO:pack", kwlist, &dst_o, &src_o, &ref_o,
                                     &scale_o, &path, &stream_o))
        return NULL;
    float scale = 1.0f;
    if (float_arg(scale_o, "scale", &scale) < 0) return NULL;
    PyObject *objs[] = {dst_o, src_o, ref_o};
    static const char *const names[] = {"dst", "src", "ref"};
    call_t c;
    PyObject *result = NULL;
    mpidp_py_borrowed_t *dst = NULL, *src = NULL, *ref = NULL;
    if (call_begin(&c, m, "pack", objs, names, 3, stream_o, path) < 0) goto done;
    if ((dst = call_borrow(&c, dst_o, HALF, 1, "dst")) == NULL ||
        (src = call_borrow(&c, src_o, F32, 0, "src")) == NULL ||
        (ref_o != Py_None && (ref = call_borrow(&c, ref_o, F32, 0, "ref")) == NULL) ||
        same_numel(dst, src, "pack") < 0 || (ref && same_numel(dst, ref, "pack") < 0))
        goto done;
    const float *r = ref ? ref->t.data : NULL;
    size_t n = dst->t.numel;
    int bf16 = dst->t.dtype == MPIDP_BF16;
    if (c.cuda) {
        mpidp_error_clear();
        int rc = bf16 ? mpidp_cuda_pack_bf16(dst->t.data, src->t.data, r, scale, n, c.stream)
                      : mpidp_cuda_pack_fp16(dst->t.data, src->t.data, r, scale, n, c.stream);
        if (cuda_check(&c, rc) < 0) goto done;
    } else {
        void (*fn)(uint16_t *, const float *, const float *, float, size_t) =
            bf16 ? c.k->pack_bf16 : c.k->pack_fp16;
        if (n >= GIL_FREE_ELEMS) {
            Py_BEGIN_ALLOW_THREADS fn(dst->t.data, src->t.data, r, scale, n);
            Py_END_ALLOW_THREADS
        } else {
            fn(dst->t.data, src->t.data, r, scale, n);
        }
    }
    result = Py_NewRef(Py_None);
done:
    return call_end(&c, result);
}

/* unpack(dst, src, ref=None, a=0, b=1, c=0, path=None, stream=None):
 *   dst (fp32) = a*dst + b*widen(src) + c*ref */
static PyObject *mod_unpack(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"dst", "src", "ref", "a", "b", "c", "path", "stream", NULL};
    PyObject *dst_o, *src_o, *ref_o = Py_None, *a_o = NULL, *b_o = NULL, *c_o = NULL,
             *path = Py_None, *stream_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OOOOOO:unpack", kwlist, &dst_o, &src_o,
                                     &ref_o, &a_o, &b_o, &c_o, &path, &stream_o))
        return NULL;
    float a = 0.0f, b = 1.0f, cc = 0.0f;
    if (float_arg(a_o, "a", &a) < 0 || float_arg(b_o, "b", &b) < 0 || float_arg(c_o, "c", &cc) < 0)
        return NULL;
    PyObject *objs[] = {dst_o, src_o, ref_o};
    static const char *const names[] = {"dst", "src", "ref"};
    call_t c;
    PyObject *result = NULL;
    mpidp_py_borrowed_t *dst = NULL, *src = NULL, *ref = NULL;
    if (call_begin(&c, m, "unpack", objs, names, 3, stream_o, path) < 0) goto done;
    if ((dst = call_borrow(&c, dst_o, F32, 1, "dst")) == NULL ||
        (src = call_borrow(&c, src_o, HALF | F32, 0, "src")) == NULL ||
        (ref_o != Py_None && (ref = call_borrow(&c, ref_o, F32, 0, "ref")) == NULL) ||
        same_numel(dst, src, "unpack") < 0 || (ref && same_numel(dst, ref, "unpack") < 0))
        goto done;
    const float *r = ref ? ref->t.data : NULL;
    size_t n = dst->t.numel;
    mpidp_dtype_t sd = src->t.dtype;
    if (c.cuda) {
        mpidp_error_clear();
        int rc = sd == MPIDP_F32    ? mpidp_cuda_merge_f32(dst->t.data, src->t.data, r, a, b, cc, n, c.stream)
                 : sd == MPIDP_BF16 ? mpidp_cuda_unpack_bf16(dst->t.data, src->t.data, r, a, b, cc, n, c.stream)
                                    : mpidp_cuda_unpack_fp16(dst->t.data, src->t.data, r, a, b, cc, n, c.stream);
        if (cuda_check(&c, rc) < 0) goto done;
    } else {
        const mpidp_pack_kernels_t *k = c.k;
        Py_BEGIN_ALLOW_THREADS
        if (sd == MPIDP_F32) k->merge_f32(dst->t.data, src->t.data, r, a, b, cc, n);
        else if (sd == MPIDP_BF16) k->unpack_bf16(dst->t.data, src->t.data, r, a, b, cc, n);
        else k->unpack_fp16(dst->t.data, src->t.data, r, a, b, cc, n);
        Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(Py_None);
done:
    return call_end(&c, result);
}

/* sum16(inout, src, path=None, stream=None): inout = half(widen(inout) + widen(src)) */
static PyObject *mod_sum16(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"inout", "src", "path", "stream", NULL};
    PyObject *io_o, *src_o, *path = Py_None, *stream_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OO:sum16", kwlist, &io_o, &src_o, &path,
                                     &stream_o))
        return NULL;
    PyObject *objs[] = {io_o, src_o};
    static const char *const names[] = {"inout", "src"};
    call_t c;
    PyObject *result = NULL;
    mpidp_py_borrowed_t *io = NULL, *src = NULL;
    if (call_begin(&c, m, "sum16", objs, names, 2, stream_o, path) < 0) goto done;
    if ((io = call_borrow(&c, io_o, HALF, 1, "inout")) == NULL ||
        (src = call_borrow(&c, src_o, HALF, 0, "src")) == NULL || same_numel(io, src, "sum16") < 0)
        goto done;
    if (io->t.dtype != src->t.dtype) {
        PyErr_Format(PyExc_TypeError, "sum16: inout and src must have the same dtype (got %s "
                     "and %s)", mpidp_dtype_name(io->t.dtype), mpidp_dtype_name(src->t.dtype));
        goto done;
    }
    size_t n = io->t.numel;
    int bf16 = io->t.dtype == MPIDP_BF16;
    if (c.cuda) {
        mpidp_error_clear();
        int rc = bf16 ? mpidp_cuda_sum_bf16(io->t.data, src->t.data, n, c.stream)
                      : mpidp_cuda_sum_fp16(io->t.data, src->t.data, n, c.stream);
        if (cuda_check(&c, rc) < 0) goto done;
    } else {
        const mpidp_pack_kernels_t *k = c.k;
        Py_BEGIN_ALLOW_THREADS
        if (bf16) k->sum_bf16(io->t.data, src->t.data, n);
        else k->sum_fp16(io->t.data, src->t.data, n);
        Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(Py_None);
done:
    return call_end(&c, result);
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
    {"pack", (PyCFunction)(void (*)(void))mod_pack, METH_VARARGS | METH_KEYWORDS,
     "pack(dst, src, ref=None, scale=1.0, path=None, stream=None):\n"
     "dst = bf16/fp16(scale * (src - ref)).\n\n"
     "CPU tensors run the chosen SIMD path (or `path`); CUDA tensors run the CUDA kernels on\n"
     "`stream` (an int cudaStream_t; None: torch's current stream of the tensors' device),\n"
     "without waiting. All tensors must be on one device and contiguous. On a stream other\n"
     "than the one the tensors were allocated on, keep them alive until that stream has run\n"
     "the kernel (or tensor.record_stream(s)), as for any torch work on a side stream."},
    {"unpack", (PyCFunction)(void (*)(void))mod_unpack, METH_VARARGS | METH_KEYWORDS,
     "unpack(dst, src, ref=None, a=0, b=1, c=0, path=None, stream=None):\n"
     "dst = a*dst + b*widen(src) + c*ref, in that fp32 order (dst not read when a == 0).\n"
     "src is bf16, fp16 or fp32. Devices and `stream` as in pack()."},
    {"sum16", (PyCFunction)(void (*)(void))mod_sum16, METH_VARARGS | METH_KEYWORDS,
     "sum16(inout, src, path=None, stream=None): the native MPI op's elementwise half sum,\n"
     "inout = half(widen(inout) + widen(src)). Devices and `stream` as in pack()."},
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
