/* Parameter sync (see mpidp/paramsync.h). */
#include "mpidp/paramsync.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/allreduce.h"
#include "mpidp/convert.h"
#include "mpi_util.h"
#include "mpidp/pack.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "fail.h"

/* IDLE: nothing to read; POSTED: the allreduce is in flight; RECEIVED: the sum
 * is in the wire buffer, unread. */
enum { IDLE, POSTED, RECEIVED };

struct mpidp_paramsync {
    MPI_Comm comm;
    mpidp_reqtable_t *reqs;
    size_t n_params;
    float **p;            /* borrowed */
    size_t *numel;
    size_t *offset;       /* of each parameter in the flat layout */
    size_t total;
    float *ref;           /* total */
    void *wire_buf;       /* total wire elements */
    int wire;
    size_t chunk;
    double drain_timeout_s;
    char what[64];
    mpidp_allreduce_t *x;
    int state;
};

int mpidp_paramsync_merge_weights(int n_senders, long long batches_waited, float *a, float *b,
                                  float *c)
{
    if (n_senders < 1 || batches_waited < 0 || a == NULL || b == NULL || c == NULL)
        return mpidp__fail(MPIDP_EINVAL, "merge weights: need n_senders >= 1 and "
                           "batches_waited >= 0, got %d and %lld", n_senders, batches_waited);
    double n = n_senders, w = 2.0 * (double)batches_waited;
    *a = (float)(w / (n + w));
    *b = (float)(1.0 / (n + w));
    *c = (float)(n / (n + w));
    return MPIDP_OK;
}

static void free_all(mpidp_paramsync_t *s)
{
    free(s->p);
    free(s->numel);
    free(s->offset);
    free(s->ref);
    free(s->wire_buf);
    free(s);
}

int mpidp_paramsync_create(const mpidp_paramsync_config_t *cfg, mpidp_paramsync_t **out)
{
    if (cfg == NULL || out == NULL || cfg->reqs == NULL || (cfg->n_params && !(cfg->params && cfg->numel)))
        return mpidp__fail(MPIDP_EINVAL, "paramsync: NULL argument");
    if (cfg->wire != MPIDP_F32 && cfg->wire != MPIDP_BF16 && cfg->wire != MPIDP_F16)
        return mpidp__fail(MPIDP_EINVAL, "paramsync: wire dtype must be float32, bfloat16 or float16");
    if (cfg->chunk_elems < 1 || cfg->chunk_elems > (size_t)INT_MAX)
        return mpidp__fail(MPIDP_EINVAL, "paramsync: chunk_elems must be in 1..INT_MAX");
    mpidp_paramsync_t *s = calloc(1, sizeof *s);
    size_t np = cfg->n_params ? cfg->n_params : 1;
    if (s == NULL) return mpidp__fail(MPIDP_ENOMEM, "paramsync");
    s->p = calloc(np, sizeof *s->p);
    s->numel = calloc(np, sizeof *s->numel);
    s->offset = calloc(np, sizeof *s->offset);
    if (!s->p || !s->numel || !s->offset) {
        free_all(s);
        return mpidp__fail(MPIDP_ENOMEM, "paramsync: layout of %zu parameters", cfg->n_params);
    }
    for (size_t i = 0; i < cfg->n_params; i++) {
        if (cfg->params[i] == NULL && cfg->numel[i] != 0) {
            free_all(s);
            return mpidp__fail(MPIDP_EINVAL, "paramsync: parameter %zu has no data", i);
        }
        s->p[i] = cfg->params[i];
        s->numel[i] = cfg->numel[i];
        s->offset[i] = s->total;
        s->total += cfg->numel[i];
    }
    s->ref = malloc((s->total ? s->total : 1) * sizeof(float));
    s->wire_buf = malloc((s->total ? s->total : 1) * mpidp_dtype_size(cfg->wire));
    if (!s->ref || !s->wire_buf) {
        size_t total = s->total;
        free_all(s);
        return mpidp__fail(MPIDP_ENOMEM, "paramsync: buffers of %zu elements", total);
    }
    s->comm = cfg->comm;
    s->reqs = cfg->reqs;
    s->n_params = cfg->n_params;
    s->wire = cfg->wire;
    s->chunk = cfg->chunk_elems;
    s->drain_timeout_s = cfg->drain_timeout_s;
    snprintf(s->what, sizeof s->what, "%s", cfg->what ? cfg->what : "parameter sync");
    s->state = IDLE;
    mpidp_paramsync_set_reference(s);
    *out = s;
    return MPIDP_OK;
}

