/* The averaging schedule (mpidp/averaging_schedule.h): a pure function of the config
 * and the step. Step arithmetic is done in uint64_t, where t + 1 + delay
 * cannot overflow for any t <= INT64_MAX. */
#include "mpidp/averaging_schedule.h"

#include "mpidp/status.h"
#include "fail.h"

#include <inttypes.h>
#include <stddef.h>

static int flag_ok(int v) { return v == 0 || v == 1; }

int mpidp_avgsched_config_validate(const mpidp_avgsched_config_t *c)
{
    if (c == NULL) return mpidp__fail(MPIDP_EINVAL, "averaging schedule: config is NULL");
    if (c->warmup_steps < 0)
        return mpidp__fail(MPIDP_EINVAL, "warmup_steps must be >= 0, got %" PRId64, c->warmup_steps);
    if (c->n_levels < 0 || c->n_levels > MPIDP_AVGSCHED_MAX_LEVELS)
        return mpidp__fail(MPIDP_EINVAL, "expected 0 to %d averaging periods, got %d",
                           MPIDP_AVGSCHED_MAX_LEVELS, c->n_levels);
    for (int l = 0; l < c->n_levels; l++) {
        if (c->periods[l] < 1)
            return mpidp__fail(MPIDP_EINVAL, "period must be >= 1, got %" PRId64, c->periods[l]);
        if (l > 0 && c->periods[l] <= c->periods[l - 1])
            return mpidp__fail(MPIDP_EINVAL, "periods must be strictly ascending, got %" PRId64
                               " after %" PRId64, c->periods[l], c->periods[l - 1]);
    }
    if (!flag_ok(c->count_from_warmup) || !flag_ok(c->after_period) ||
        !flag_ok(c->slow_replaces_average))
        return mpidp__fail(MPIDP_EINVAL, "count_from_warmup, after_period and "
                           "slow_replaces_average must be 0 or 1");
    if (c->slow_every < 0)
        return mpidp__fail(MPIDP_EINVAL, "slow_every must be >= 0, got %" PRId64, c->slow_every);
    if (c->n_fragments < 0)
        return mpidp__fail(MPIDP_EINVAL, "n_fragments must be >= 0, got %" PRId64, c->n_fragments);
    if (c->n_fragments > 0) {
        if (c->fragment_every < 1)
            return mpidp__fail(MPIDP_EINVAL, "fragment_every must be >= 1, got %" PRId64,
                               c->fragment_every);
        if (c->fragment_delay < 0 || c->fragment_delay >= c->fragment_every)
            return mpidp__fail(MPIDP_EINVAL, "fragment_delay must be in 0 .. %" PRId64
                               " (a fragment is sent before its next turn), got %" PRId64,
                               c->fragment_every - 1, c->fragment_delay);
    }
    return MPIDP_OK;
}

/* The base level due after step t (t >= warmup), or -1. */
static int due_level(const mpidp_avgsched_config_t *c, uint64_t k)
{
    for (int l = c->n_levels - 1; l >= 0; l--)
        if (k % (uint64_t)c->periods[l] == 0) return l;
    return -1;
}

/* The fragment whose sync number (u / every) - 1 falls on u, or -1. */
static int64_t fragment_at(const mpidp_avgsched_config_t *c, uint64_t u)
{
    uint64_t every = (uint64_t)c->fragment_every;
    if (u % every != 0) return -1;
    return (int64_t)((u / every - 1) % (uint64_t)c->n_fragments);
}

int mpidp_avgsched_actions(const mpidp_avgsched_config_t *c, int64_t t, mpidp_avgsched_actions_t *out)
{
    if (out == NULL) return mpidp__fail(MPIDP_EINVAL, "averaging schedule: actions is NULL");
    *out = (mpidp_avgsched_actions_t){.average = 0, .level = -1, .slow_step = 0,
                                      .send_fragment = -1, .apply_fragment = -1};
    int rc = mpidp_avgsched_config_validate(c);
    if (rc != MPIDP_OK) return rc;
    if (t < 0) return mpidp__fail(MPIDP_EINVAL, "step must be >= 0, got %" PRId64, t);

    if (t >= c->warmup_steps) {
        uint64_t origin = c->count_from_warmup ? (uint64_t)c->warmup_steps : 0;
        uint64_t k = (uint64_t)t - origin + (uint64_t)c->after_period;
        out->slow_step = c->slow_every > 0 && k % (uint64_t)c->slow_every == 0;
        out->level = due_level(c, k);
        if (out->slow_step && c->slow_replaces_average) out->level = -1;
        out->average = out->level >= 0;
    }
    if (c->n_fragments > 0) {
        uint64_t u = (uint64_t)t + 1;
        out->apply_fragment = fragment_at(c, u);
        /* A send whose apply would fall past INT64_MAX never completes: none. */
        if ((uint64_t)t <= (uint64_t)INT64_MAX - (uint64_t)c->fragment_delay)
            out->send_fragment = fragment_at(c, u + (uint64_t)c->fragment_delay);
    }
    return MPIDP_OK;
}
