/* The gradient reducer (see mpidp/reducer.h). */
#include "mpidp/reducer.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/allreduce.h"
#include "mpidp/convert.h"
#include "mpi_util.h"
#include "post.h"
#include "mpidp/mpiops.h"
#include "mpidp/pack.h"
#include "mpidp/qallreduce.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "reducer_internal.h"
#include "fail.h"

/* A float32 bucket whose data travel quantized to 8 bits (mpidp/qallreduce.h);
 * its flags go beside them in a float32 allreduce, exactly. */
static int bk_quantized(const mpidp_reducer_t *r, const bucket_t *bk)
{
    return r->wire == MPIDP_U8 && bk->info.dtype == MPIDP_F32;
}

/* The dtype MPI reduces for this bucket. */
static int comm_dtype(const mpidp_reducer_t *r, const bucket_t *bk)
{
    return bk_compressed(r, bk) ? r->wire : bk->info.dtype;
}

/* The pass's per-parameter and per-bucket state (what reducer_pass.c decides
 * from): allocated with the reducer, cleared at each reset. */
static int pass_alloc(mpidp_reducer_t *r)
{
    size_t np = r->n_params ? r->n_params : 1, nb = r->n_buckets ? r->n_buckets : 1;
    r->was_none = calloc(np, 1);
    r->local_has = calloc(np, 1);
    r->after = calloc(np, 1);
    r->version = calloc(nb, sizeof *r->version);
    r->delivered = calloc(nb, 1);
    r->applied = calloc(nb, 1);
    r->dev_deliver = calloc(np, 1);
    return r->was_none && r->local_has && r->after && r->version && r->delivered && r->applied &&
                   r->dev_deliver
               ? MPIDP_OK
               : MPIDP_ENOMEM;
}

static void pass_free(mpidp_reducer_t *r)
{
    free(r->was_none);
    free(r->local_has);
    free(r->after);
    free(r->version);
    free(r->delivered);
    free(r->applied);
    free(r->dev_deliver);
}

static void pass_clear(mpidp_reducer_t *r)
{
    memset(r->was_none, 0, r->n_params);
    memset(r->local_has, 0, r->n_params);
    memset(r->after, 0, r->n_params);
    memset(r->delivered, 0, r->n_buckets);
    memset(r->applied, 0, r->n_buckets);
    memset(r->dev_deliver, 0, r->n_params);
    r->finalized = 0;
}

static void free_reducer(mpidp_reducer_t *r)
{
    if (r == NULL) return;
    free(r->param_bucket);
    free(r->param_offset);
    free(r->param_numel);
    free(r->param_flag);
    free(r->ready);
    free(r->bucket_first);
    free(r->members);
    mpidp__hier_free(r);
    for (size_t b = 0; r->buckets && b < r->n_buckets; b++) free(r->buckets[b].comm);
    free(r->buckets);
    pass_free(r);
    free(r);
}

/* Bucket b: its planned layout `info`, the caller's tensor checked against
 * it, and its communication buffer. */
static int init_bucket(mpidp_reducer_t *r, const mpidp_reducer_config_t *cfg, size_t b,
                       mpidp_bucket_info_t info)
{
    bucket_t *bk = &r->buckets[b];
    const mpidp_tensor_t *t = &cfg->bucket_tensors[b];
    bk->info = info;
    int dt = info.dtype;
    size_t count = info.numel + info.n_params;
    if (t->numel != count || (int)t->dtype != dt || t->device != MPIDP_DEV_CPU || t->read_only ||
        (t->data == NULL && count > 0))
        return mpidp__fail(MPIDP_EINVAL, "reducer: bucket %zu: expected a writable host tensor of "
                           "%zu %s elements, got %zu %s%s%s", b, count, mpidp_dtype_name(dt),
                           t->numel, mpidp_dtype_name(t->dtype),
                           t->device != MPIDP_DEV_CPU ? " in device memory" : "",
                           t->read_only ? " (read-only)" : "");
    bk->data = t->data;
    if (mpidp_mpi_datatype(dt) == MPI_DATATYPE_NULL)
        return mpidp__fail(MPIDP_EDTYPE, "reducer: cannot reduce %s gradients", mpidp_dtype_name(dt));
    if (r->wire != -1 && dt != MPIDP_F32 && dt != r->wire)
        return mpidp__fail(MPIDP_EDTYPE, "reducer: %s gradients cannot travel as %s (wire "
                           "compression takes float32 to bfloat16, float16 or uint8)",
                           mpidp_dtype_name(dt), mpidp_dtype_name(cfg->wire_dtype));
    if (count > (size_t)INT_MAX)
        return mpidp__fail(MPIDP_EINVAL, "reducer: bucket %zu exceeds INT_MAX elements", b);
    if (!r->device && (bk_compressed(r, bk) || r->separate)) {
        bk->comm = malloc((count + 1) * mpidp_dtype_size(comm_dtype(r, bk)));
        if (bk->comm == NULL) return mpidp__fail(MPIDP_ENOMEM, "reducer: wire buffer of bucket %zu", b);
    }
    bk->pending = info.n_params;
    bk->state = MPIDP_BUCKET_COLLECTING;
    return MPIDP_OK;
}

