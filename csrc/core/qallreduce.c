/* The 8-bit quantized allreduce (see mpidp/qallreduce.h).
 *
 * Each segment passes through four states in one of `n_slots` buffer slots:
 * FREE -> SCATTER (its chunks on their way to their owners) -> REDUCED (the
 * own chunk summed and requantized) -> GATHER (the sums on their way to
 * every rank) -> FREE (decoded into the tensor).
 *
 * The two exchanges are point-to-point messages (MPI_Isend / MPI_Irecv to and
 * from every other rank), not MPI_Ialltoall / MPI_Iallgather: the gather of a
 * segment can only start once its scatter has arrived, and MPI requires the
 * collectives of a communicator to start in the same order on every rank,
 * which two quantized allreduces in flight at once (or one beside a gradient
 * bucket's allreduce) would not guarantee. Messages carry a tag made of the
 * operation's number on this communicator (counted in an MPI attribute of
 * the communicator, so every rank numbers the operations it starts on it
 * alike), the segment and the phase, so no message can match another's
 * receive. */
#include "mpidp/qallreduce.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpi_util.h"
#include "post.h"
#include "mpidp/quant8.h"
#include "mpidp/status.h"
#include "fail.h"

enum { FREE, SCATTER, REDUCED, GATHER };

typedef struct {
    size_t seg;
    int state;
    size_t n_reqs;     /* requests of the exchange in flight (2 per other rank) */
    mpidp_req_t *reqs;
    uint8_t *send; /* P chunks' records out; after the scatter, the gathered chunks */
    uint8_t *recv; /* every rank's records of the own chunk */
    float *acc;    /* the own chunk's sum */
} slot_t;

struct mpidp_qallreduce {
    MPI_Comm comm;
    int size, rank;
    mpidp_reqtable_t *reqs;
    float *data;
    size_t n, seg_elems, n_segs;
    int average;
    size_t next_start, n_done, n_slots;
    unsigned op_tag;   /* the operation's number on the communicator, mod 2^9 */
    int failed;        /* a status: a stage failed, possibly half posted; sticky */
    char failure[200];
    slot_t *slots;
    char what[64];
};

/* Segment s's geometry: its first element and length, the elements of each
 * rank's chunk (whole blocks) and their bytes as records. */
typedef struct {
    size_t start, len, chunk, chunk_bytes;
} geom_t;

static geom_t geometry(const mpidp_qallreduce_t *x, size_t s)
{
    geom_t g;
    g.start = s * x->seg_elems;
    g.len = x->n - g.start < x->seg_elems ? x->n - g.start : x->seg_elems;
    size_t per_rank = (g.len + (size_t)x->size - 1) / (size_t)x->size;
    size_t blocks = (per_rank + MPIDP_Q8_BLOCK - 1) / MPIDP_Q8_BLOCK;
    g.chunk = blocks * MPIDP_Q8_BLOCK;
    g.chunk_bytes = blocks * MPIDP_Q8_RECORD;
    return g;
}

/* Elements of chunk r that lie inside the segment (the rest is padding). */
static size_t chunk_len(const geom_t *g, int r)
{
    size_t from = (size_t)r * g->chunk;
    if (from >= g->len) return 0;
    return g->len - from < g->chunk ? g->len - from : g->chunk;
}

/* Records of `len` elements, then zero records (lo = hi = 0: zeros) up to `bytes`. */
static void encode_padded(uint8_t *dst, const float *src, float s, size_t len, size_t bytes)
{
    mpidp_q8_kernels()->encode(dst, src, s, len);
    memset(dst + mpidp_q8_bytes(len), 0, bytes - mpidp_q8_bytes(len));
}

/* A message tag unique among what can be in flight: the operation's number
 * (mod 512), the segment (mod 16: at most a few are in flight) and the phase;
 * below 32768, the smallest MPI_TAG_UB MPI allows. */
static int tag_of(const mpidp_qallreduce_t *x, size_t seg, int phase)
{
    return (int)((x->op_tag << 6) | ((unsigned)(seg & 15u) << 2) | (unsigned)phase) + 1;
}

/* Posts one exchange of the slot's segment: to every other rank r the
 * `chunk_bytes` at out(r), from it into in(r). All requests go through the
 * table; on failure those posted are left for the caller to drain. */
