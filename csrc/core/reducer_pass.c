/* The reducer's pass: what each parameter's `.grad` must become, from what
 * the caller saw of it (contract in mpidp/reducer.h, "the pass").
 *
 * The rules are those of a single process: a parameter no rank had a
 * gradient for keeps `.grad = None`; one this rank had none for but another
 * rank had gets the mean; in non-blocking mode the user's changes between
 * backward and the deferred step (set to None, zeroed in place) survive the
 * step. A bucket's version counter tells an in-place zeroing from nothing. */
#include <stdlib.h>
#include <string.h>

#include "mpidp/status.h"
#include "reducer_internal.h"
#include "fail.h"

mpidp_accum_action_t mpidp_reducer_accumulate_action(int grad_is_view, int cleared, int used,
                                                     int was_none, int new_grad_arrived)
{
    if (!grad_is_view || cleared) return MPIDP_ACCUM_DROP;
    if (!used && was_none && !new_grad_arrived) return MPIDP_ACCUM_ADD_THEN_NONE;
    return MPIDP_ACCUM_ADD;
}

mpidp_after_step_t mpidp_reducer_after_step_action(int none_at_step, int cleared, int used,
                                                   int was_none)
{
    if (none_at_step) return MPIDP_AFTER_NONE;
    if (cleared) return MPIDP_AFTER_ZEROED;
    if (!used && was_none) return MPIDP_AFTER_NONE;
    return MPIDP_AFTER_VIEW; /* the mean, or the zeros the user kept before backward */
}

static int check_param(const mpidp_reducer_t *r, size_t i)
{
    if (r == NULL || i >= r->n_params) return mpidp__fail(MPIDP_EINVAL, "reducer: no parameter %zu", i);
    return MPIDP_OK;
}

/* Bucket b exists, has completed, and (for the separate-mode calls) the
 * reducer is in separate mode. */
static int check_done(const mpidp_reducer_t *r, size_t b, int need_separate, const char *what)
{
    if (r == NULL || b >= r->n_buckets) return mpidp__fail(MPIDP_EINVAL, "reducer: no bucket %zu", b);
    if (need_separate && !r->separate)
        return mpidp__fail(MPIDP_ESTATE, "%s: %s is for non-blocking mode", r->name, what);
    if (!r->finalized || r->buckets[b].state != MPIDP_BUCKET_DONE)
        return mpidp__fail(MPIDP_ESTATE, "%s: %s: bucket %zu has not completed", r->name, what, b);
    return MPIDP_OK;
}

static int used_by_any_rank(const mpidp_reducer_t *r, size_t i)
{
    int used = 0;
    mpidp_reducer_used_globally(r, i, &used); /* the callers checked the bucket is DONE */
    return used;
}

int mpidp_reducer_prepare(mpidp_reducer_t *r, const uint8_t *seen, uint8_t *act)
{
    if (r == NULL || seen == NULL || act == NULL) return mpidp__fail(MPIDP_EINVAL, "reducer: NULL");
    int open = r->n_ready != 0;
    for (size_t i = 0; i < r->n_params; i++) {
        int fill = !open && seen[i] == MPIDP_SEEN_NONE;
        act[i] = fill ? MPIDP_GRAD_ZERO_VIEW : MPIDP_GRAD_KEEP;
        if (fill) r->was_none[i] = 1;
    }
    return MPIDP_OK;
}

int mpidp_reducer_opens_backward(const mpidp_reducer_t *r)
{
    return r != NULL && !r->paused && !r->backward_open;
}

int mpidp_reducer_grad_arrived(mpidp_reducer_t *r, size_t i, int has)
{
    int rc = check_param(r, i);
    if (rc != MPIDP_OK) return rc;
    if (r->paused) {
        /* no_sync: set_paused refused while a pass was open, and a
         * communicating hook cannot run while paused, so none is. */
        if (has) r->was_none[i] = 0;
        r->held = 1;
        return MPIDP_OK;
    }
    if (!r->backward_open) r->held = 0; /* this pass reduces what was held */
    r->backward_open = 1;
    r->was_none[i] = 0; /* a gradient arrived: the view holds real data (or None) */
    r->local_has[i] = (uint8_t)(has != 0);
    return mpidp_reducer_mark_ready(r, i, has);
}