int mpidp_paramsync_free(mpidp_paramsync_t *s)
{
    if (s == NULL) return MPIDP_OK;
    if (s->state == POSTED)
        return mpidp__fail(MPIDP_ESTATE, "%s: cannot free while a sync is in flight", s->what);
    free_all(s);
    return MPIDP_OK;
}

int mpidp_paramsync_close(mpidp_paramsync_t *s, double timeout_s)
{
    if (s != NULL && s->state == POSTED) {
        if (mpidp_mpi_finalized())
            return mpidp__fail(MPIDP_ESTATE, "%s: MPI was finalized with a sync in flight", s->what);
        int rc = mpidp_paramsync_wait(s, timeout_s);
        if (rc != MPIDP_OK) return rc;
    }
    return mpidp_paramsync_free(s);
}

int mpidp_paramsync_set_reference(mpidp_paramsync_t *s)
{
    if (s == NULL) return mpidp__fail(MPIDP_EINVAL, "paramsync: NULL argument");
    for (size_t i = 0; i < s->n_params; i++)
        if (s->numel[i]) memcpy(s->ref + s->offset[i], s->p[i], s->numel[i] * sizeof(float));
    return MPIDP_OK;
}

int mpidp_paramsync_send(mpidp_paramsync_t *s, int zero)
{
    if (s == NULL) return mpidp__fail(MPIDP_EINVAL, "paramsync: NULL argument");
    if (s->state == POSTED) return mpidp__fail(MPIDP_ESTATE, "%s: a sync is already in flight", s->what);
    const mpidp_pack_kernels_t *k = mpidp_pack_kernels();
    if (zero) memset(s->wire_buf, 0, s->total * mpidp_dtype_size(s->wire));
    for (size_t i = 0; i < s->n_params && !zero; i++) {
        const float *p = s->p[i], *r = s->ref + s->offset[i];
        size_t n = s->numel[i], off = s->offset[i];
        if (s->wire == MPIDP_BF16) k->pack_bf16((uint16_t *)s->wire_buf + off, p, r, 1.0f, n);
        else if (s->wire == MPIDP_F16) {
            k->pack_fp16((uint16_t *)s->wire_buf + off, p, r, 1.0f, n);
            mpidp_fp16_count_overflow((uint16_t *)s->wire_buf + off, p, r, n);
        }
        else k->merge_f32((float *)s->wire_buf + off, p, r, 0.0f, 1.0f, -1.0f, n);
    }
    mpidp_tensor_t t = {.data = s->wire_buf, .numel = s->total, .dtype = s->wire,
                        .device = MPIDP_DEV_CPU};
    mpidp_allreduce_opts_t opts = {.op = MPIDP_OP_SUM, .wire = -1, .chunk_elems = s->chunk,
                                   .max_in_flight = 0, .drain_timeout_s = s->drain_timeout_s,
                                   .what = s->what};
    int rc = mpidp_allreduce_start(s->comm, &t, &opts, s->reqs, &s->x);
    if (rc != MPIDP_OK) return rc;
    s->state = POSTED;
    return MPIDP_OK;
}

/* The allreduce has completed: its sum is in the wire buffer. */
static int received(mpidp_paramsync_t *s)
{
    int rc = mpidp_allreduce_free(s->x);
    if (rc != MPIDP_OK) return rc;
    s->x = NULL;
    s->state = RECEIVED;
    return MPIDP_OK;
}

int mpidp_paramsync_test(mpidp_paramsync_t *s, int *done)
{
    if (s == NULL || done == NULL) return mpidp__fail(MPIDP_EINVAL, "paramsync: NULL argument");
    *done = 1;
    if (s->state != POSTED) return MPIDP_OK;
    int rc = mpidp_allreduce_test(s->x, done);
    if (rc == MPIDP_OK && *done) rc = received(s);
    return rc;
}

int mpidp_paramsync_wait(mpidp_paramsync_t *s, double timeout_s)
{
    if (s == NULL) return mpidp__fail(MPIDP_EINVAL, "paramsync: NULL argument");
    if (s->state != POSTED) return MPIDP_OK;
    int rc = mpidp_allreduce_wait(s->x, timeout_s);
    return rc == MPIDP_OK ? received(s) : rc;
}

/* The sum can be read now (and only once). */
static int take_sum(mpidp_paramsync_t *s, const char *op)
{
    if (s->state == POSTED)
        return mpidp__fail(MPIDP_ESTATE, "%s: %s before the sync in flight completed (wait first)",
                           s->what, op);
    if (s->state == IDLE)
        return mpidp__fail(MPIDP_ESTATE, "%s: %s with no received sync to read", s->what, op);
    s->state = IDLE;
    return MPIDP_OK;
}

