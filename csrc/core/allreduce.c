/* Chunked, optionally compressed allreduce (see mpidp/allreduce.h). */
#include "mpidp/allreduce.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include "mpidp/convert.h"
#include "mpi_util.h"
#include "post.h"
#include "mpidp/mpiops.h"
#include "mpidp/operation.h"
#include "mpidp/pack.h"
#include "mpidp/qallreduce.h"
#include "mpidp/status.h"
#include "fail.h"
#include "linear.h"

struct mpidp_allreduce {
    MPI_Comm comm;
    int size;
    mpidp_reqtable_t *reqs;
    mpidp_tensor_t t;
    mpidp_allreduce_opts_t o;
    int compressed;
    size_t n_chunks;
    size_t next_post;      /* chunks below this have been posted */
    size_t next_done;      /* chunks below this have completed (and been unpacked) */
    size_t slots;          /* wire buffers in rotation (chunks in flight at most) */
    uint16_t *wire;        /* slots * chunk_elems elements, compressed only */
    mpidp_req_t *req;      /* per slot */
    mpidp_qallreduce_t *q; /* wire uint8: the quantized engine does the work */
    mpidp__linear_t *linear; /* a small tensor: point-to-point messages do */
    char what[64];
};

/* Up to this many bytes (in one chunk) on up to MPIDP_LINEAR_MAX_RANKS
 * ranks, an uncompressed allreduce goes as point-to-point messages
 * (core/linear.h), which beat Open MPI's non-blocking allreduce there
 * (docs/design-notes.md has the figures). */
#define LINEAR_MAX_BYTES ((size_t)1 << 14)

/* Packing or unpacking a chunk takes milliseconds, and Open MPI advances the
 * chunk already in flight only inside MPI calls: convert in sub-chunks of
 * this many elements and test what is in flight between them. */
#define CONVERT_STEP ((size_t)1 << 18)

static size_t chunk_len(const mpidp_allreduce_t *x, size_t k)
{
    size_t start = k * x->o.chunk_elems;
    size_t left = x->t.numel - start;
    return left < x->o.chunk_elems ? left : x->o.chunk_elems;
}

static uint16_t *slot_wire(const mpidp_allreduce_t *x, size_t k)
{
    /* With every chunk in flight at once the wire copy is the whole tensor, laid
     * out in tensor order (so keep_wire callers can read it as one array). */
    return x->wire + (k % x->slots) * x->o.chunk_elems;
}

/* In-place scaling of 16-bit tensors (a half-precision model averaging its own
 * gradients); rare, so a scalar loop through the exact conversions. */
static void scale_half(uint16_t *x, int dtype, float s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (dtype == MPIDP_BF16) x[i] = mpidp_bf16_from_f32(mpidp_f32_from_bf16(x[i]) * s);
        else x[i] = mpidp_fp16_from_f32(mpidp_f32_from_fp16(x[i]) * s);
    }
}

/* An average is a sum of the values divided by the ranks first. */
static void scale_for_average(const mpidp_allreduce_t *x, void *buf, int dtype, size_t n)
{
    const mpidp_pack_kernels_t *kern = mpidp_pack_kernels();
    if (dtype == MPIDP_F32) kern->scale_f32(buf, 1.0f / (float)x->size, n);
    else if (dtype == MPIDP_F64) kern->scale_f64(buf, 1.0 / (double)x->size, n);
    else scale_half(buf, dtype, 1.0f / (float)x->size, n);
}

static int post_chunk(mpidp_allreduce_t *x, size_t k)
{
    const mpidp_pack_kernels_t *kern = mpidp_pack_kernels();
    size_t start = k * x->o.chunk_elems, n = chunk_len(x, k);
    float s = x->o.op == MPIDP_OP_AVG ? 1.0f / (float)x->size : 1.0f;
    void *buf;
    int dtype;
    if (x->compressed) {
        buf = slot_wire(x, k);
        dtype = x->o.wire;
        const float *src = (const float *)x->t.data + start;
        for (size_t i = 0; i < n; i += CONVERT_STEP) {
            size_t m = n - i < CONVERT_STEP ? n - i : CONVERT_STEP;
            if (dtype == MPIDP_BF16) kern->pack_bf16((uint16_t *)buf + i, src + i, NULL, s, m);
            else {
                kern->pack_fp16((uint16_t *)buf + i, src + i, NULL, s, m);
                mpidp_fp16_count_overflow((uint16_t *)buf + i, src + i, NULL, m);
            }
            if (i + m < n) mpidp_reqtable_progress(x->reqs, NULL); /* errors surface in test/wait */
        }
    } else {
        dtype = x->t.dtype;
        buf = (char *)x->t.data + start * mpidp_dtype_size(dtype);
        if (x->o.op == MPIDP_OP_AVG) scale_for_average(x, buf, dtype, n);
    }
    char what[MPIDP_REQ_WHAT_LEN + 64];
    snprintf(what, sizeof what, "%s: MPI_Iallreduce of %zu %s (chunk %zu/%zu)", x->what, n,
             mpidp_dtype_name(dtype), k + 1, x->n_chunks);
    return mpidp__post_iallreduce(x->comm, x->reqs, buf, n, x->o.op, dtype, what,
                                  &x->req[k % x->slots]);
}