/* Plans the layout (mpidp_bucket_plan, into r's per-parameter arrays),
 * checks the caller's buckets against it, numbers each parameter's flag
 * within its bucket (its place in index order) and builds the per-bucket
 * parameter lists. */
static int init_layout(mpidp_reducer_t *r, const mpidp_reducer_config_t *cfg)
{
    size_t np = r->n_params, nb = 0;
    mpidp_bucket_info_t *info = malloc((np ? np : 1) * sizeof *info);
    r->bucket_first = calloc(np + 1, sizeof *r->bucket_first);
    r->members = malloc((np ? np : 1) * sizeof *r->members);
    r->buckets = calloc(np ? np : 1, sizeof *r->buckets);
    if (info == NULL || r->bucket_first == NULL || r->members == NULL || r->buckets == NULL) {
        free(info);
        return mpidp__fail(MPIDP_ENOMEM, "reducer: layout of %zu parameters", np);
    }
    int rc = mpidp_bucket_plan(cfg->param_numel, cfg->param_dtype, np, cfg->first_cap, cfg->cap,
                               r->param_bucket, r->param_offset, info, &nb);
    if (rc == MPIDP_OK && nb != cfg->n_buckets)
        rc = mpidp__fail(MPIDP_EINVAL, "reducer: %zu bucket tensors for a plan of %zu buckets",
                         cfg->n_buckets, nb);
    for (size_t b = 0; rc == MPIDP_OK && b < nb; b++) {
        r->n_buckets = b + 1;  /* what free_reducer releases */
        rc = init_bucket(r, cfg, b, info[b]);
    }
    free(info);
    if (rc != MPIDP_OK) return rc;
    size_t *seen = r->bucket_first + 1; /* counts per bucket, turned into offsets below */
    for (size_t i = 0; i < np; i++) {
        r->param_numel[i] = cfg->param_numel[i];
        r->param_flag[i] = seen[r->param_bucket[i]]++;
    }
    for (size_t b = 0; b < nb; b++) r->bucket_first[b + 1] += r->bucket_first[b];
    for (size_t i = 0; i < np; i++)
        r->members[r->bucket_first[r->param_bucket[i]] + r->param_flag[i]] = i;
    return MPIDP_OK;
}

