/* Parameter sync: the engine of DASO's global average (and of the outer steps
 * of LocalSGD-style algorithms), over a flat layout of float32 parameters.
 *
 * It keeps a reference copy `ref` of the parameters that every rank shares
 * (their values after the last blocking sync) and a wire buffer. A sync:
 *   send        packs every parameter's difference from the reference,
 *               d = p - ref, into the wire buffer (cast to bf16/fp16, or kept
 *               float32) and posts the chunked allreduce with every chunk in
 *               flight (mpidp/allreduce.h); the sum S = sum over ranks of d;
 *   test / wait progress / complete it;
 *   merge       p = a*p + b*S + c*ref, straight from the wire buffer;
 *   grad_into   g = scale * S (e.g. scale = -1/n: the averaged "outer
 *               gradient" ref - mean(p) of SlowMo / DiLoCo), for outer optimizers;
 *   restore     p = ref.
 * Differences are small next to the parameters, so bf16 on the wire costs far
 * less accuracy than sending parameters. mpidp_paramsync_merge_weights gives
 * Heat's staleness-weighted average in this form.
 *
 * The engine borrows the parameter buffers (the caller keeps them alive and
 * in place) and owns ref and the wire buffer. Not thread-safe: one caller at a
 * time per object. Every function returns MPIDP_OK or a status (mpidp/status.h)
 * with a detail. */
#ifndef MPIDP_PARAMSYNC_H
#define MPIDP_PARAMSYNC_H

#include <mpi.h>
#include <stddef.h>

#include "mpidp/reqtable.h"

typedef struct mpidp_paramsync mpidp_paramsync_t;

typedef struct {
    MPI_Comm comm;
    mpidp_reqtable_t *reqs;
    size_t n_params;
    float *const *params;     /* n_params float32 buffers, borrowed */
    const size_t *numel;      /* their element counts */
    int wire;                 /* MPIDP_F32, MPIDP_BF16 or MPIDP_F16 */
    size_t chunk_elems;       /* elements per MPI call, 1 .. INT_MAX */
    double drain_timeout_s;   /* see mpidp_allreduce_opts_t */
    const char *what;         /* for messages, e.g. "DASO global sync" */
} mpidp_paramsync_config_t;

/* Creates the engine; ref starts as the parameters now. MPIDP_EINVAL for a
 * bad configuration, MPIDP_ENOMEM. */
int mpidp_paramsync_create(const mpidp_paramsync_config_t *cfg, mpidp_paramsync_t **out);

/* Frees it. MPIDP_ESTATE (nothing freed) while a sync is in flight. */
int mpidp_paramsync_free(mpidp_paramsync_t *s);

/* Ends the engine as a dropped owner must: completes a sync in flight
 * (deadline `timeout_s`; no wait once MPI is finalized), then frees it.
 * MPIDP_OK: freed. Otherwise (the wait failed or timed out, or MPI was
 * finalized first) nothing is freed: a request may still write into the
 * engine's buffers, so they are leaked on purpose. The parameters are read
 * and written only inside calls, so the caller may release them either way. */
int mpidp_paramsync_close(mpidp_paramsync_t *s, double timeout_s);

/* ref = the parameters now (every rank must hold the same values). */
int mpidp_paramsync_set_reference(mpidp_paramsync_t *s);

/* Packs p - ref (or, with zero, zeros: a rank that takes part without
 * contributing) and posts the allreduce. MPIDP_ESTATE when one is in flight. */
int mpidp_paramsync_send(mpidp_paramsync_t *s, int zero);

/* Progresses without blocking; *done = 1 when no sync is in flight. */
int mpidp_paramsync_test(mpidp_paramsync_t *s, int *done);

/* Completes the sync in flight (none: returns at once); `timeout_s` bounds
 * each wait for progress. On MPIDP_ETIMEDOUT the sync stays in flight. */
int mpidp_paramsync_wait(mpidp_paramsync_t *s, double timeout_s);

/* p = a*p + b*S + c*ref. Reads the sum of a completed sync, once: MPIDP_ESTATE
 * while it is still in flight (wait first) and when no completed sync is
 * waiting to be read (none sent, or already merged or read by grad_into). */
int mpidp_paramsync_merge(mpidp_paramsync_t *s, float a, float b, float c);

/* grads[i] = scale * S for every parameter: grads[i] is a float32 buffer of
 * numel[i] elements. MPIDP_EINVAL, naming the gradient, unless there are
 * n_params of them, each of its parameter's size. Same state rule as merge. */
int mpidp_paramsync_grad_into(mpidp_paramsync_t *s, size_t n_grads, float *const *grads,
                              const size_t *numel, float scale);

/* Forgets a sync whose requests have all ended without completing it (in
 * fault-tolerant mode, recovery ends every request on the revoked
 * communicators): the engine is idle again and its sum is never read.
 * MPIDP_ESTATE (nothing changed) while a request of it is still live, since
 * MPI may still write into the wire buffer. Nothing in flight: a no-op. */
int mpidp_paramsync_abandon(mpidp_paramsync_t *s);

/* p = ref (e.g. before an outer optimizer steps from the shared point).
 * MPIDP_ESTATE while a sync is in flight. */
int mpidp_paramsync_restore(mpidp_paramsync_t *s);

size_t mpidp_paramsync_numel(const mpidp_paramsync_t *s);
size_t mpidp_paramsync_wire_bytes(const mpidp_paramsync_t *s);
int mpidp_paramsync_pending(const mpidp_paramsync_t *s);

/* Heat's staleness-weighted average of n senders' parameters with the
 * receiver's own weighted by w = 2 * batches_waited:
 *     (w*p + sum_i (ref + d_i)) / (n + w) = a*p + b*S + c*ref
 * with a = w/(n+w), b = 1/(n+w), c = n/(n+w); batches_waited = 0 is a plain
 * average. MPIDP_EINVAL for n < 1 or batches_waited < 0. */
int mpidp_paramsync_merge_weights(int n_senders, long long batches_waited, float *a, float *b,
                                  float *c);

#endif /* MPIDP_PARAMSYNC_H */
