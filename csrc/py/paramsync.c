/* mpidp._C.ParamSync: DASO's global parameter average across nodes.
 *
 * Holds borrowed pointers to the model's trainable float32 parameters (CPU),
 * a reference copy `ref` of them that every rank shares (the parameters after
 * the last blocking sync), and a wire buffer. A sync:
 *   send()         packs every parameter's difference from the reference,
 *                  p - ref, into the wire buffer in one fused pass per tensor
 *                  (cast to bf16/fp16, or kept fp32), then posts the chunked
 *                  allreduce (native half sum op) with every chunk in flight;
 *   test()/wait()  progress / complete it;
 *   merge(a, b, c) p = a*p + b*sum_of_differences + c*ref, one fused pass per
 *                  tensor straight from the wire buffer.
 * Differences are small next to the parameters, so bf16 on the wire costs far
 * less accuracy than sending the parameters themselves; the merge is Heat's
 * staleness-weighted average rewritten on differences: with n senders and
 * weight w, (w*p + sum(ref + d_i)) / (n + w) = a*p + b*sum(d_i) + c*ref with
 * a = w/(n+w), b = 1/(n+w), c = n/(n+w).
 * flatten()/unflatten() copy the parameters to/from one flat tensor for the
 * node-local broadcast that follows a merge. */
#include "module.h"

#include <stdlib.h>
#include <string.h>

#include "mpidp/allreduce.h"
#include "mpidp/pack.h"
#include "mpidp/status.h"

enum { SYNC_IDLE = 0, SYNC_POSTED = 1 };

typedef struct {
    PyObject_HEAD
    mpidp_py_state *st;
    PyObject *module;
    PyObject *comm;
    PyObject *params;            /* tuple of the parameters, kept alive */
    mpidp_py_borrowed_t *p;      /* their DLPack views */
    size_t n_params;
    size_t *offset;              /* element offset of each parameter in the flat layout */
    size_t numel;                /* total elements */
    float *ref;                  /* numel */
    void *buf;                   /* numel wire elements */
    int wire;                    /* MPIDP_F32, MPIDP_BF16 or MPIDP_F16 */
    size_t chunk;
    mpidp_allreduce_t *x;
    int state;
} paramsync_t;

/* Large passes release the GIL; each is one sweep over the parameters. */
#define PASS_BEGIN(s) PyThreadState *_ts = (s)->numel >= (1u << 16) ? PyEval_SaveThread() : NULL
#define PASS_END() if (_ts) PyEval_RestoreThread(_ts)

static PyObject *paramsync_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"comm", "params", "wire_dtype", "chunk_elems", NULL};
    PyObject *comm, *params;
    int wire;
    Py_ssize_t chunk;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!in:ParamSync", kwlist, &comm, &PyTuple_Type,
                                     &params, &wire, &chunk))
        return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(type);
    if (st == NULL || mpidp_py_as_comm(st, comm, "comm") == NULL) return NULL;
    if (wire != MPIDP_F32 && wire != MPIDP_BF16 && wire != MPIDP_F16)
        return PyErr_Format(PyExc_ValueError, "wire_dtype: expected float32, bfloat16 or float16");
    if (chunk < 1 || chunk > 0x7fffffff)
        return PyErr_Format(PyExc_ValueError, "chunk_elems: expected 1 .. 2^31-1, got %zd", chunk);
    paramsync_t *s = (paramsync_t *)type->tp_alloc(type, 0);
    if (s == NULL) return NULL;
    s->st = st;
    s->module = Py_NewRef(PyType_GetModule(type));
    s->comm = Py_NewRef(comm);
    s->params = Py_NewRef(params);
    s->wire = wire;
    s->chunk = (size_t)chunk;
    s->n_params = (size_t)PyTuple_GET_SIZE(params);
    s->p = calloc(s->n_params ? s->n_params : 1, sizeof *s->p);
    s->offset = calloc(s->n_params ? s->n_params : 1, sizeof *s->offset);
    if (s->p == NULL || s->offset == NULL) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < s->n_params; i++) {
        char name[48];
        PyOS_snprintf(name, sizeof name, "params[%zu]", i);
        if (mpidp_py_borrow(st, PyTuple_GET_ITEM(params, i),
                            MPIDP_TENSOR_WRITABLE | MPIDP_TENSOR_CPU_ONLY, name, &s->p[i]) < 0) {
            Py_DECREF(s);
            return NULL;
        }
        if (s->p[i].t.dtype != MPIDP_F32) {
            PyErr_Format(PyExc_TypeError, "%s: DASO syncs float32 parameters, got %s", name,
                         mpidp_dtype_name(s->p[i].t.dtype));
            Py_DECREF(s);
            return NULL;
        }
        s->offset[i] = s->numel;
        s->numel += s->p[i].t.numel;
    }
    s->ref = malloc((s->numel ? s->numel : 1) * sizeof(float));
    s->buf = malloc((s->numel ? s->numel : 1) * mpidp_dtype_size(wire));
    if (s->ref == NULL || s->buf == NULL) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < s->n_params; i++)
        memcpy(s->ref + s->offset[i], s->p[i].t.data, s->p[i].t.numel * sizeof(float));
    return (PyObject *)s;
}