int mpidp_paramsync_merge(mpidp_paramsync_t *s, float a, float b, float c)
{
    if (s == NULL) return mpidp__fail(MPIDP_EINVAL, "paramsync: NULL argument");
    int rc = take_sum(s, "merge");
    if (rc != MPIDP_OK) return rc;
    const mpidp_pack_kernels_t *k = mpidp_pack_kernels();
    for (size_t i = 0; i < s->n_params; i++) {
        float *p = s->p[i];
        const float *r = s->ref + s->offset[i];
        size_t n = s->numel[i], off = s->offset[i];
        if (s->wire == MPIDP_BF16) k->unpack_bf16(p, (uint16_t *)s->wire_buf + off, r, a, b, c, n);
        else if (s->wire == MPIDP_F16) k->unpack_fp16(p, (uint16_t *)s->wire_buf + off, r, a, b, c, n);
        else k->merge_f32(p, (float *)s->wire_buf + off, r, a, b, c, n);
    }
    return MPIDP_OK;
}

int mpidp_paramsync_grad_into(mpidp_paramsync_t *s, size_t n_grads, float *const *grads,
                              const size_t *numel, float scale)
{
    if (s == NULL || (n_grads && (grads == NULL || numel == NULL)))
        return mpidp__fail(MPIDP_EINVAL, "paramsync: NULL argument");
    if (n_grads != s->n_params)
        return mpidp__fail(MPIDP_EINVAL, "grads: expected %zu tensors, got %zu", s->n_params, n_grads);
    for (size_t i = 0; i < s->n_params; i++) {
        if (numel[i] != s->numel[i])
            return mpidp__fail(MPIDP_EINVAL, "grads[%zu]: expected %zu elements, got %zu", i,
                               s->numel[i], numel[i]);
        if (grads[i] == NULL && s->numel[i] != 0)
            return mpidp__fail(MPIDP_EINVAL, "grads[%zu]: no data", i);
    }
    int rc = take_sum(s, "grad_into");
    if (rc != MPIDP_OK) return rc;
    const mpidp_pack_kernels_t *k = mpidp_pack_kernels();
    for (size_t i = 0; i < s->n_params; i++) {
        size_t n = s->numel[i], off = s->offset[i];
        /* g = scale*S: the merge kernels with a = 0 do not read dst (so an old
         * NaN gradient cannot leak in) and with no ref add nothing more. */
        if (s->wire == MPIDP_BF16) k->unpack_bf16(grads[i], (uint16_t *)s->wire_buf + off, NULL, 0.0f, scale, 0.0f, n);
        else if (s->wire == MPIDP_F16) k->unpack_fp16(grads[i], (uint16_t *)s->wire_buf + off, NULL, 0.0f, scale, 0.0f, n);
        else k->merge_f32(grads[i], (float *)s->wire_buf + off, NULL, 0.0f, scale, 0.0f, n);
    }
    return MPIDP_OK;
}

int mpidp_paramsync_abandon(mpidp_paramsync_t *s)
{
    if (s == NULL) return mpidp__fail(MPIDP_EINVAL, "paramsync: NULL argument");
    if (s->state != POSTED) return MPIDP_OK;
    /* The allreduce refuses to be freed while a chunk is live. */
    int rc = mpidp_allreduce_free(s->x);
    if (rc != MPIDP_OK) return rc;
    s->x = NULL;
    s->state = IDLE;
    return MPIDP_OK;
}

int mpidp_paramsync_restore(mpidp_paramsync_t *s)
{
    if (s == NULL) return mpidp__fail(MPIDP_EINVAL, "paramsync: NULL argument");
    if (s->state == POSTED)
        return mpidp__fail(MPIDP_ESTATE, "%s: restore while a sync is in flight", s->what);
    for (size_t i = 0; i < s->n_params; i++)
        if (s->numel[i]) memcpy(s->p[i], s->ref + s->offset[i], s->numel[i] * sizeof(float));
    return MPIDP_OK;
}

size_t mpidp_paramsync_numel(const mpidp_paramsync_t *s) { return s ? s->total : 0; }
size_t mpidp_paramsync_wire_bytes(const mpidp_paramsync_t *s)
{
    return s ? s->total * mpidp_dtype_size(s->wire) : 0;
}
int mpidp_paramsync_pending(const mpidp_paramsync_t *s) { return s && s->state == POSTED; }
