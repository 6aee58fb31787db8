/* Module functions over the error-feedback compression kernels
 * (mpidp/efcomp.h), for mpidp.SparseLoCo and mpidp.DeMo: each borrows its
 * host tensors (float32, or uint8 for payload buckets), checks that every
 * payload fits its bucket at the given offset, and runs one kernel with the
 * GIL released. A tiling is passed as the tuple (rows, cols, tile_rows,
 * tile_cols) that ef_tiling returns. */
#include "module.h"

#include "mpidp/efcomp.h"

typedef struct {
    mpidp_py_borrowed_t t[6];
    int n;
} borrowed_set;

static void release_set(borrowed_set *b)
{
    while (b->n > 0) mpidp_py_release(&b->t[--b->n]);
}

/* Borrows obj as a host tensor of `dtype` (writable if asked) into the set. */
static mpidp_tensor_t *take(mpidp_py_state *st, borrowed_set *b, PyObject *obj, int dtype,
                            int writable, const char *name)
{
    unsigned need = MPIDP_TENSOR_CPU_ONLY | MPIDP_TENSOR_ANY_DTYPE |
                    (writable ? MPIDP_TENSOR_WRITABLE : 0u);
    if (mpidp_py_borrow(st, obj, need, name, &b->t[b->n]) < 0) return NULL;
    mpidp_tensor_t *t = &b->t[b->n++].t;
    if ((int)t->dtype != dtype) {
        PyErr_Format(PyExc_TypeError, "%s: expected a %s tensor, got %s", name,
                     mpidp_dtype_name(dtype), mpidp_dtype_name(t->dtype));
        return NULL;
    }
    return t;
}

static int parse_tiling(PyObject *obj, mpidp_ef_tiling_t *t)
{
    if (!PyArg_ParseTuple(obj, "LLLL;tiling: expected (rows, cols, tile_rows, tile_cols)",
                          &t->rows, &t->cols, &t->tile_rows, &t->tile_cols))
        return -1;
    if (t->rows < 1 || t->cols < 1 || t->tile_rows < 1 || t->tile_cols < 1 ||
        t->rows % t->tile_rows || t->cols % t->tile_cols ||
        t->tile_rows > MPIDP_EF_MAX_CHUNK || t->tile_cols > MPIDP_EF_MAX_CHUNK) {
        PyErr_SetString(PyExc_ValueError, "tiling: not a tiling (use ef_tiling)");
        return -1;
    }
    return 0;
}

/* Bytes of one tensor's payload under tiling t; -1 with ValueError set for
 * k or bins out of range. */
static int64_t payload_bytes(const mpidp_ef_tiling_t *t, long long k, int bins)
{
    int64_t len = mpidp_ef_tile_len(t);
    if (k < 1 || k > len) {
        PyErr_Format(PyExc_ValueError, "k must be 1 .. %lld (the tile's length), got %lld",
                     (long long)len, k);
        return -1;
    }
    int64_t bytes = mpidp_ef_payload_bytes(mpidp_ef_ntiles(t), len, k, bins);
    if (bytes < 0)
        PyErr_Format(PyExc_ValueError, "bins must be 0 (no quantizer) or 2 .. %d, got %d",
                     MPIDP_EF_MAX_BINS, bins);
    return bytes;
}

static int check_numel(const mpidp_tensor_t *x, const mpidp_ef_tiling_t *t, const char *name)
{
    if ((int64_t)x->numel == t->rows * t->cols) return 0;
    PyErr_Format(PyExc_ValueError, "%s: expected %lld elements (the tiling's), got %zu", name,
                 (long long)(t->rows * t->cols), x->numel);
    return -1;
}

/* The payload of one tensor at `offset` of `bucket`, or of R ranks at
 * offset + r * stride, must lie inside the bucket. */