/* set_reference(): ref = the parameters now (after a blocking sync, when every
 * rank holds the same values). */
static PyObject *paramsync_set_reference(paramsync_t *s, PyObject *unused)
{
    (void)unused;
    PASS_BEGIN(s);
    for (size_t i = 0; i < s->n_params; i++)
        memcpy(s->ref + s->offset[i], s->p[i].t.data, s->p[i].t.numel * sizeof(float));
    PASS_END();
    Py_RETURN_NONE;
}

/* send(zero=False): with zero, contribute nothing (a node whose ranks have
 * all run out of data during join(): it answers the collective with zeros). */
static PyObject *paramsync_send(paramsync_t *s, PyObject *args)
{
    int zero = 0;
    if (!PyArg_ParseTuple(args, "|p:send", &zero)) return NULL;
    if (s->state != SYNC_IDLE)
        return PyErr_Format(PyExc_RuntimeError, "ParamSync.send: a sync is already in flight");
    const mpidp_pack_kernels_t *k = mpidp_pack_kernels();
    PASS_BEGIN(s);
    if (zero) memset(s->buf, 0, s->numel * mpidp_dtype_size(s->wire));
    for (size_t i = 0; i < s->n_params && !zero; i++) {
        const float *p = s->p[i].t.data, *r = s->ref + s->offset[i];
        size_t n = s->p[i].t.numel, off = s->offset[i];
        if (s->wire == MPIDP_BF16) k->pack_bf16((uint16_t *)s->buf + off, p, r, 1.0f, n);
        else if (s->wire == MPIDP_F16) k->pack_fp16((uint16_t *)s->buf + off, p, r, 1.0f, n);
        else k->merge_f32((float *)s->buf + off, p, r, 0.0f, 1.0f, -1.0f, n);
    }
    PASS_END();
    mpidp_py_comm_t *c = (mpidp_py_comm_t *)s->comm;
    mpidp_tensor_t t = {.data = s->buf, .numel = s->numel, .dtype = s->wire,
                        .device = MPIDP_DEV_CPU};
    mpidp_allreduce_opts_t opts = {.op = MPIDP_OP_SUM, .wire = -1, .chunk_elems = s->chunk,
                                   .max_in_flight = 0, .keep_wire = 0,
                                   .drain_timeout_s = mpidp_py_timeout_s, .what = "DASO global sync"};
    mpidp_error_clear();
    int rc = mpidp_allreduce_start(c->comm, &t, &opts, s->st->reqs, &s->x);
    if (rc != MPIDP_OK) return mpidp_py_raise(s->st, rc, "DASO global sync");
    s->state = SYNC_POSTED;
    Py_RETURN_NONE;
}