int mpidp_reducer_grad_hooked(mpidp_reducer_t *r, size_t i, int has, double progress_every_s)
{
    int rc = mpidp_reducer_grad_arrived(r, i, has);
    if (rc != MPIDP_OK || progress_every_s < 0 || r->paused) return rc;
    double now = mpidp_now();
    if (now - r->last_hook_progress < progress_every_s) return rc;
    r->last_hook_progress = now;
    return mpidp_reqtable_progress(r->reqs, NULL);
}

int mpidp_reducer_set_paused(mpidp_reducer_t *r, int on)
{
    if (r == NULL) return mpidp__fail(MPIDP_EINVAL, "reducer: NULL");
    if (on && r->n_ready != 0)
        return mpidp__fail(MPIDP_ESTATE, "%s.no_sync: a backward pass is still open", r->name);
    r->paused = on != 0;
    return MPIDP_OK;
}

int mpidp_reducer_paused(const mpidp_reducer_t *r) { return r != NULL && r->paused; }
int mpidp_reducer_held(const mpidp_reducer_t *r) { return r != NULL && r->held; }

/* The contribution of an unhooked parameter: its view holds a gradient
 * unless prepare put the zeros there; a foreign tensor is adopted. */
static int unhooked_has(const mpidp_reducer_t *r, size_t i, int seen)
{
    return seen == MPIDP_SEEN_OTHER || (seen == MPIDP_SEEN_VIEW && !r->was_none[i]);
}

mpidp_grad_action_t mpidp_reducer_unhooked_action(const mpidp_reducer_t *r, size_t i, int seen)
{
    if (r == NULL || i >= r->n_params) return MPIDP_GRAD_KEEP;
    if (seen == MPIDP_SEEN_OTHER) return MPIDP_GRAD_ADOPT;
    /* Staged buckets are copied from where the gradients live: zero there. */
    return !unhooked_has(r, i, seen) && r->staged ? MPIDP_GRAD_ZERO_ONLY : MPIDP_GRAD_KEEP;
}

int mpidp_reducer_mark_unhooked(mpidp_reducer_t *r, size_t i, int seen)
{
    int rc = check_param(r, i);
    if (rc != MPIDP_OK) return rc;
    int has = unhooked_has(r, i, seen);
    if (seen == MPIDP_SEEN_OTHER) r->was_none[i] = 0;
    r->local_has[i] = (uint8_t)has;
    return mpidp_reducer_mark_ready(r, i, has);
}

int mpidp_reducer_finalize(mpidp_reducer_t *r, const long long *versions)
{
    if (r == NULL) return mpidp__fail(MPIDP_EINVAL, "reducer: NULL");
    if (r->n_ready != r->n_params)
        return mpidp__fail(MPIDP_ESTATE, "%s: %zu of %zu parameters are not marked at the end of "
                           "backward", r->name, r->n_params - r->n_ready, r->n_params);
    if (r->separate) {
        if (versions == NULL)
            return mpidp__fail(MPIDP_EINVAL, "%s: non-blocking mode needs the buckets' version "
                               "counters", r->name);
        memcpy(r->version, versions, r->n_buckets * sizeof *versions);
    }
    r->finalized = 1;
    r->backward_open = 0;
    return MPIDP_OK;
}

int mpidp_reducer_finalized(const mpidp_reducer_t *r) { return r != NULL && r->finalized; }

int mpidp_reducer_missing_grads(mpidp_reducer_t *r, size_t b, uint8_t *act)
{
    int rc = check_done(r, b, 0, "fixing missing gradients");
    if (rc != MPIDP_OK) return rc;
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r, b, &members);
    for (size_t k = 0; k < n; k++) {
        size_t i = members[k];
        act[k] = MPIDP_GRAD_KEEP;
        if (r->local_has[i]) continue;
        act[k] = used_by_any_rank(r, i) ? MPIDP_GRAD_SET_VIEW : MPIDP_GRAD_SET_NONE;
        r->local_has[i] = 1; /* fixed: not again in this pass */
    }
    return MPIDP_OK;
}