int mpidp_reducer_create(const mpidp_reducer_config_t *cfg, mpidp_reducer_t **out)
{
    if (cfg == NULL || out == NULL || cfg->reqs == NULL)
        return mpidp__fail(MPIDP_EINVAL, "reducer: NULL argument");
    size_t np = cfg->n_params;
    if (np > 0 && (cfg->param_numel == NULL || cfg->param_dtype == NULL))
        return mpidp__fail(MPIDP_EINVAL, "reducer: missing parameter sizes or dtypes");
    if (cfg->n_buckets > 0 && cfg->bucket_tensors == NULL)
        return mpidp__fail(MPIDP_EINVAL, "reducer: missing bucket tensors");
    if (cfg->wire_dtype != -1 && cfg->wire_dtype != MPIDP_BF16 && cfg->wire_dtype != MPIDP_F16 &&
        cfg->wire_dtype != MPIDP_U8)
        return mpidp__fail(MPIDP_EINVAL, "reducer: wire dtype must be bfloat16, float16 or uint8");

    mpidp_reducer_t *r = calloc(1, sizeof *r);
    if (r == NULL) return mpidp__fail(MPIDP_ENOMEM, "reducer");
    r->n_params = np;
    r->param_bucket = malloc((np ? np : 1) * sizeof *r->param_bucket);
    r->param_offset = malloc((np ? np : 1) * sizeof *r->param_offset);
    r->param_numel = malloc((np ? np : 1) * sizeof *r->param_numel);
    r->param_flag = malloc((np ? np : 1) * sizeof *r->param_flag);
    r->ready = calloc(np ? np : 1, 1);
    if (!r->param_bucket || !r->param_offset || !r->param_numel || !r->param_flag || !r->ready) {
        free_reducer(r);
        return mpidp__fail(MPIDP_ENOMEM, "reducer layout for %zu parameters", np);
    }
    int rc = MPI_Comm_size(cfg->comm, &r->size);
    if (rc != MPI_SUCCESS) {
        free_reducer(r);
        return mpidp__mpi_fail(rc, "MPI_Comm_size");
    }
    r->comm = cfg->comm;
    r->divisor = r->size;
    r->reqs = cfg->reqs;
    r->wire = cfg->wire_dtype;
    r->drain_timeout_s = cfg->drain_timeout_s;
    r->separate = cfg->separate != 0;
    r->device = cfg->device != 0;
    r->staged = cfg->staged != 0 || r->device;
    if (r->device && (r->wire != -1 || cfg->hierarchical)) {
        free_reducer(r);
        return mpidp__fail(MPIDP_EINVAL, "reducer: device-resident buckets travel in their own "
                           "dtype, not hierarchically");
    }
    r->last_hook_progress = -HUGE_VAL; /* the first hook progresses */
    snprintf(r->name, sizeof r->name, "%s", cfg->name ? cfg->name : "reducer");
    rc = init_layout(r, cfg);
    if (rc == MPIDP_OK && pass_alloc(r) != MPIDP_OK)
        rc = mpidp__fail(MPIDP_ENOMEM, "reducer: pass state of %zu buckets", r->n_buckets);
    if (rc == MPIDP_OK) rc = mpidp__hier_init(r, cfg);
    if (rc != MPIDP_OK) {
        free_reducer(r); /* the detail was recorded before: free touches nothing of it */
        return rc;
    }
    *out = r;
    return MPIDP_OK;
}

size_t mpidp_reducer_bucket_params(const mpidp_reducer_t *r, size_t b, const size_t **params)
{
    if (r == NULL || b >= r->n_buckets || params == NULL) return 0;
    *params = r->members + r->bucket_first[b];
    return r->bucket_first[b + 1] - r->bucket_first[b];
}

const size_t *mpidp_reducer_members(const mpidp_reducer_t *r) { return r ? r->members : NULL; }

int mpidp_reducer_destroy(mpidp_reducer_t *r)
{
    if (r == NULL) return MPIDP_OK;
    for (size_t b = 0; b < r->n_buckets; b++)
        if (r->buckets[b].state == MPIDP_BUCKET_POSTED)
            return mpidp__fail(MPIDP_ESTATE, "%s: bucket %zu is still in flight", r->name, b);
    free_reducer(r);
    return MPIDP_OK;
}

int mpidp_reducer_close(mpidp_reducer_t *r, double timeout_s)
{
    /* The wait's failure shows in what destroy finds still in flight. */
    if (r != NULL && r->finalized && !mpidp_mpi_finalized()) (void)mpidp_reducer_wait_all(r, timeout_s);
    return mpidp_reducer_destroy(r);
}

static void *element(const bucket_t *bk, size_t index)
{
    return (char *)bk->data + index * mpidp_dtype_size(bk->info.dtype);
}

/* Flags are 1 or 0 in the bucket's dtype (bf16 1.0 = 0x3F80, fp16 1.0 = 0x3C00). */
static void set_flag(bucket_t *bk, size_t flag, int value)
{
    void *p = element(bk, bk->info.numel + flag);
    switch (bk->info.dtype) {
    case MPIDP_F32: *(float *)p = value ? 1.0f : 0.0f; break;
    case MPIDP_F64: *(double *)p = value ? 1.0 : 0.0; break;
    case MPIDP_BF16: *(uint16_t *)p = value ? 0x3F80 : 0; break;
    case MPIDP_F16: *(uint16_t *)p = value ? 0x3C00 : 0; break;
    }
}