static int check_span(const mpidp_tensor_t *bucket, long long offset, long long stride, int R,
                      int64_t bytes, const char *name)
{
    if (bytes < 0) return -1; /* payload_bytes set the error */
    if (offset < 0 || stride < bytes || R < 1 ||
        (unsigned long long)offset + (unsigned long long)stride * (unsigned long long)(R - 1) +
                (unsigned long long)bytes > bucket->numel) {
        PyErr_Format(PyExc_ValueError, "%s: %d payload(s) of %lld bytes at offset %lld, stride "
                     "%lld do not fit its %zu bytes", name, R, (long long)bytes, offset, stride,
                     bucket->numel);
        return -1;
    }
    return 0;
}

static int check_one(const mpidp_tensor_t *bucket, long long offset, int64_t bytes)
{
    return check_span(bucket, offset, bytes, 1, bytes, "bucket");
}

#define RUN(rc, call)                                                            \
    do {                                                                         \
        Py_BEGIN_ALLOW_THREADS (rc) = (call);                                    \
        Py_END_ALLOW_THREADS                                                     \
    } while (0)

static PyObject *finish(mpidp_py_state *st, borrowed_set *b, int rc, const char *what)
{
    release_set(b);
    if (rc != MPIDP_OK) return mpidp_py_raise(st, rc, what);
    Py_RETURN_NONE;
}

/* ef_tiling(shape, chunk) -> (rows, cols, tile_rows, tile_cols) */
static PyObject *ef_tiling(PyObject *m, PyObject *args)
{
    PyObject *shape;
    long long chunk;
    if (!PyArg_ParseTuple(args, "OL:ef_tiling", &shape, &chunk)) return NULL;
    PyObject *fast = PySequence_Fast(shape, "shape: expected a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(fast);
    int64_t sizes[64];
    if (nd > 64) {
        Py_DECREF(fast);
        return PyErr_Format(PyExc_ValueError, "shape: at most 64 dimensions, got %zd", nd);
    }
    for (Py_ssize_t i = 0; i < nd; i++)
        if ((sizes[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i))) == -1 &&
            PyErr_Occurred()) {
            Py_DECREF(fast);
            return NULL;
        }
    Py_DECREF(fast);
    mpidp_ef_tiling_t t;
    mpidp_error_clear();
    int rc = mpidp_ef_tiling((int)nd, sizes, chunk, &t);
    if (rc != MPIDP_OK) return mpidp_py_raise(mpidp_py_state_of_module(m), rc, "ef_tiling");
    return Py_BuildValue("(LLLL)", (long long)t.rows, (long long)t.cols, (long long)t.tile_rows,
                         (long long)t.tile_cols);
}

/* ef_payload_bytes(ntiles, len, k, bins) -> int */
static PyObject *ef_payload_bytes(PyObject *m, PyObject *args)
{
    (void)m;
    long long ntiles, len, k;
    int bins;
    if (!PyArg_ParseTuple(args, "LLLi:ef_payload_bytes", &ntiles, &len, &k, &bins)) return NULL;
    int64_t bytes = mpidp_ef_payload_bytes(ntiles, len, k, bins);
    if (bytes < 0)
        return PyErr_Format(PyExc_ValueError, "ef_payload_bytes: k or bins out of range");
    return PyLong_FromLongLong(bytes);
}