static int exchange(mpidp_qallreduce_t *x, slot_t *sl, int phase, size_t chunk_bytes)
{
    char what[MPIDP_REQ_WHAT_LEN + 64];
    snprintf(what, sizeof what, "%s: %s 8-bit chunks (segment %zu/%zu)", x->what,
             phase == 0 ? "scattering" : "gathering", sl->seg + 1, x->n_segs);
    int tag = tag_of(x, sl->seg, phase);
    sl->n_reqs = 0;
    for (int k = 1; k < x->size; k++) {
        /* Ranks pair up in a rotation, so no rank is everybody's first peer. */
        int to = (x->rank + k) % x->size, from = (x->rank - k + x->size) % x->size;
        uint8_t *in = phase == 0 ? sl->recv + (size_t)from * chunk_bytes
                                 : sl->send + (size_t)from * chunk_bytes;
        const uint8_t *out = phase == 0 ? sl->send + (size_t)to * chunk_bytes
                                        : sl->send + (size_t)x->rank * chunk_bytes;
        for (int dir = 0; dir < 2; dir++) {
            mpidp_req_t slot;
            int rc = mpidp_reqtable_claim(x->reqs, what, &slot);
            if (rc != MPIDP_OK) return rc;
            MPI_Request req;
            rc = dir == 0 ? MPI_Irecv(in, (int)chunk_bytes, MPI_BYTE, from, tag, x->comm, &req)
                          : MPI_Isend(out, (int)chunk_bytes, MPI_BYTE, to, tag, x->comm, &req);
            rc = mpidp__post_done(x->reqs, slot, rc, req, x->comm, what, &sl->reqs[sl->n_reqs]);
            if (rc != MPIDP_OK) return rc;
            sl->n_reqs++;
        }
    }
    return MPIDP_OK;
}

static int start_segment(mpidp_qallreduce_t *x, slot_t *sl, size_t s)
{
    geom_t g = geometry(x, s);
    for (int r = 0; r < x->size; r++)
        encode_padded(sl->send + (size_t)r * g.chunk_bytes, x->data + g.start + (size_t)r * g.chunk,
                      1.0f, chunk_len(&g, r), g.chunk_bytes);
    /* The own chunk needs no message. */
    memcpy(sl->recv + (size_t)x->rank * g.chunk_bytes, sl->send + (size_t)x->rank * g.chunk_bytes,
           g.chunk_bytes);
    sl->seg = s;
    sl->state = SCATTER;
    return exchange(x, sl, 0, g.chunk_bytes);
}

/* The scatter of the slot's segment arrived: sum every rank's version of the
 * own chunk in rank order, scale, requantize into the own place of `send`,
 * and gather. */
static int reduce_own_chunk(mpidp_qallreduce_t *x, slot_t *sl)
{
    geom_t g = geometry(x, sl->seg);
    size_t own = chunk_len(&g, x->rank);
    const mpidp_q8_kernels_t *k = mpidp_q8_kernels();
    for (int r = 0; r < x->size && own > 0; r++)
        k->decode(sl->acc, sl->recv + (size_t)r * g.chunk_bytes, r > 0, own);
    float scale = x->average ? 1.0f / (float)x->size : 1.0f;
    encode_padded(sl->send + (size_t)x->rank * g.chunk_bytes, sl->acc, scale, own, g.chunk_bytes);
    sl->state = GATHER;
    return exchange(x, sl, 1, g.chunk_bytes);
}

/* The gather arrived: every chunk, the own one too, decoded into the tensor. */
static void deliver(mpidp_qallreduce_t *x, slot_t *sl)
{
    geom_t g = geometry(x, sl->seg);
    const mpidp_q8_kernels_t *k = mpidp_q8_kernels();
    for (int r = 0; r < x->size; r++)
        k->decode(x->data + g.start + (size_t)r * g.chunk, sl->send + (size_t)r * g.chunk_bytes, 0,
                  chunk_len(&g, r));
    sl->state = FREE;
    x->n_done++;
}

/* Starts segments in order while the slot each needs is free; *started counts. */
static int start_more(mpidp_qallreduce_t *x, int *started)
{
    while (x->next_start < x->n_segs) {
        slot_t *sl = &x->slots[x->next_start % x->n_slots];
        if (sl->state != FREE) return MPIDP_OK;
        int rc = start_segment(x, sl, x->next_start++);
        if (rc != MPIDP_OK) return rc;
        (*started)++;
    }
    return MPIDP_OK;
}

/* 1 when every request of the slot's exchange has completed (tested, not waited). */
static int exchange_arrived(mpidp_qallreduce_t *x, slot_t *sl, int *rc)
{
    while (sl->n_reqs > 0) {
        int arrived = 0;
        *rc = mpidp_reqtable_test(x->reqs, sl->reqs[sl->n_reqs - 1], &arrived);
        if (*rc != MPIDP_OK || !arrived) return 0;
        sl->n_reqs--;
    }
    *rc = MPIDP_OK;
    return 1;
}

/* Records the first failure (the detail too): an exchange may be half posted,
 * so the operation can never complete correctly; every later call says so. */