/* Reads a flag after completion: from the communication buffer in separate
 * mode (results stay there), else from the bucket (unpacked into it). */
static int flag_is_set(const mpidp_reducer_t *r, const bucket_t *bk, size_t flag)
{
    int in_comm = r->separate && !r->device; /* device mode reduces the flags in place */
    int dtype = in_comm ? comm_dtype(r, bk) : bk->info.dtype;
    const void *p = in_comm
        ? (const char *)bk->comm + (bk->info.numel + flag) * mpidp_dtype_size(dtype)
        : element(bk, bk->info.numel + flag);
    switch (dtype) {
    case MPIDP_F32: return *(const float *)p > 0.0f;
    case MPIDP_F64: return *(const double *)p > 0.0;
    case MPIDP_BF16: return mpidp_f32_from_bf16(*(const uint16_t *)p) > 0.0f;
    case MPIDP_F16: return mpidp_f32_from_fp16(*(const uint16_t *)p) > 0.0f;
    }
    return 0;
}

/* Averaging is done by scaling before the sum (fused into the pack when the
 * bucket travels compressed), so the result is the mean the moment the
 * collective completes. Half-precision buckets are rare (CPU training keeps
 * fp32 master weights); they are scaled through the exact conversions. */
static void scale_data(bucket_t *bk, double s)
{
    const mpidp_pack_kernels_t *k = mpidp_pack_kernels();
    size_t n = bk->info.numel;
    uint16_t *h = bk->data;
    switch (bk->info.dtype) {
    case MPIDP_F32: k->scale_f32(bk->data, (float)s, n); break;
    case MPIDP_F64: k->scale_f64(bk->data, s, n); break;
    case MPIDP_BF16:
        for (size_t i = 0; i < n; i++) h[i] = mpidp_bf16_from_f32(mpidp_f32_from_bf16(h[i]) * (float)s);
        break;
    case MPIDP_F16:
        for (size_t i = 0; i < n; i++) h[i] = mpidp_fp16_from_f32(mpidp_f32_from_fp16(h[i]) * (float)s);
        break;
    }
}

static int post_bucket(mpidp_reducer_t *r, size_t b);

/* Posts, strictly in bucket order, every bucket that is full (and, in staged
 * mode, staged by the caller). */
static int post_in_order(mpidp_reducer_t *r)
{
    while (r->next_to_post < r->n_buckets) {
        const bucket_t *bk = &r->buckets[r->next_to_post];
        if (bk->pending != 0 || (r->staged && !bk->staged_in)) break;
        int rc = post_bucket(r, r->next_to_post);
        if (rc != MPIDP_OK) return rc;
        r->next_to_post++;
    }
    return MPIDP_OK;
}

/* Posts bucket b's sum of `count` elements of `buf` in dtype `wire_dtype`. */
static int post_plain(mpidp_reducer_t *r, size_t b, void *buf, size_t count, int wire_dtype)
{
    bucket_t *bk = &r->buckets[b];
    char what[MPIDP_REQ_WHAT_LEN + 64]; /* the table keeps MPIDP_REQ_WHAT_LEN of it */
    snprintf(what, sizeof what, "%s: MPI_Iallreduce of gradient bucket %zu/%zu (%zu %s)", r->name,
             b + 1, r->n_buckets, bk->info.numel, mpidp_dtype_name(wire_dtype));
    return mpidp__post_iallreduce(r->comm, r->reqs, buf, count, MPIDP_OP_SUM, wire_dtype, what,
                                  &bk->req);
}

/* Posts bucket b's flags (an exact float32 allreduce: collectives go in
 * bucket order on every rank) and then its data's quantized allreduce, whose
 * point-to-point exchanges need no order. */