static void finish_chunk(mpidp_allreduce_t *x, size_t k)
{
    if (!x->compressed || x->o.keep_wire) return;
    const mpidp_pack_kernels_t *kern = mpidp_pack_kernels();
    float *dst = (float *)x->t.data + k * x->o.chunk_elems;
    const uint16_t *w = slot_wire(x, k);
    size_t n = chunk_len(x, k);
    for (size_t i = 0; i < n; i += CONVERT_STEP) {
        size_t m = n - i < CONVERT_STEP ? n - i : CONVERT_STEP;
        if (x->o.wire == MPIDP_BF16) kern->unpack_bf16(dst + i, w + i, NULL, 0.0f, 1.0f, 0.0f, m);
        else kern->unpack_fp16(dst + i, w + i, NULL, 0.0f, 1.0f, 0.0f, m);
        if (i + m < n) mpidp_reqtable_progress(x->reqs, NULL);
    }
}

/* Posts chunks while a slot is free. */
static int post_more(mpidp_allreduce_t *x)
{
    while (x->next_post < x->n_chunks && x->next_post - x->next_done < x->slots) {
        int rc = post_chunk(x, x->next_post);
        if (rc != MPIDP_OK) return rc;
        x->next_post++;
    }
    return MPIDP_OK;
}

mpidp_allreduce_opts_t mpidp_allreduce_default_opts(int dtype, int op, int wire,
                                                    double drain_timeout_s, const char *what)
{
    int compressed = wire != -1 && wire != dtype;
    return (mpidp_allreduce_opts_t){
        .op = op, .wire = wire,
        .chunk_elems = compressed ? MPIDP_ALLREDUCE_WIRE_CHUNK : MPIDP_ALLREDUCE_PLAIN_CHUNK,
        .max_in_flight = compressed ? MPIDP_ALLREDUCE_WIRE_IN_FLIGHT : 0, .keep_wire = 0,
        .drain_timeout_s = drain_timeout_s, .what = what};
}

/* wire uint8: mpidp/qallreduce.h, for a float32 sum or average. */
static int start_quantized(MPI_Comm comm, const mpidp_tensor_t *t,
                           const mpidp_allreduce_opts_t *opts, mpidp_reqtable_t *reqs,
                           mpidp_allreduce_t **out)
{
    if (t->dtype != MPIDP_F32)
        return mpidp__fail(MPIDP_EDTYPE, "allreduce: a %s tensor cannot travel as uint8 (8-bit "
                           "quantization takes float32)", mpidp_dtype_name(t->dtype));
    if (opts->op != MPIDP_OP_SUM && opts->op != MPIDP_OP_AVG)
        return mpidp__fail(MPIDP_EINVAL, "allreduce: op %s cannot be quantized on the wire (sum "
                           "and avg only)", mpidp_op_name(opts->op));
    if (opts->keep_wire)
        return mpidp__fail(MPIDP_EINVAL, "allreduce: keep_wire is for 16-bit wire dtypes");
    mpidp_allreduce_t *x = calloc(1, sizeof *x);
    if (x == NULL) return mpidp__fail(MPIDP_ENOMEM, "allreduce");
    mpidp_qallreduce_opts_t qo = {.average = opts->op == MPIDP_OP_AVG,
                                  .drain_timeout_s = opts->drain_timeout_s, .what = opts->what};
    int rc = mpidp_qallreduce_start(comm, t, &qo, reqs, &x->q);
    if (rc != MPIDP_OK) {
        free(x);
        return rc;
    }
    x->o = *opts;
    snprintf(x->what, sizeof x->what, "%s", opts->what ? opts->what : "allreduce");
    *out = x;
    return MPIDP_OK;
}

/* The engine's object with what every path keeps; NULL when out of memory. */
static mpidp_allreduce_t *allreduce_new(MPI_Comm comm, int size, const mpidp_tensor_t *t,
                                        const mpidp_allreduce_opts_t *opts,
                                        mpidp_reqtable_t *reqs)
{
    mpidp_allreduce_t *x = calloc(1, sizeof *x);
    if (x == NULL) return NULL;
    x->comm = comm;
    x->size = size;
    x->reqs = reqs;
    x->t = *t;
    x->o = *opts;
    snprintf(x->what, sizeof x->what, "%s", opts->what ? opts->what : "allreduce");
    return x;
}