static int fail_sticky(mpidp_qallreduce_t *x, int rc)
{
    if (!x->failed) {
        x->failed = rc;
        snprintf(x->failure, sizeof x->failure, "%s", mpidp_error_detail());
    }
    return mpidp__fail(x->failed, "%s", x->failure);
}

static int progress(mpidp_qallreduce_t *x, int *done);

int mpidp_qallreduce_test(mpidp_qallreduce_t *x, int *done)
{
    if (x == NULL || done == NULL) return mpidp__fail(MPIDP_EINVAL, "qallreduce: NULL argument");
    if (x->failed) return fail_sticky(x, x->failed);
    int rc = progress(x, done);
    return rc == MPIDP_OK ? rc : fail_sticky(x, rc);
}

/* The request table's engine callback: progress, errors kept for test/wait. */
static void progress_engine(void *ctx)
{
    int done;
    mpidp_qallreduce_t *x = ctx;
    if (!x->failed) {
        int rc = progress(x, &done);
        if (rc != MPIDP_OK) {
            x->failed = rc;
            snprintf(x->failure, sizeof x->failure, "%s", mpidp_error_detail());
        }
    }
}

static int progress(mpidp_qallreduce_t *x, int *done)
{
    for (int progressed = 1; progressed;) {
        progressed = 0;
        for (size_t i = 0; i < x->n_slots; i++) {
            slot_t *sl = &x->slots[i];
            int rc = MPIDP_OK;
            if (sl->state == FREE) continue;
            if (!exchange_arrived(x, sl, &rc)) {
                if (rc != MPIDP_OK) return rc;
                continue;
            }
            if (sl->state == SCATTER) rc = reduce_own_chunk(x, sl);
            else deliver(x, sl);
            if (rc != MPIDP_OK) return rc;
            progressed = 1;
        }
        int rc = start_more(x, &progressed);
        if (rc != MPIDP_OK) return rc;
    }
    *done = x->n_done == x->n_segs;
    return MPIDP_OK;
}

mpidp_req_t mpidp_qallreduce_pending(const mpidp_qallreduce_t *x)
{
    for (size_t i = 0; x && i < x->n_slots; i++)
        if (x->slots[i].state != FREE && x->slots[i].n_reqs > 0)
            return x->slots[i].reqs[x->slots[i].n_reqs - 1];
    return MPIDP_REQ_NONE;
}

int mpidp_qallreduce_wait(mpidp_qallreduce_t *x, double timeout_s)
{
    if (x == NULL) return mpidp__fail(MPIDP_EINVAL, "qallreduce: NULL argument");
    for (;;) {
        int done = 0;
        int rc = mpidp_qallreduce_test(x, &done);
        if (rc != MPIDP_OK || done) return rc;
        /* Block on a request of the oldest segment in flight (the deadline
         * counts per request: progress). */
        const slot_t *oldest = NULL;
        for (size_t i = 0; i < x->n_slots; i++) {
            const slot_t *sl = &x->slots[i];
            if (sl->state != FREE && sl->n_reqs > 0 && (oldest == NULL || sl->seg < oldest->seg))
                oldest = sl;
        }
        if (oldest == NULL)
            return mpidp__fail(MPIDP_ESTATE, "%s: nothing in flight but not done", x->what);
        rc = mpidp_reqtable_wait(x->reqs, oldest->reqs[oldest->n_reqs - 1], timeout_s);
        if (rc != MPIDP_OK) return rc;
    }
}

/* The number of the next operation on `comm` (the same on every rank, since
 * each starts its operations on a communicator in one order), kept in an
 * attribute of the communicator. */
static void free_all(mpidp_qallreduce_t *x)
{
    for (size_t i = 0; x->slots && i < x->n_slots; i++) {
        slot_t *sl = &x->slots[i];
        free(sl->send), free(sl->recv), free(sl->acc), free(sl->reqs);
    }
    free(x->slots);
    free(x);
}

static int alloc_slots(mpidp_qallreduce_t *x)
{
    geom_t g = geometry(x, 0); /* the first segment is the longest */
    x->slots = calloc(x->n_slots, sizeof *x->slots);
    if (x->slots == NULL) return MPIDP_ENOMEM;
    size_t bytes = (size_t)x->size * g.chunk_bytes;
    for (size_t i = 0; i < x->n_slots; i++) {
        slot_t *sl = &x->slots[i];
        sl->send = malloc(bytes ? bytes : 1);
        sl->recv = malloc(bytes ? bytes : 1);
        sl->acc = malloc((g.chunk ? g.chunk : 1) * sizeof *sl->acc);
        sl->reqs = malloc(2 * (size_t)x->size * sizeof *sl->reqs);
        if (!sl->send || !sl->recv || !sl->acc || !sl->reqs) return MPIDP_ENOMEM;
    }
    return MPIDP_OK;
}