static int post_quantized(mpidp_reducer_t *r, size_t b, float *buf)
{
    bucket_t *bk = &r->buckets[b];
    char what[MPIDP_REQ_WHAT_LEN + 64];
    snprintf(what, sizeof what, "%s: MPI_Iallreduce of bucket %zu/%zu's flags", r->name, b + 1,
             r->n_buckets);
    int rc = mpidp__post_iallreduce(r->comm, r->reqs, buf + bk->info.numel, bk->info.n_params,
                                    MPIDP_OP_SUM, MPIDP_F32, what, &bk->req);
    if (rc != MPIDP_OK) return rc;
    mpidp_tensor_t t = {.data = buf, .numel = bk->info.numel, .dtype = MPIDP_F32,
                        .device = MPIDP_DEV_CPU};
    mpidp_qallreduce_opts_t o = {.drain_timeout_s = r->drain_timeout_s, .what = r->name};
    rc = mpidp_qallreduce_start(r->comm, &t, &o, r->reqs, &bk->q);
    if (rc != MPIDP_OK) bk->state = MPIDP_BUCKET_POSTED; /* the flags are in flight: keep the buffers */
    return rc;
}

/* Device mode: the caller has started the data's reduction where it lives
 * (scaled there); the flags, which the host decides from, are summed here. */
static int post_flags(mpidp_reducer_t *r, size_t b)
{
    bucket_t *bk = &r->buckets[b];
    if (r->size == 1) return reducer_complete_bucket(r, bk);
    char what[MPIDP_REQ_WHAT_LEN + 64];
    snprintf(what, sizeof what, "%s: MPI_Iallreduce of bucket %zu/%zu's flags (its data on the "
             "device)", r->name, b + 1, r->n_buckets);
    int rc = mpidp__post_iallreduce(r->comm, r->reqs, element(bk, bk->info.numel), bk->info.n_params,
                                    MPIDP_OP_SUM, bk->info.dtype, what, &bk->req);
    if (rc != MPIDP_OK) return rc;
    bk->state = MPIDP_BUCKET_POSTED;
    return MPIDP_OK;
}

static int post_bucket(mpidp_reducer_t *r, size_t b)
{
    bucket_t *bk = &r->buckets[b];
    if (r->device) return post_flags(r, b);
    /* One rank sums nothing, but a quantized bucket still rounds as in a larger job. */
    if (r->size == 1 && bk->comm == NULL && !bk_quantized(r, bk)) return reducer_complete_bucket(r, bk);
    size_t count = bk->info.numel + bk->info.n_params;
    void *buf = bk->data;
    int wire_dtype = comm_dtype(r, bk);
    const mpidp_pack_kernels_t *k = mpidp_pack_kernels();
    float s = 1.0f / (float)r->divisor;
    if (bk_compressed(r, bk)) {
        /* Scale and compress in one pass; the flags (1 or 0) travel along. */
        const float *src = bk->data;
        uint16_t *w = bk->comm;
        if (r->wire == MPIDP_BF16) {
            k->pack_bf16(w, src, NULL, s, bk->info.numel);
            k->pack_bf16(w + bk->info.numel, src + bk->info.numel, NULL, 1.0f, bk->info.n_params);
        } else {
            k->pack_fp16(w, src, NULL, s, bk->info.numel);
            mpidp_fp16_count_overflow(w, src, NULL, bk->info.numel);
            k->pack_fp16(w + bk->info.numel, src + bk->info.numel, NULL, 1.0f, bk->info.n_params);
        }
        buf = bk->comm;
    } else if (r->separate) {
        /* Copy (scaled) into the communication buffer, flags unscaled. */
        size_t esize = mpidp_dtype_size(bk->info.dtype);
        if (bk->info.dtype == MPIDP_F32) {
            k->merge_f32(bk->comm, bk->data, NULL, 0.0f, s, 0.0f, bk->info.numel);
        } else {
            memcpy(bk->comm, bk->data, bk->info.numel * esize);
            bucket_t tmp = *bk;
            tmp.data = bk->comm;
            scale_data(&tmp, 1.0 / (double)r->divisor);
        }
        memcpy((char *)bk->comm + bk->info.numel * esize, element(bk, bk->info.numel),
               bk->info.n_params * esize);
        buf = bk->comm;
    } else {
        scale_data(bk, 1.0 / (double)r->divisor);
    }
    if (r->separate) {
        /* The gradients now live in the communication buffer; the bucket starts
         * from zero, ready for whatever the user does before delivery. */
        memset(bk->data, 0, bk->info.numel * mpidp_dtype_size(bk->info.dtype));
    }
    int rc = r->hier          ? mpidp__hier_post(r, b, buf, wire_dtype)
             : bk_quantized(r, bk) ? post_quantized(r, b, buf)
                                   : post_plain(r, b, buf, count, wire_dtype);
    if (rc != MPIDP_OK) return rc;
    bk->state = MPIDP_BUCKET_POSTED;
    return MPIDP_OK;
}