/* ef_compress(e, delta, tiling, beta, alpha, k, bins, range, bucket, offset) */
static PyObject *ef_compress(PyObject *m, PyObject *args)
{
    PyObject *e_obj, *d_obj, *tl, *b_obj;
    float beta, alpha;
    long long k, offset;
    int bins;
    double range;
    if (!PyArg_ParseTuple(args, "OOOffLidOL:ef_compress", &e_obj, &d_obj, &tl, &beta, &alpha, &k,
                          &bins, &range, &b_obj, &offset))
        return NULL;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    mpidp_ef_tiling_t t;
    if (parse_tiling(tl, &t) < 0) return NULL;
    borrowed_set b = {.n = 0};
    mpidp_tensor_t *e = take(st, &b, e_obj, MPIDP_F32, 1, "e"), *d = NULL, *bucket = NULL;
    if (e == NULL || check_numel(e, &t, "e") < 0) goto fail;
    if (d_obj != Py_None &&
        ((d = take(st, &b, d_obj, MPIDP_F32, 0, "delta")) == NULL || check_numel(d, &t, "delta") < 0))
        goto fail;
    if ((bucket = take(st, &b, b_obj, MPIDP_U8, 1, "bucket")) == NULL ||
        check_one(bucket, offset, payload_bytes(&t, k, bins)) < 0)
        goto fail;
    int rc;
    mpidp_error_clear();
    RUN(rc, mpidp_ef_compress(&t, e->data, d ? d->data : NULL, beta, alpha, k, bins, range,
                              (uint8_t *)bucket->data + offset));
    return finish(st, &b, rc, "ef_compress");
fail:
    release_set(&b);
    return NULL;
}

/* ef_sparse_mean(out, gathered, offset, stride, R, tiling, k, bins, divide_by_all) */
static PyObject *ef_sparse_mean(PyObject *m, PyObject *args)
{
    PyObject *o_obj, *g_obj, *tl;
    long long offset, stride, k;
    int R, bins, all;
    if (!PyArg_ParseTuple(args, "OOLLiOLip:ef_sparse_mean", &o_obj, &g_obj, &offset, &stride, &R,
                          &tl, &k, &bins, &all))
        return NULL;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    mpidp_ef_tiling_t t;
    if (parse_tiling(tl, &t) < 0) return NULL;
    borrowed_set b = {.n = 0};
    mpidp_tensor_t *out = take(st, &b, o_obj, MPIDP_F32, 1, "out"), *g = NULL;
    if (out == NULL || check_numel(out, &t, "out") < 0) goto fail;
    if ((g = take(st, &b, g_obj, MPIDP_U8, 0, "gathered")) == NULL ||
        check_span(g, offset, stride, R, payload_bytes(&t, k, bins),
                   "gathered") < 0)
        goto fail;
    int rc;
    mpidp_error_clear();
    RUN(rc, mpidp_ef_sparse_mean(&t, (const uint8_t *)g->data + offset, (size_t)stride, R, k, bins,
                                 all, 0, out->data));
    return finish(st, &b, rc, "ef_sparse_mean");
fail:
    release_set(&b);
    return NULL;
}

/* ef_dct_basis(out, side) */
static PyObject *ef_dct_basis(PyObject *m, PyObject *args)
{
    PyObject *o_obj;
    long long s;
    if (!PyArg_ParseTuple(args, "OL:ef_dct_basis", &o_obj, &s)) return NULL;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    borrowed_set b = {.n = 0};
    mpidp_tensor_t *out = take(st, &b, o_obj, MPIDP_F32, 1, "out");
    if (out == NULL) goto fail;
    if (s < 1 || (long long)out->numel != s * s) {
        PyErr_Format(PyExc_ValueError, "out: expected side x side = %lld elements, got %zu",
                     s * s, out->numel);
        goto fail;
    }
    mpidp_error_clear();
    return finish(st, &b, mpidp_ef_dct_basis(s, out->data), "ef_dct_basis");
fail:
    release_set(&b);
    return NULL;
}

/* ef_dct_tiles(tiles, tile_rows, tile_cols, basis_rows, basis_cols, inverse): in place
 * over tile-major tiles. */