static int start_linear(MPI_Comm comm, int rank, int size, const mpidp_tensor_t *t,
                        const mpidp_allreduce_opts_t *opts, mpidp_reqtable_t *reqs,
                        mpidp_allreduce_t **out)
{
    mpidp_allreduce_t *x = allreduce_new(comm, size, t, opts, reqs);
    if (x == NULL) return mpidp__fail(MPIDP_ENOMEM, "allreduce");
    if (opts->op == MPIDP_OP_AVG) scale_for_average(x, t->data, (int)t->dtype, t->numel);
    char what[MPIDP_REQ_WHAT_LEN];
    snprintf(what, sizeof what, "%s of %zu %s", x->what, t->numel, mpidp_dtype_name(t->dtype));
    int rc = mpidp__linear_allreduce_start(comm, rank, size, t->data, (int)t->numel,
                                           mpidp_mpi_datatype((int)t->dtype),
                                           mpidp_dtype_size(t->dtype),
                                           mpidp_mpi_op(opts->op, (int)t->dtype), reqs, what,
                                           &x->linear);
    if (rc != MPIDP_OK) {
        free(x);
        return rc;
    }
    *out = x;
    return MPIDP_OK;
}

static int linear_poll(void *arg, int *done) { return mpidp__linear_test(arg, done); }

int mpidp_allreduce_start(MPI_Comm comm, const mpidp_tensor_t *t,
                          const mpidp_allreduce_opts_t *opts, mpidp_reqtable_t *reqs,
                          mpidp_allreduce_t **out)
{
    if (t == NULL || opts == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "allreduce: NULL argument");
    if (opts->op < MPIDP_OP_SUM || opts->op > MPIDP_OP_BXOR)
        return mpidp__fail(MPIDP_EINVAL, "allreduce: unknown op %d", opts->op);
    if (opts->wire == MPIDP_U8) return start_quantized(comm, t, opts, reqs, out);
    if (opts->chunk_elems == 0 || opts->chunk_elems > (size_t)INT_MAX)
        return mpidp__fail(MPIDP_EINVAL, "allreduce: chunk_elems must be in 1..INT_MAX");
    if (t->device != MPIDP_DEV_CPU)
        return mpidp__fail(MPIDP_EDEVICE, "allreduce: expected a CPU tensor");
    int compressed = opts->wire != -1 && opts->wire != (int)t->dtype;
    if (compressed && !(t->dtype == MPIDP_F32 && (opts->wire == MPIDP_BF16 || opts->wire == MPIDP_F16)))
        return mpidp__fail(MPIDP_EDTYPE, "allreduce: a %s tensor cannot travel as %s (wire "
                           "compression takes float32 to bfloat16 or float16)",
                           mpidp_dtype_name(t->dtype), mpidp_dtype_name(opts->wire));
    if (compressed && opts->op != MPIDP_OP_SUM && opts->op != MPIDP_OP_AVG)
        return mpidp__fail(MPIDP_EINVAL, "allreduce: op %s cannot be compressed on the wire "
                           "(sum and avg only)", mpidp_op_name(opts->op));
    if (mpidp_mpi_datatype(compressed ? opts->wire : (int)t->dtype) == MPI_DATATYPE_NULL)
        return mpidp__fail(MPIDP_EDTYPE, "allreduce: no MPI datatype for %s (MPI ops not "
                           "initialised?)", mpidp_dtype_name(compressed ? opts->wire : (int)t->dtype));
    if (mpidp_mpi_op(opts->op, (int)t->dtype) == MPI_OP_NULL)
        return mpidp__fail(MPIDP_EDTYPE, "allreduce: op %s is not defined for %s tensors%s",
                           mpidp_op_name(opts->op), mpidp_dtype_name(t->dtype),
                           mpidp_op_hint(opts->op, (int)t->dtype));
    if (opts->keep_wire && (!compressed || opts->max_in_flight != 0))
        return mpidp__fail(MPIDP_EINVAL, "allreduce: keep_wire needs a compressing wire dtype "
                           "and every chunk in flight (max_in_flight 0)");
    int size, rank = 0;
    int rc = MPI_Comm_size(comm, &size);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(comm, &rank);
    if (rc != MPI_SUCCESS) return mpidp__fail(MPIDP_EMPI, "allreduce: MPI_Comm_size/rank failed");
    size_t esize = mpidp_dtype_size(t->dtype);
    if (!compressed && mpidp__linear_fits(size) && t->numel > 0 &&
        t->numel <= opts->chunk_elems && t->numel * esize <= LINEAR_MAX_BYTES)
        return start_linear(comm, rank, size, t, opts, reqs, out);

    mpidp_allreduce_t *x = allreduce_new(comm, size, t, opts, reqs);
    if (x == NULL) return mpidp__fail(MPIDP_ENOMEM, "allreduce");
    x->compressed = compressed;
    x->n_chunks = (t->numel + opts->chunk_elems - 1) / opts->chunk_elems;
    x->slots = opts->max_in_flight == 0 || opts->max_in_flight > x->n_chunks ? x->n_chunks
                                                                            : opts->max_in_flight;
    if (x->slots == 0) x->slots = 1;
    x->req = calloc(x->slots, sizeof *x->req);
    if (compressed && t->numel > 0) {
        size_t n = x->slots * opts->chunk_elems;
        if (n > t->numel) n = t->numel;
        x->wire = malloc(n * sizeof *x->wire);
    }
    if (x->req == NULL || (compressed && t->numel > 0 && x->wire == NULL)) {
        free(x->req);
        free(x->wire);
        free(x);
        return mpidp__fail(MPIDP_ENOMEM, "allreduce: wire buffer for %zu elements", t->numel);
    }
    /* One rank: the sum is the tensor itself; "avg" and compression must still
     * happen so results are what a larger job would give (same rounding). */
    rc = post_more(x);
    if (rc != MPIDP_OK) {
        /* Chunks already posted must land before the buffers go; the other
         * ranks posted them too (or time out on them), so they complete. */
        int drained = 1;
        for (size_t k = x->next_done; k < x->next_post && drained; k++)
            drained = mpidp_reqtable_wait(reqs, x->req[k % x->slots], opts->drain_timeout_s) == MPIDP_OK;
        if (drained) {
            free(x->req);
            free(x->wire);
            free(x);
        } /* else MPI may still write into x->wire: leave it allocated */
        return rc;
    }
    *out = x;
    return MPIDP_OK;
}