/* The bucket's collective has completed: bring compressed results home
 * (separate mode leaves them for mpidp_reducer_deliver). */
int mpidp_reducer_mark_ready(mpidp_reducer_t *r, size_t param, int has_grad)
{
    if (r == NULL || param >= r->n_params)
        return mpidp__fail(MPIDP_EINVAL, "reducer: no parameter %zu", param);
    if (r->ready[param])
        return mpidp__fail(MPIDP_ESTATE,
                           "%s: parameter %zu received a second gradient in one backward pass "
                           "after its bucket was sent (reentrant checkpointing or a second "
                           "backward through the same parameters without a step?)",
                           r->name, param);
    bucket_t *bk = &r->buckets[r->param_bucket[param]];
    r->ready[param] = 1;
    r->n_ready++;
    /* Staged: the caller zeroes the slice where the gradients live, and the
     * host bytes may still be the source of the previous pass's copy back. */
    if (!has_grad && !r->staged)
        memset(element(bk, r->param_offset[param]), 0,
               r->param_numel[param] * mpidp_dtype_size(bk->info.dtype));
    set_flag(bk, r->param_flag[param], has_grad);
    bk->pending--;
    return post_in_order(r);
}

int mpidp_reducer_next_to_stage(const mpidp_reducer_t *r, size_t from, size_t *b)
{
    if (r == NULL || !r->staged) return 0;
    /* Any full bucket may be staged early; posting still follows the order. */
    for (size_t k = from > r->next_to_post ? from : r->next_to_post; k < r->n_buckets; k++) {
        const bucket_t *bk = &r->buckets[k];
        if (bk->pending == 0 && !bk->staged_in && bk->state == MPIDP_BUCKET_COLLECTING) {
            if (b) *b = k;
            return 1;
        }
    }
    return 0;
}

int mpidp_reducer_staged(mpidp_reducer_t *r, size_t b)
{
    if (r == NULL || b >= r->n_buckets) return mpidp__fail(MPIDP_EINVAL, "reducer: no bucket %zu", b);
    bucket_t *bk = &r->buckets[b];
    if (!r->staged || bk->pending != 0 || bk->staged_in || bk->state != MPIDP_BUCKET_COLLECTING)
        return mpidp__fail(MPIDP_ESTATE, "%s: bucket %zu is not waiting to be staged", r->name, b);
    bk->staged_in = 1;
    return post_in_order(r);
}

int mpidp_reducer_needs_unstaging(const mpidp_reducer_t *r, size_t b)
{
    return r && b < r->n_buckets && r->staged && !r->separate &&
           r->buckets[b].state == MPIDP_BUCKET_DONE && !r->buckets[b].home;
}

int mpidp_reducer_unstaged(mpidp_reducer_t *r, size_t b)
{
    if (!mpidp_reducer_needs_unstaging(r, b))
        return mpidp__fail(MPIDP_ESTATE, "reducer: bucket %zu has no result to copy back", b);
    r->buckets[b].home = 1;
    return MPIDP_OK;
}

int mpidp_reducer_is_ready(const mpidp_reducer_t *r, size_t param)
{
    return r != NULL && param < r->n_params && r->ready[param];
}

size_t mpidp_reducer_n_ready(const mpidp_reducer_t *r) { return r ? r->n_ready : 0; }

mpidp_bucket_state_t mpidp_reducer_bucket_state(const mpidp_reducer_t *r, size_t b)
{
    return (r && b < r->n_buckets) ? r->buckets[b].state : MPIDP_BUCKET_COLLECTING;
}