static PyObject *ef_dct_tiles(PyObject *m, PyObject *args)
{
    PyObject *t_obj, *fr_obj, *fc_obj;
    long long r, c;
    int inverse;
    if (!PyArg_ParseTuple(args, "OLLOOp:ef_dct_tiles", &t_obj, &r, &c, &fr_obj, &fc_obj, &inverse))
        return NULL;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    borrowed_set b = {.n = 0};
    mpidp_tensor_t *tiles = take(st, &b, t_obj, MPIDP_F32, 1, "tiles"), *fr = NULL, *fc = NULL;
    if (tiles == NULL || (fr = take(st, &b, fr_obj, MPIDP_F32, 0, "basis_rows")) == NULL ||
        (fc = take(st, &b, fc_obj, MPIDP_F32, 0, "basis_cols")) == NULL)
        goto fail;
    if (r < 1 || c < 1 || (long long)fr->numel != r * r || (long long)fc->numel != c * c ||
        tiles->numel % (size_t)(r * c)) {
        PyErr_SetString(PyExc_ValueError, "ef_dct_tiles: expected whole tiles of tile_rows x "
                                          "tile_cols and the bases of those sides");
        goto fail;
    }
    int rc;
    mpidp_error_clear();
    RUN(rc, mpidp_ef_dct_tiles(tiles->data, (int64_t)(tiles->numel / (size_t)(r * c)), r, c,
                               fr->data, fc->data, inverse));
    return finish(st, &b, rc, "ef_dct_tiles");
fail:
    release_set(&b);
    return NULL;
}

static int take_bases(mpidp_py_state *st, borrowed_set *b, PyObject *fr, PyObject *fc,
                      const mpidp_ef_tiling_t *t, const float **r, const float **c)
{
    mpidp_tensor_t *x = take(st, b, fr, MPIDP_F32, 0, "basis_rows"), *y;
    if (x == NULL) return -1;
    if ((y = take(st, b, fc, MPIDP_F32, 0, "basis_cols")) == NULL) return -1;
    if ((int64_t)x->numel != t->tile_rows * t->tile_rows ||
        (int64_t)y->numel != t->tile_cols * t->tile_cols) {
        PyErr_SetString(PyExc_ValueError, "basis_rows, basis_cols: expected the bases of the "
                                          "tile's sides (ef_dct_basis)");
        return -1;
    }
    *r = x->data, *c = y->data;
    return 0;
}

/* ef_demo_compress(delta, grad, tiling, beta, lr, k, basis_rows, basis_cols, bucket, offset) */
static PyObject *ef_demo_compress(PyObject *m, PyObject *args)
{
    PyObject *d_obj, *g_obj, *tl, *fr_obj, *fc_obj, *b_obj;
    float beta, lr;
    long long k, offset;
    if (!PyArg_ParseTuple(args, "OOOffLOOOL:ef_demo_compress", &d_obj, &g_obj, &tl, &beta, &lr,
                          &k, &fr_obj, &fc_obj, &b_obj, &offset))
        return NULL;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    mpidp_ef_tiling_t t;
    if (parse_tiling(tl, &t) < 0) return NULL;
    borrowed_set b = {.n = 0};
    const float *fr, *fc;
    mpidp_tensor_t *d = take(st, &b, d_obj, MPIDP_F32, 1, "delta"), *bucket = NULL;
    const float *grad = NULL;
    if (d == NULL || check_numel(d, &t, "delta") < 0) goto fail;
    if (g_obj != Py_None) {
        mpidp_tensor_t *g = take(st, &b, g_obj, MPIDP_F32, 0, "grad");
        if (g == NULL || check_numel(g, &t, "grad") < 0) goto fail;
        grad = g->data;
    }
    if (take_bases(st, &b, fr_obj, fc_obj, &t, &fr, &fc) < 0 ||
        (bucket = take(st, &b, b_obj, MPIDP_U8, 1, "bucket")) == NULL ||
        check_one(bucket, offset, payload_bytes(&t, k, 0)) < 0)
        goto fail;
    int rc;
    mpidp_error_clear();
    RUN(rc, mpidp_ef_demo_compress(&t, d->data, grad, beta, lr, k, fr, fc,
                                   (uint8_t *)bucket->data + offset));
    return finish(st, &b, rc, "ef_demo_compress");
fail:
    release_set(&b);
    return NULL;
}