/* After a failed post: waits for what was posted (the other ranks posted
 * their side too, or time out on it). 1 when nothing is left in flight. */
static int drain(mpidp_qallreduce_t *x, double timeout_s)
{
    for (size_t i = 0; i < x->n_slots; i++)
        for (size_t k = 0; k < x->slots[i].n_reqs; k++)
            if (mpidp_reqtable_wait(x->reqs, x->slots[i].reqs[k], timeout_s) != MPIDP_OK) return 0;
    return 1;
}

int mpidp_qallreduce_start(MPI_Comm comm, const mpidp_tensor_t *t,
                           const mpidp_qallreduce_opts_t *opts, mpidp_reqtable_t *reqs,
                           mpidp_qallreduce_t **out)
{
    if (t == NULL || opts == NULL || reqs == NULL || out == NULL)
        return mpidp__fail(MPIDP_EINVAL, "qallreduce: NULL argument");
    const char *what = opts->what ? opts->what : "qallreduce";
    if (t->dtype != MPIDP_F32)
        return mpidp__fail(MPIDP_EDTYPE, "%s: 8-bit quantization takes a float32 tensor, got %s",
                           what, mpidp_dtype_name(t->dtype));
    if (t->device != MPIDP_DEV_CPU)
        return mpidp__fail(MPIDP_EDEVICE, "%s: expected a tensor in host memory", what);
    if (t->read_only) return mpidp__fail(MPIDP_EINVAL, "%s: the tensor is read-only", what);
    size_t seg = opts->segment_elems ? opts->segment_elems : MPIDP_QALLREDUCE_SEGMENT;
    int size, rank;
    int rc = MPI_Comm_size(comm, &size);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(comm, &rank);
    if (rc != MPI_SUCCESS) return mpidp__mpi_fail(rc, "%s: MPI_Comm_size", what);
    /* One chunk's records must fit one MPI count. */
    if (seg / (size_t)size / MPIDP_Q8_BLOCK + 1 > (size_t)INT_MAX / MPIDP_Q8_RECORD)
        return mpidp__fail(MPIDP_EINVAL, "%s: segments of %zu elements are too large", what, seg);
    unsigned op_tag = 0;
    rc = mpidp__next_op_number(comm, what, &op_tag);
    op_tag &= 511u;
    if (rc != MPIDP_OK) return rc;

    mpidp_qallreduce_t *x = calloc(1, sizeof *x);
    if (x == NULL) return mpidp__fail(MPIDP_ENOMEM, "%s", what);
    *x = (mpidp_qallreduce_t){.comm = comm, .size = size, .rank = rank, .reqs = reqs,
                              .data = t->data, .n = t->numel, .seg_elems = seg,
                              .average = opts->average != 0, .op_tag = op_tag};
    snprintf(x->what, sizeof x->what, "%s", what);
    x->n_segs = (t->numel + seg - 1) / seg;
    size_t w = opts->max_in_flight ? opts->max_in_flight : MPIDP_QALLREDUCE_IN_FLIGHT;
    if (w > 8) w = 8; /* segment numbers in tags are mod 16 */
    x->n_slots = x->n_segs < w ? (x->n_segs ? x->n_segs : 1) : w;
    if (alloc_slots(x) != MPIDP_OK) {
        free_all(x);
        return mpidp__fail(MPIDP_ENOMEM, "%s: buffers for %zu elements", what, t->numel);
    }
    int started = 0;
    rc = mpidp_reqtable_engine_add(reqs, progress_engine, x);
    if (rc != MPIDP_OK) {
        free_all(x);
        return rc;
    }
    rc = start_more(x, &started);
    if (rc != MPIDP_OK) {
        mpidp_reqtable_engine_remove(reqs, x);
        if (drain(x, opts->drain_timeout_s)) free_all(x); /* else MPI may still use the buffers */
        return rc;
    }
    *out = x;
    return MPIDP_OK;
}

int mpidp_qallreduce_free(mpidp_qallreduce_t *x)
{
    if (x == NULL) return MPIDP_OK;
    for (size_t i = 0; i < x->n_slots; i++) {
        slot_t *sl = &x->slots[i];
        int rc = MPIDP_OK;
        if (sl->state != FREE && !exchange_arrived(x, sl, &rc))
            return mpidp__fail(MPIDP_ESTATE, "%s: segment %zu is still in flight", x->what,
                               sl->seg);
    }
    mpidp_reqtable_engine_remove(x->reqs, x);
    free_all(x);
    return MPIDP_OK;
}

double mpidp_qallreduce_bytes_per_elem(int size)
{
    if (size < 1) return 0.0;
    return 2.0 * (double)(size - 1) / (double)size * MPIDP_Q8_RECORD / MPIDP_Q8_BLOCK;
}