size_t mpidp_reducer_bucket_of(const mpidp_reducer_t *r, size_t param)
{
    return (r && param < r->n_params) ? r->param_bucket[param] : (size_t)-1;
}

int mpidp_reducer_wait_bucket(mpidp_reducer_t *r, size_t b, double timeout_s)
{
    if (r == NULL || b >= r->n_buckets)
        return mpidp__fail(MPIDP_EINVAL, "reducer: no bucket %zu", b);
    bucket_t *bk = &r->buckets[b];
    if (bk->state == MPIDP_BUCKET_DONE) return MPIDP_OK;
    if (bk->state == MPIDP_BUCKET_COLLECTING)
        return mpidp__fail(MPIDP_ESTATE, "%s: bucket %zu was never sent (%zu parameters missing)",
                           r->name, b, bk->pending);
    if (r->hier) return mpidp__hier_wait(r, b, timeout_s); /* completes the bucket */
    int rc = mpidp_reqtable_wait(r->reqs, bk->req, timeout_s);
    if (rc == MPIDP_OK && bk_quantized(r, bk) && bk->q == NULL)
        return mpidp__fail(MPIDP_ESTATE, "%s: bucket %zu's quantized allreduce failed to start; "
                           "its gradients were not reduced", r->name, b);
    if (rc == MPIDP_OK && bk->q) {
        rc = mpidp_qallreduce_wait(bk->q, timeout_s);
        if (rc == MPIDP_OK) rc = mpidp_qallreduce_free(bk->q);
        if (rc == MPIDP_OK) bk->q = NULL;
    }
    if (rc != MPIDP_OK) return rc;
    return reducer_complete_bucket(r, bk);
}

int mpidp_reducer_wait_all(mpidp_reducer_t *r, double timeout_s)
{
    if (r == NULL) return mpidp__fail(MPIDP_EINVAL, "reducer: NULL");
    for (size_t b = 0; b < r->n_buckets; b++) {
        int rc = mpidp_reducer_wait_bucket(r, b, timeout_s);
        if (rc != MPIDP_OK) return rc;
    }
    return MPIDP_OK;
}

int mpidp_reducer_used_globally(const mpidp_reducer_t *r, size_t param, int *used)
{
    if (r == NULL || used == NULL || param >= r->n_params)
        return mpidp__fail(MPIDP_EINVAL, "reducer: no parameter %zu", param);
    const bucket_t *bk = &r->buckets[r->param_bucket[param]];
    if (bk->state != MPIDP_BUCKET_DONE)
        return mpidp__fail(MPIDP_ESTATE, "%s: bucket of parameter %zu has not completed", r->name, param);
    *used = flag_is_set(r, bk, r->param_flag[param]);
    return MPIDP_OK;
}