static PyObject *paramsync_test(paramsync_t *s, PyObject *unused)
{
    (void)unused;
    if (s->state != SYNC_POSTED) Py_RETURN_TRUE;
    int done = 0;
    mpidp_error_clear();
    int rc = mpidp_allreduce_test(s->x, &done);
    if (rc != MPIDP_OK) return mpidp_py_raise(s->st, rc, "DASO global sync");
    return PyBool_FromLong(done);
}

static int wait_posted(paramsync_t *s)
{
    if (s->state != SYNC_POSTED) return 0;
    int rc;
    mpidp_error_clear();
    MPIDP_PY_WAIT(s->st, rc, mpidp_allreduce_wait(s->x, mpidp_py_timeout_s));
    if (rc != MPIDP_OK) {
        mpidp_py_raise(s->st, rc, "DASO global sync");
        return -1;
    }
    mpidp_allreduce_free(s->x);
    s->x = NULL;
    s->state = SYNC_IDLE;
    return 0;
}

static PyObject *paramsync_wait(paramsync_t *s, PyObject *unused)
{
    (void)unused;
    if (wait_posted(s) < 0) return NULL;
    Py_RETURN_NONE;
}

/* merge(a, b, c): completes the sync, then p = a*p + b*sum + c*ref. */
static PyObject *paramsync_merge(paramsync_t *s, PyObject *args)
{
    float a, b, c;
    if (!PyArg_ParseTuple(args, "fff:merge", &a, &b, &c)) return NULL;
    if (wait_posted(s) < 0) return NULL;
    const mpidp_pack_kernels_t *k = mpidp_pack_kernels();
    PASS_BEGIN(s);
    for (size_t i = 0; i < s->n_params; i++) {
        float *p = s->p[i].t.data;
        const float *r = s->ref + s->offset[i];
        size_t n = s->p[i].t.numel, off = s->offset[i];
        if (s->wire == MPIDP_BF16) k->unpack_bf16(p, (uint16_t *)s->buf + off, r, a, b, c, n);
        else if (s->wire == MPIDP_F16) k->unpack_fp16(p, (uint16_t *)s->buf + off, r, a, b, c, n);
        else k->merge_f32(p, (float *)s->buf + off, r, a, b, c, n);
    }
    PASS_END();
    Py_RETURN_NONE;
}

/* flatten(flat): flat[offset_i ...] = p_i; unflatten(flat): the reverse. */
static PyObject *copy_flat(paramsync_t *s, PyObject *flat_obj, int into_flat)
{
    mpidp_py_borrowed_t flat;
    if (mpidp_py_borrow(s->st, flat_obj, MPIDP_TENSOR_WRITABLE | MPIDP_TENSOR_CPU_ONLY, "flat",
                        &flat) < 0)
        return NULL;
    if (flat.t.dtype != MPIDP_F32 || flat.t.numel != s->numel) {
        mpidp_py_release(&flat);
        return PyErr_Format(PyExc_ValueError, "flat: expected %zu float32 elements", s->numel);
    }
    PASS_BEGIN(s);
    for (size_t i = 0; i < s->n_params; i++) {
        float *f = (float *)flat.t.data + s->offset[i];
        size_t bytes = s->p[i].t.numel * sizeof(float);
        if (into_flat) memcpy(f, s->p[i].t.data, bytes);
        else memcpy(s->p[i].t.data, f, bytes);
    }
    PASS_END();
    mpidp_py_release(&flat);
    Py_RETURN_NONE;
}

static PyObject *paramsync_flatten(paramsync_t *s, PyObject *flat) { return copy_flat(s, flat, 1); }
static PyObject *paramsync_unflatten(paramsync_t *s, PyObject *flat) { return copy_flat(s, flat, 0); }

/* The data pointers borrowed at construction: a parameter whose storage was
 * replaced since (module.to(), p.data = ...) needs a new ParamSync. */