int mpidp_reducer_end_blocking(mpidp_reducer_t *r, double timeout_s, uint8_t *act)
{
    int rc = mpidp_reducer_finalize(r, NULL);
    for (size_t b = 0; rc == MPIDP_OK && b < r->n_buckets; b++) {
        rc = mpidp_reducer_wait_bucket(r, b, timeout_s);
        if (rc == MPIDP_OK) rc = mpidp_reducer_missing_grads(r, b, act + r->bucket_first[b]);
    }
    return rc == MPIDP_OK ? mpidp_reducer_reset(r) : rc;
}

static int step_begun(const mpidp_reducer_t *r)
{
    for (size_t b = 0; b < r->n_buckets; b++)
        if (r->delivered[b]) return 1;
    return 0;
}

int mpidp_reducer_accumulate(mpidp_reducer_t *r, size_t b, long long version, long accumulated,
                             const uint8_t *seen, uint8_t *act)
{
    int rc = check_done(r, b, 1, "accumulating gradients");
    if (rc != MPIDP_OK) return rc;
    if (step_begun(r))
        return mpidp__fail(MPIDP_ESTATE, "%s: a deferred optimizer step is half applied; finish "
                           "it before completing the pass", r->name);
    /* A new backward's first gradient added into its view moved the counter
     * by one: that is not the user clearing anything. */
    long long expected = r->version[b];
    if (accumulated >= 0 && mpidp_reducer_bucket_of(r, (size_t)accumulated) == b) expected++;
    int cleared = version != expected;
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r, b, &members);
    for (size_t k = 0; k < n; k++) {
        size_t i = members[k];
        mpidp_accum_action_t a = mpidp_reducer_accumulate_action(
            seen[k] == MPIDP_SEEN_VIEW, cleared, used_by_any_rank(r, i), r->was_none[i],
            (long)i == accumulated);
        act[k] = a == MPIDP_ACCUM_ADD_THEN_NONE ? MPIDP_GRAD_SET_NONE : MPIDP_GRAD_KEEP;
        if (a != MPIDP_ACCUM_DROP && (rc = mpidp_reducer_deliver(r, i, MPIDP_DELIVER_ADD)) != MPIDP_OK)
            return rc;
    }
    return MPIDP_OK;
}

int mpidp_reducer_deliver_for_step(mpidp_reducer_t *r, size_t b, long long version,
                                   const uint8_t *seen, uint8_t *act)
{
    int rc = check_done(r, b, 1, "delivering gradients for the step");
    if (rc != MPIDP_OK) return rc;
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r, b, &members);
    memset(act, MPIDP_GRAD_KEEP, n);
    if (r->delivered[b]) return MPIDP_OK;
    for (size_t k = 0; k < n; k++)
        if (seen[k] == MPIDP_SEEN_OTHER)
            return mpidp__fail(MPIDP_ESTATE, "the .grad of parameter %zu was replaced between "
                               "backward and the step; the averaged gradient is applied at the "
                               "next forward, so gradients cannot be edited in between (use "
                               "blocking_parameter_updates=True for that)", members[k]);
    int cleared = version != r->version[b];
    for (size_t k = 0; k < n; k++) {
        size_t i = members[k];
        int used = used_by_any_rank(r, i);
        r->after[i] = (uint8_t)mpidp_reducer_after_step_action(seen[k] == MPIDP_SEEN_NONE, cleared,
                                                               used, r->was_none[i]);
        if ((rc = mpidp_reducer_deliver(r, i, MPIDP_DELIVER_COPY)) != MPIDP_OK) return rc;
        /* For the step: the mean, or None where no rank had a gradient (the
         * optimizer then skips the parameter, as in a single process). */
        act[k] = used ? MPIDP_GRAD_SET_VIEW : MPIDP_GRAD_SET_NONE;
    }
    r->delivered[b] = 1;
    return MPIDP_OK;
}