int mpidp_allreduce_test(mpidp_allreduce_t *x, int *done)
{
    if (x == NULL || done == NULL) return mpidp__fail(MPIDP_EINVAL, "allreduce: NULL argument");
    if (x->q) return mpidp_qallreduce_test(x->q, done);
    if (x->linear) return mpidp__linear_test(x->linear, done);
    while (x->next_done < x->next_post) {
        int chunk_done = 0;
        int rc = mpidp_reqtable_test(x->reqs, x->req[x->next_done % x->slots], &chunk_done);
        if (rc != MPIDP_OK) return rc;
        if (!chunk_done) break;
        finish_chunk(x, x->next_done);
        x->next_done++;
        rc = post_more(x);
        if (rc != MPIDP_OK) return rc;
    }
    *done = x->next_done == x->n_chunks;
    return MPIDP_OK;
}

int mpidp_allreduce_wait(mpidp_allreduce_t *x, double timeout_s)
{
    if (x == NULL) return mpidp__fail(MPIDP_EINVAL, "allreduce: NULL argument");
    if (x->q) return mpidp_qallreduce_wait(x->q, timeout_s);
    if (x->linear) return mpidp_reqtable_wait_until(x->reqs, linear_poll, x->linear, timeout_s);
    for (;;) {
        int done = 0;
        int rc = mpidp_allreduce_test(x, &done);
        if (rc != MPIDP_OK || done) return rc;
        /* Block on the oldest chunk (the deadline counts per chunk: progress). */
        rc = mpidp_reqtable_wait(x->reqs, x->req[x->next_done % x->slots], timeout_s);
        if (rc != MPIDP_OK) return rc;
    }
}

const uint16_t *mpidp_allreduce_wire(const mpidp_allreduce_t *x)
{
    return (x && x->o.keep_wire) ? x->wire : NULL;
}

int mpidp_allreduce_free(mpidp_allreduce_t *x)
{
    if (x == NULL) return MPIDP_OK;
    if (x->q || x->linear) {
        int rc = x->q ? mpidp_qallreduce_free(x->q) : mpidp__linear_free(x->linear);
        if (rc == MPIDP_OK) free(x);
        return rc;
    }
    for (size_t k = x->next_done; k < x->next_post; k++) {
        int done = 0;
        mpidp_reqtable_test(x->reqs, x->req[k % x->slots], &done);
        if (!done) return mpidp__fail(MPIDP_ESTATE, "%s: chunk %zu is still in flight", x->what, k);
    }
    free(x->req);
    free(x->wire);
    free(x);
    return MPIDP_OK;
}

static int operation_test(void *op, int *done) { return mpidp_allreduce_test(op, done); }
static int operation_wait(void *op, double timeout_s) { return mpidp_allreduce_wait(op, timeout_s); }
static int operation_free(void *op) { return mpidp_allreduce_free(op); }
const mpidp_operation_t mpidp_allreduce_operation = {operation_test, operation_wait, operation_free};