/* ef_demo_decode(out, gathered, offset, stride, R, tiling, k, basis_rows, basis_cols) */
static PyObject *ef_demo_decode(PyObject *m, PyObject *args)
{
    PyObject *o_obj, *g_obj, *tl, *fr_obj, *fc_obj;
    long long offset, stride, k;
    int R;
    if (!PyArg_ParseTuple(args, "OOLLiOLOO:ef_demo_decode", &o_obj, &g_obj, &offset, &stride, &R,
                          &tl, &k, &fr_obj, &fc_obj))
        return NULL;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    mpidp_ef_tiling_t t;
    if (parse_tiling(tl, &t) < 0) return NULL;
    borrowed_set b = {.n = 0};
    const float *fr, *fc;
    mpidp_tensor_t *out = take(st, &b, o_obj, MPIDP_F32, 1, "out"), *g = NULL;
    if (out == NULL || check_numel(out, &t, "out") < 0) goto fail;
    if ((g = take(st, &b, g_obj, MPIDP_U8, 0, "gathered")) == NULL ||
        check_span(g, offset, stride, R, payload_bytes(&t, k, 0),
                   "gathered") < 0 ||
        take_bases(st, &b, fr_obj, fc_obj, &t, &fr, &fc) < 0)
        goto fail;
    int rc;
    mpidp_error_clear();
    RUN(rc, mpidp_ef_demo_decode(&t, (const uint8_t *)g->data + offset, (size_t)stride, R, k, fr,
                                 fc, out->data));
    return finish(st, &b, rc, "ef_demo_decode");
fail:
    release_set(&b);
    return NULL;
}

PyMethodDef mpidp_py_efcomp_functions[] = {
    {"ef_tiling", ef_tiling, METH_VARARGS,
     "ef_tiling(shape, chunk) -> (rows, cols, tile_rows, tile_cols): the tiling of a tensor."},
    {"ef_payload_bytes", ef_payload_bytes, METH_VARARGS,
     "ef_payload_bytes(ntiles, len, k, bins) -> bytes of one tensor's payload "
     "(bins 0: plain; k == len: dense)."},
    {"ef_compress", ef_compress, METH_VARARGS,
     "ef_compress(e, delta, tiling, beta, alpha, k, bins, range, bucket, offset): SparseLoCo's\n"
     "compression of one tensor into bucket[offset:] (delta None: a zero delta)."},
    {"ef_sparse_mean", ef_sparse_mean, METH_VARARGS,
     "ef_sparse_mean(out, gathered, offset, stride, R, tiling, k, bins, divide_by_all): the\n"
     "sparse mean of R ranks' payloads of one tensor, in rank order."},
    {"ef_dct_basis", ef_dct_basis, METH_VARARGS,
     "ef_dct_basis(out, side): the orthonormal DCT-II matrix of that side."},
    {"ef_dct_tiles", ef_dct_tiles, METH_VARARGS,
     "ef_dct_tiles(tiles, tile_rows, tile_cols, basis_rows, basis_cols, inverse): the tile\n"
     "DCT-II (or, inverse, DCT-III) in place over tile-major tiles."},
    {"ef_demo_compress", ef_demo_compress, METH_VARARGS,
     "ef_demo_compress(delta, grad, tiling, beta, lr, k, basis_rows, basis_cols, bucket,\n"
     "offset): DeMo's compression of one tensor's momentum (grad None: a zero gradient)."},
    {"ef_demo_decode", ef_demo_decode, METH_VARARGS,
     "ef_demo_decode(out, gathered, offset, stride, R, tiling, k, basis_rows, basis_cols):\n"
     "DeMo's aggregate of R ranks' coefficients, inverse-transformed."},
    {NULL, NULL, 0, NULL},
};