int mpidp_reducer_delivered(const mpidp_reducer_t *r, size_t b)
{
    return r != NULL && b < r->n_buckets && r->delivered[b];
}

int mpidp_reducer_after_step(mpidp_reducer_t *r, size_t b, uint8_t *act, int *pass_over)
{
    if (r == NULL || b >= r->n_buckets || pass_over == NULL)
        return mpidp__fail(MPIDP_EINVAL, "reducer: no bucket %zu", b);
    if (!r->delivered[b])
        return mpidp__fail(MPIDP_ESTATE, "%s: after_step: bucket %zu was not delivered", r->name, b);
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r, b, &members);
    static const uint8_t to_action[] = {
        [MPIDP_AFTER_VIEW] = MPIDP_GRAD_SET_VIEW,
        [MPIDP_AFTER_ZEROED] = MPIDP_GRAD_ZERO_VIEW,
        [MPIDP_AFTER_NONE] = MPIDP_GRAD_SET_NONE,
    };
    for (size_t k = 0; k < n; k++)
        act[k] = r->applied[b] ? MPIDP_GRAD_KEEP : to_action[r->after[members[k]]];
    r->applied[b] = 1;
    *pass_over = 1;
    for (size_t k = 0; k < r->n_buckets; k++)
        if (!r->applied[k]) *pass_over = 0;
    return MPIDP_OK;
}

int mpidp_reducer_stepped(const mpidp_reducer_t *r, size_t b)
{
    return r != NULL && b < r->n_buckets && r->applied[b];
}

int mpidp_reducer_version_moved(const mpidp_reducer_t *r, size_t b, long long version)
{
    return r != NULL && r->separate && r->finalized && b < r->n_buckets && r->version[b] != version;
}

int mpidp_reducer_deliver_now(mpidp_reducer_t *r, size_t b, long long version, const uint8_t *seen,
                              uint8_t *act)
{
    int rc = check_done(r, b, 1, "synchronizing gradients");
    if (rc != MPIDP_OK) return rc;
    if (r->delivered[b] || step_begun(r))
        return mpidp__fail(MPIDP_ESTATE, "%s: the step of this pass is already being applied",
                           r->name);
    if (version != r->version[b])
        return mpidp__fail(MPIDP_ESTATE, "gradients were changed in place between backward and "
                           "synchronize(); in non-blocking mode they hold zeros until the averaged "
                           "gradients are delivered, so the change would be lost -- call "
                           "synchronize() right after backward, then edit");
    const size_t *members;
    size_t n = mpidp_reducer_bucket_params(r, b, &members);
    for (size_t k = 0; k < n; k++)
        if (seen[k] == MPIDP_SEEN_OTHER)
            return mpidp__fail(MPIDP_ESTATE, "the .grad of parameter %zu was replaced between "
                               "backward and synchronize(); assign to .grad only after "
                               "synchronize()", members[k]);
    for (size_t k = 0; k < n; k++) {
        size_t i = members[k];
        int used = used_by_any_rank(r, i);
        if ((rc = mpidp_reducer_deliver(r, i, MPIDP_DELIVER_COPY)) != MPIDP_OK) return rc;
        act[k] = seen[k] == MPIDP_SEEN_NONE     ? MPIDP_GRAD_KEEP
                 : (!used && r->was_none[i]) ? MPIDP_GRAD_SET_NONE
                                             : MPIDP_GRAD_SET_VIEW;
    }
    return MPIDP_OK;
}

int mpidp_reducer_contribute_nothing(mpidp_reducer_t *r)
{
    if (r == NULL) return mpidp__fail(MPIDP_EINVAL, "reducer: NULL");
    if (r->n_ready != 0 || r->finalized)
        return mpidp__fail(MPIDP_ESTATE, "%s: a backward pass is still open", r->name);
    for (size_t i = 0; i < r->n_params; i++) {
        int rc = mpidp_reducer_mark_ready(r, i, 0);
        if (rc != MPIDP_OK) return rc;
    }
    return MPIDP_OK;
}