static PyObject *paramsync_pointers(paramsync_t *s, PyObject *unused)
{
    (void)unused;
    PyObject *out = PyTuple_New((Py_ssize_t)s->n_params);
    for (size_t i = 0; out && i < s->n_params; i++) {
        PyObject *v = PyLong_FromVoidPtr(s->p[i].t.data);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    return out;
}

static PyObject *paramsync_get_numel(paramsync_t *s, void *c) { (void)c; return PyLong_FromSize_t(s->numel); }
static PyObject *paramsync_get_pending(paramsync_t *s, void *c) { (void)c; return PyBool_FromLong(s->state == SYNC_POSTED); }
static PyObject *paramsync_get_wire_bytes(paramsync_t *s, void *c)
{
    (void)c;
    return PyLong_FromSize_t(s->numel * mpidp_dtype_size(s->wire));
}

static int paramsync_traverse(paramsync_t *s, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(s));
    Py_VISIT(s->params);
    return 0;
}

static void paramsync_dealloc(paramsync_t *s)
{
    PyTypeObject *tp = Py_TYPE(s);
    PyObject_GC_UnTrack(s);
    int leak = 0;
    if (s->state == SYNC_POSTED) {
        int finalized = 1;
        MPI_Finalized(&finalized);
        if (finalized || mpidp_allreduce_wait(s->x, mpidp_py_timeout_s) != MPIDP_OK ||
            mpidp_allreduce_free(s->x) != MPIDP_OK)
            leak = 1; /* MPI may still write into buf: never free it */
    }
    for (size_t i = 0; s->p && i < s->n_params; i++) mpidp_py_release(&s->p[i]);
    free(s->p);
    free(s->offset);
    free(s->ref);
    if (!leak) free(s->buf);
    Py_CLEAR(s->params);
    Py_CLEAR(s->comm);
    Py_CLEAR(s->module);
    tp->tp_free((PyObject *)s);
    Py_DECREF(tp);
}

static PyMethodDef paramsync_methods[] = {
    {"set_reference", (PyCFunction)paramsync_set_reference, METH_NOARGS,
     "ref = the parameters now (every rank must hold the same values)."},
    {"send", (PyCFunction)paramsync_send, METH_VARARGS,
     "send(zero=False): pack p - ref (or zeros) into the wire buffer and post the allreduce."},
    {"test", (PyCFunction)paramsync_test, METH_NOARGS, "Progress; True once complete."},
    {"wait", (PyCFunction)paramsync_wait, METH_NOARGS, "Complete the sync in flight."},
    {"merge", (PyCFunction)paramsync_merge, METH_VARARGS,
     "merge(a, b, c): complete, then p = a*p + b*sum_of_differences + c*ref."},
    {"flatten", (PyCFunction)paramsync_flatten, METH_O, "Copy the parameters into a flat tensor."},
    {"unflatten", (PyCFunction)paramsync_unflatten, METH_O, "Copy a flat tensor into the parameters."},
    {"pointers", (PyCFunction)paramsync_pointers, METH_NOARGS, "The borrowed data pointers."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef paramsync_getset[] = {
    {"numel", (getter)paramsync_get_numel, NULL, "Elements synced.", NULL},
    {"pending", (getter)paramsync_get_pending, NULL, "A sync is in flight.", NULL},
    {"wire_bytes", (getter)paramsync_get_wire_bytes, NULL, "Bytes this rank sends per sync.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot paramsync_slots[] = {
    {Py_tp_new, paramsync_new},
    {Py_tp_dealloc, paramsync_dealloc},
    {Py_tp_traverse, paramsync_traverse},
    {Py_tp_methods, paramsync_methods},
    {Py_tp_getset, paramsync_getset},
    {Py_tp_doc, "DASO's global parameter sync (internal)."},
    {0, NULL},
};

static PyType_Spec paramsync_spec = {
    .name = "mpidp._C.ParamSync",
    .basicsize = sizeof(paramsync_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = paramsync_slots,
};

int mpidp_py_paramsync_init(PyObject *module, mpidp_py_state *st)
{
    st->paramsync_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &paramsync_spec, NULL);
    if (st->paramsync_type == NULL) return -1;
    return PyModule_AddType(module, st->paramsync_type);
}