int mpidp_reducer_deliver(mpidp_reducer_t *r, size_t param, int mode)
{
    if (r == NULL || param >= r->n_params || (mode != MPIDP_DELIVER_COPY && mode != MPIDP_DELIVER_ADD))
        return mpidp__fail(MPIDP_EINVAL, "reducer: bad deliver(%zu, %d)", param, mode);
    bucket_t *bk = &r->buckets[r->param_bucket[param]];
    if (!r->separate || bk->state != MPIDP_BUCKET_DONE)
        return mpidp__fail(MPIDP_ESTATE, "%s: nothing to deliver for parameter %zu", r->name, param);
    if (r->device) {
        /* The mean is on the device: the caller copies or adds it there. */
        r->dev_deliver[param] = (uint8_t)(mode + 1); /* 0 says none */
        return MPIDP_OK;
    }
    if (r->size == 1 && bk->comm == NULL) return MPIDP_OK;
    const mpidp_pack_kernels_t *k = mpidp_pack_kernels();
    size_t off = r->param_offset[param], n = r->param_numel[param];
    float a = mode == MPIDP_DELIVER_ADD ? 1.0f : 0.0f;
    switch (comm_dtype(r, bk)) {
    case MPIDP_BF16:
        if (bk->info.dtype == MPIDP_F32) {
            k->unpack_bf16((float *)bk->data + off, (uint16_t *)bk->comm + off, NULL, a, 1.0f, 0.0f, n);
            return MPIDP_OK;
        }
        break;
    case MPIDP_F16:
        if (bk->info.dtype == MPIDP_F32) {
            k->unpack_fp16((float *)bk->data + off, (uint16_t *)bk->comm + off, NULL, a, 1.0f, 0.0f, n);
            return MPIDP_OK;
        }
        break;
    case MPIDP_F32:
        k->merge_f32((float *)bk->data + off, (const float *)bk->comm + off, NULL, a, 1.0f, 0.0f, n);
        return MPIDP_OK;
    case MPIDP_F64: {
        double *d = (double *)bk->data + off;
        const double *c = (const double *)bk->comm + off;
        for (size_t i = 0; i < n; i++) d[i] = (mode == MPIDP_DELIVER_ADD ? d[i] : 0.0) + c[i];
        return MPIDP_OK;
    }
    }
    /* Half-precision buckets (not compressed further): through the exact conversions. */
    uint16_t *d = (uint16_t *)bk->data + off;
    const uint16_t *c = (const uint16_t *)bk->comm + off;
    int bf = bk->info.dtype == MPIDP_BF16;
    for (size_t i = 0; i < n; i++) {
        float prev = mode == MPIDP_DELIVER_ADD ? (bf ? mpidp_f32_from_bf16(d[i]) : mpidp_f32_from_fp16(d[i])) : 0.0f;
        float add = bf ? mpidp_f32_from_bf16(c[i]) : mpidp_f32_from_fp16(c[i]);
        d[i] = bf ? mpidp_bf16_from_f32(prev + add) : mpidp_fp16_from_f32(prev + add);
    }
    return MPIDP_OK;
}

int mpidp_reducer_device_deliveries(mpidp_reducer_t *r, size_t b, uint8_t *modes)
{
    if (r == NULL || b >= r->n_buckets || modes == NULL)
        return mpidp__fail(MPIDP_EINVAL, "reducer: no bucket %zu", b);
    if (!r->device)
        return mpidp__fail(MPIDP_ESTATE, "%s: deliveries are made by the core in host mode", r->name);
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r, b, &members);
    for (size_t k = 0; k < n; k++) {
        modes[k] = r->dev_deliver[members[k]];
        r->dev_deliver[members[k]] = 0;
    }
    return MPIDP_OK;
}

int mpidp_reducer_divisor(const mpidp_reducer_t *r) { return r ? r->divisor : 0; }

int mpidp_reducer_set_divisor(mpidp_reducer_t *r, int n)
{
    if (r == NULL || n < 1 || n > r->size)
        return mpidp__fail(MPIDP_EINVAL, "reducer: divisor %d outside 1..%d", n, r ? r->size : 0);
    r->divisor = n;
    return MPIDP_OK;
}

void *mpidp_reducer_slice(const mpidp_reducer_t *r, size_t param, size_t *numel)
{
    if (r == NULL || param >= r->n_params) return NULL;
    const bucket_t *bk = &r->buckets[r->param_bucket[param]];
    if (numel) *numel = r->param_numel[param];
    return element(bk, r->param_offset[param]);
}

int mpidp_reducer_reset(mpidp_reducer_t *r)
{
    if (r == NULL) return mpidp__fail(MPIDP_EINVAL, "reducer: NULL");
    if (r->n_ready != 0) {
        for (size_t b = 0; b < r->n_buckets; b++)
            if (r->buckets[b].state != MPIDP_BUCKET_DONE)
                return mpidp__fail(MPIDP_ESTATE, "%s: bucket %zu has not completed (%zu of its "
                                   "parameters missing)", r->name, b, r->buckets[b].pending);
    }
    memset(r->ready, 0, r->n_params);
    r->n_ready = 0;
    pass_clear(r);
    r->next_to_post = 0;
    if (r->hier) mpidp__hier_reset(r);
    for (size_t b = 0; b < r->n_buckets; b++) {
        r->buckets[b].pending = r->buckets[b].info.n_params;
        r->buckets[b].state = MPIDP_BUCKET_COLLECTING;
        r->buckets[b].req = MPIDP_REQ_NONE;
        r->buckets[b].staged_in = 0;
        r->buckets[b].home = 0;
    }
    return MPIDP_OK;
}
