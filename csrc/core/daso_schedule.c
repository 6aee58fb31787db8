/* The DASO schedule state machine (see mpidp/daso_schedule.h for the contract).
 *
 * Everything here is a pure function of the state and the event: no
 * allocation, no I/O, no MPI, no clock. Every entry point checks the whole state
 * first and changes it only after every check has passed, so a refused call
 * leaves nothing half done. */
#include "mpidp/daso_schedule.h"

#include "mpidp/status.h"
#include "fail.h"

#include <inttypes.h>
#include <math.h>
#include <stddef.h>

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

void mpidp_schedule_config_default(mpidp_schedule_config_t *cfg)
{
    if (!cfg) return;
    cfg->total_epochs = 0;
    cfg->warmup_epochs = 4;
    cfg->cooldown_epochs = 4;
    cfg->max_global_skips = 8;
    cfg->skip_reduction_factor = 2;
    cfg->local_skip_factor = 4;
    cfg->n_groups = 1;
    cfg->stability_level = 0.05;
}

/* Every integer field has a lower bound only, so the integer checks are one
 * table, in the order the fields are declared: the first field out of range
 * is the one reported, with the rule it breaks. */
int mpidp_schedule_config_validate(const mpidp_schedule_config_t *cfg)
{
    if (!cfg) return mpidp__fail(MPIDP_EINVAL, "schedule config is NULL");
    const struct {
        const char *name;
        int64_t value, min;
        const char *rule; /* value >= min, as the message words it */
    } bounds[] = {
        {"total_epochs", cfg->total_epochs, 1, "> 0"},
        {"warmup_epochs", cfg->warmup_epochs, 0, ">= 0"},
        {"cooldown_epochs", cfg->cooldown_epochs, 0, ">= 0"},
        {"max_global_skips", cfg->max_global_skips, 1, ">= 1"},
        {"skip_reduction_factor", cfg->skip_reduction_factor, 2,
         ">= 2 (1 would never reduce the skips)"},
        {"local_skip_factor", cfg->local_skip_factor, 1, ">= 1"},
        {"n_groups (processes per node)", cfg->n_groups, 1, ">= 1"},
    };
    for (size_t i = 0; i < sizeof bounds / sizeof bounds[0]; i++)
        if (bounds[i].value < bounds[i].min)
            return mpidp__fail(MPIDP_EINVAL, "%s must be %s, got %" PRId64, bounds[i].name,
                               bounds[i].rule, bounds[i].value);
    /* Written as a negated range test so that NaN fails it too. */
    if (!(cfg->stability_level >= 0.0 && cfg->stability_level < 1.0))
        return mpidp__fail(MPIDP_EINVAL,
                           "stability_level must be in [0, 1), got %g",
                           cfg->stability_level);
    return MPIDP_OK;
}

const char *mpidp_schedule_phase_name(int64_t phase)
{
    switch (phase) {
    case MPIDP_SCHEDULE_WARMUP: return "warmup";
    case MPIDP_SCHEDULE_CYCLING: return "cycling";
    case MPIDP_SCHEDULE_COOLDOWN: return "cooldown";
    }
    return "unknown";
}

/* The phase whose rules apply at epoch counter c. Warmup is tested first, as
 * in Heat, so when the phases overlap (warmup + cooldown > total) the leading
 * epochs stay warmup and the rest are cooldown; both are blocking anyway. */
static int64_t phase_at(const mpidp_schedule_config_t *cfg, int64_t c)
{
    if (c < cfg->warmup_epochs) return MPIDP_SCHEDULE_WARMUP;
    if (c >= cfg->total_epochs - cfg->cooldown_epochs) return MPIDP_SCHEDULE_COOLDOWN;
    return MPIDP_SCHEDULE_CYCLING;
}

/* Set the skips every phase starts with: blocking outside cycling; in cycling
 * Heat's fixed first gs of 4, clamped so that gs never exceeds the configured
 * maximum (which the validity rules, and the user, expect). */
static void enter_phase(mpidp_schedule_t *s, int64_t phase)
{
    s->phase = phase;
    if (phase == MPIDP_SCHEDULE_CYCLING) {
        s->global_skip = min64(MPIDP_SCHEDULE_FIRST_GLOBAL_SKIP,
                               s->cfg.max_global_skips);
        s->local_skip = 1;
        s->batches_to_wait = 1;
    } else {
        s->global_skip = 0;
        s->local_skip = 0;
        s->batches_to_wait = 0;
    }
}

static void detector_clear(mpidp_schedule_t *s)
{
    s->has_best = 0;
    s->bad_epochs = 0;
    s->best_loss = 0.0;
}

/* Feed one loss to the plateau detector; returns 1 on a plateau.
 *
 * The threshold is best - |best| * level rather than Heat's best * (1 - level):
 * the two agree for the usual non-negative losses, but for a negative best
 * Heat's form lies above best and would call a worse loss "improving". */
static int detector_feed(mpidp_schedule_t *s, double loss)
{
    int improving = 0;
    if (isfinite(loss)) {
        if (!s->has_best)
            improving = 1;
        else
            improving =
                loss < s->best_loss - fabs(s->best_loss) * s->cfg.stability_level;
    }
    if (improving) {
        s->has_best = 1;
        s->best_loss = loss;
        s->bad_epochs = 0;
        return 0;
    }
    s->bad_epochs++;
    if (s->bad_epochs > MPIDP_SCHEDULE_PATIENCE) {
        s->bad_epochs = 0;
        return 1;
    }
    return 0;
}

/* The plateau reaction of the cycling phase. Unlike Heat, gs is kept >= 1: Heat
 * lets gs // factor reach 0 when gs < factor, which leaves the cycling phase
 * blocking for good (neither plateau branch fires at gs == 0) with a stale
 * btw > gs. btw is kept <= gs because a pending sync must be completed no later
 * than the next global-sync batch; without the clamp local_skip_factor == 1
 * gives (m, m, m) -> (m/2, m/2, m-1). */
static void on_plateau(mpidp_schedule_t *s)
{
    const mpidp_schedule_config_t *cfg = &s->cfg;
    if (s->global_skip > 1) {
        s->global_skip = max64(s->global_skip / cfg->skip_reduction_factor, 1);
        s->local_skip = max64(s->local_skip / cfg->skip_reduction_factor, 1);
        s->batches_to_wait = min64(max64(s->batches_to_wait - 1, 1), s->global_skip);
    } else {
        /* max / factor can be 0 (max 2, factor 4): Heat would then cycle with
         * ls = btw = 0, a blocking sync that defeats the cycling phase and is
         * lifted to 1 by the next plateau anyway. Clamping to 1 keeps every
         * cycling state inside 1 <= btw, ls <= gs. */
        int64_t sub = max64(cfg->max_global_skips / cfg->local_skip_factor, 1);
        s->global_skip = cfg->max_global_skips;
        s->local_skip = sub;
        s->batches_to_wait = sub;
    }
}

/* Batch index `b` is a global-sync batch of an epoch ending at `last`. */
static int is_global_batch(const mpidp_schedule_t *s, int64_t b, int64_t last)
{
    return s->global_skip == 0 || b % s->global_skip == 0 || b == last;
}

/* Whether node-local gradient sync should be on for the backward of batch
 * `next` (of an epoch ending at `last`), given whether a global sync is pending
 * after the current step. This is Heat's switching sequence written as a
 * function of the position: on before every global-sync batch and the last
 * batch (the parameters sent must agree within the node), on while a sync is
 * pending (Heat switches it off only when the sync completes), and otherwise on
 * every ls-th batch. `next` > `last` means the epoch is over: batch 0 of the
 * next epoch is always a global-sync batch. */
static int want_local_sync(const mpidp_schedule_t *s, int64_t next, int64_t last,
                           int pending)
{
    if (next > last) return 1;
    if (is_global_batch(s, next, last)) return 1;
    if (s->local_skip <= 1 || pending) return 1;
    return next % s->local_skip == 0;
}

/* No global sync pending: every pending_* field 0, as validate() requires
 * when there is none (so that equal states compare equal byte for byte). */
static void clear_pending(mpidp_schedule_t *s)
{
    s->pending = 0;
    s->pending_group = 0;
    s->pending_btw = 0;
    s->pending_sent_at = 0;
}

static void start(mpidp_schedule_t *s)
{
    s->epoch = 0;
    s->logic_epoch = -1;
    detector_clear(s);
    enter_phase(s, phase_at(&s->cfg, 0));
    s->next_batch = 0;
    s->last_batch = -1;
    s->send_mod = 0;
    s->local_sync = 1;
    clear_pending(s);
}

int mpidp_schedule_init(mpidp_schedule_t *s, const mpidp_schedule_config_t *cfg)
{
    if (!s) return mpidp__fail(MPIDP_EINVAL, "schedule is NULL");
    int rc = mpidp_schedule_config_validate(cfg);
    if (rc != MPIDP_OK) return rc;
    /* Copy first: cfg may point into *s itself (init(&s, &s.cfg)). Every other
     * field is then assigned by start(), so nothing of the old *s survives. */
    mpidp_schedule_config_t copy = *cfg;
    s->cfg = copy;
    start(s);
    return MPIDP_OK;
}

int mpidp_schedule_reset(mpidp_schedule_t *s)
{
    if (!s) return mpidp__fail(MPIDP_EINVAL, "schedule is NULL");
    int rc = mpidp_schedule_config_validate(&s->cfg);
    if (rc != MPIDP_OK) return rc;
    start(s);
    return MPIDP_OK;
}

/* The epoch-level half of validate(). */
static int validate_epoch_level(const mpidp_schedule_t *s)
{
    const mpidp_schedule_config_t *cfg = &s->cfg;
    const int64_t gs = s->global_skip, ls = s->local_skip, btw = s->batches_to_wait;

    if (s->epoch < 0 || s->epoch == INT64_MAX)
        return mpidp__fail(MPIDP_EINVAL, "schedule state: epoch %" PRId64
                           " out of range", s->epoch);
    if (s->logic_epoch < -1 || s->logic_epoch > s->epoch)
        return mpidp__fail(MPIDP_EINVAL,
                           "schedule state: logic_epoch %" PRId64
                           " must be in [-1, epoch=%" PRId64 "]",
                           s->logic_epoch, s->epoch);
    /* The phase is decided at the last epoch_end (or by init, for epoch 0). */
    int64_t decided_at = s->logic_epoch < 0 ? 0 : s->logic_epoch;
    int64_t want_phase = phase_at(cfg, decided_at);
    if (s->phase != want_phase)
        return mpidp__fail(MPIDP_EINVAL,
                           "schedule state: phase %" PRId64 " (%s), but epoch "
                           "counter %" PRId64 " puts it in %s",
                           s->phase, mpidp_schedule_phase_name(s->phase),
                           decided_at, mpidp_schedule_phase_name(want_phase));
    if (s->phase == MPIDP_SCHEDULE_CYCLING) {
        if (gs < 1 || gs > cfg->max_global_skips)
            return mpidp__fail(MPIDP_EINVAL,
                               "schedule state: global_skip %" PRId64 " must be in "
                               "[1, max_global_skips=%" PRId64 "] when cycling",
                               gs, cfg->max_global_skips);
        if (ls < 1 || ls > gs)
            return mpidp__fail(MPIDP_EINVAL,
                               "schedule state: local_skip %" PRId64 " must be in "
                               "[1, global_skip=%" PRId64 "] when cycling", ls, gs);
        if (btw < 1 || btw > gs)
            return mpidp__fail(MPIDP_EINVAL,
                               "schedule state: batches_to_wait %" PRId64 " must be "
                               "in [1, global_skip=%" PRId64 "] when cycling",
                               btw, gs);
    } else if (gs != 0 || ls != 0 || btw != 0) {
        return mpidp__fail(MPIDP_EINVAL,
                           "schedule state: (global_skip, local_skip, "
                           "batches_to_wait) = (%" PRId64 ", %" PRId64 ", %" PRId64
                           ") must be (0, 0, 0) in %s",
                           gs, ls, btw, mpidp_schedule_phase_name(s->phase));
    }

    if (s->has_best != 0 && s->has_best != 1)
        return mpidp__fail(MPIDP_EINVAL, "schedule state: has_best %" PRId64
                           " must be 0 or 1", s->has_best);
    if (s->bad_epochs < 0 || s->bad_epochs > MPIDP_SCHEDULE_PATIENCE)
        return mpidp__fail(MPIDP_EINVAL,
                           "schedule state: bad_epochs %" PRId64 " must be in [0, %d]",
                           s->bad_epochs, MPIDP_SCHEDULE_PATIENCE);
    if (s->has_best ? !isfinite(s->best_loss) : s->best_loss != 0.0)
        return mpidp__fail(MPIDP_EINVAL,
                           "schedule state: best_loss %g with has_best %" PRId64
                           " (must be finite with a best, 0 without)",
                           s->best_loss, s->has_best);
    /* The detector is fed only from the cycling phase on. */
    int fed = s->has_best || s->bad_epochs != 0;
    if (fed && (s->phase == MPIDP_SCHEDULE_WARMUP || s->logic_epoch < 0))
        return mpidp__fail(MPIDP_EINVAL,
                           "schedule state: plateau detector has been fed, but no "
                           "epoch_end has run in the cycling phase");
    return MPIDP_OK;
}

/* The batch-level half of validate(). The position inside the epoch determines
 * everything but the group counter: which batch sent last, with which btw,
 * whether that send is still pending and what local sync should be. */
static int validate_batch_level(const mpidp_schedule_t *s)
{
    const mpidp_schedule_config_t *cfg = &s->cfg;
    const int64_t n = s->next_batch, last = s->last_batch;

    if (s->send_mod < 0 || s->send_mod >= cfg->n_groups)
        return mpidp__fail(MPIDP_EINVAL,
                           "schedule state: send_mod %" PRId64 " must be in "
                           "[0, n_groups=%" PRId64 ")", s->send_mod, cfg->n_groups);
    if (s->local_sync != 0 && s->local_sync != 1)
        return mpidp__fail(MPIDP_EINVAL, "schedule state: local_sync %" PRId64
                           " must be 0 or 1", s->local_sync);
    if (s->pending != 0 && s->pending != 1)
        return mpidp__fail(MPIDP_EINVAL, "schedule state: pending %" PRId64
                           " must be 0 or 1", s->pending);
    if (n == 0) {
        if (last != -1)
            return mpidp__fail(MPIDP_EINVAL,
                               "schedule state: last_batch %" PRId64 " must be -1 "
                               "between epochs (next_batch 0)", last);
    } else if (n < 0 || n > last) {
        return mpidp__fail(MPIDP_EINVAL,
                           "schedule state: next_batch %" PRId64 " must be in "
                           "[0, last_batch=%" PRId64 "]", n, last);
    }

    int want_pending = 0;
    int64_t sent_at = 0, sent_btw = 0;
    if (n > 0 && s->global_skip > 0) {
        /* Batch 0 always sends, so a send happened in this epoch; the latest is
         * on the last multiple of gs before n (not the last batch: n <= last). */
        sent_at = (n - 1) / s->global_skip * s->global_skip;
        sent_btw = min64(s->batches_to_wait, last - sent_at);
        want_pending = sent_btw > 0 && sent_at + sent_btw >= n;
    }
    if (s->pending != want_pending)
        return mpidp__fail(MPIDP_EINVAL,
                           "schedule state: pending is %" PRId64 " but batch %" PRId64
                           " of 0..%" PRId64 " with (gs, btw) = (%" PRId64 ", %" PRId64
                           ") implies %d", s->pending, n, last, s->global_skip,
                           s->batches_to_wait, want_pending);
    if (want_pending) {
        /* The group before send_mod, without forming send_mod + n_groups,
         * which overflows for a huge n_groups. */
        int64_t group = s->send_mod == 0 ? cfg->n_groups - 1 : s->send_mod - 1;
        if (s->pending_sent_at != sent_at || s->pending_btw != sent_btw ||
            s->pending_group != group)
            return mpidp__fail(MPIDP_EINVAL,
                               "schedule state: pending sync (group %" PRId64
                               ", btw %" PRId64 ", sent at %" PRId64 ") should be "
                               "(group %" PRId64 ", btw %" PRId64 ", sent at %" PRId64
                               ")", s->pending_group, s->pending_btw,
                               s->pending_sent_at, group, sent_btw, sent_at);
    } else if (s->pending_group != 0 || s->pending_btw != 0 || s->pending_sent_at != 0) {
        return mpidp__fail(MPIDP_EINVAL,
                           "schedule state: pending_group/btw/sent_at must be 0 "
                           "with no pending sync");
    }

    int want_ls = n == 0 ? 1 : want_local_sync(s, n, last, want_pending);
    if (s->local_sync != want_ls)
        return mpidp__fail(MPIDP_EINVAL,
                           "schedule state: local_sync %" PRId64 " but the rules "
                           "give %d for batch %" PRId64, s->local_sync, want_ls, n);
    return MPIDP_OK;
}

int mpidp_schedule_validate(const mpidp_schedule_t *s)
{
    if (!s) return mpidp__fail(MPIDP_EINVAL, "schedule is NULL");
    int rc = mpidp_schedule_config_validate(&s->cfg);
    if (rc != MPIDP_OK) return rc;
    rc = validate_epoch_level(s);
    if (rc != MPIDP_OK) return rc;
    return validate_batch_level(s);
}

int mpidp_schedule_epoch_end(mpidp_schedule_t *s, double loss)
{
    int rc = mpidp_schedule_validate(s);
    if (rc != MPIDP_OK) return rc;
    if (s->next_batch != 0)
        return mpidp__fail(MPIDP_ESTATE,
                           "epoch_end called in the middle of epoch %" PRId64
                           " (next batch %" PRId64 " of 0..%" PRId64 "); call it "
                           "after the epoch's last batch",
                           s->epoch, s->next_batch, s->last_batch);
    if (s->logic_epoch == s->epoch)
        return mpidp__fail(MPIDP_ESTATE,
                           "epoch_end already called for epoch counter %" PRId64
                           "; call it once per epoch", s->epoch);

    const int64_t c = s->epoch;
    const int64_t phase = phase_at(&s->cfg, c);
    s->logic_epoch = c;
    if (phase != MPIDP_SCHEDULE_CYCLING) {
        /* Warmup and cooldown are blocking; the detector is not consulted, as
         * in Heat (its state no longer matters in cooldown and is still fresh
         * in warmup). */
        enter_phase(s, phase);
        return MPIDP_OK;
    }
    if (s->phase != MPIDP_SCHEDULE_CYCLING) {
        /* Entering the cycling phase. Heat does this only when the counter
         * equals warmup_epochs exactly, so with warmup_epochs == 0 (no call
         * ever sees counter 0) it never leaves warmup; here the first call in
         * the cycling range enters it, whenever that is. This loss becomes the
         * detector's first value, which is why the first cycling setting lasts
         * three epochs after a warmup (and four from init with no warmup). A
         * fresh detector cannot report a plateau on its first value. */
        enter_phase(s, MPIDP_SCHEDULE_CYCLING);
        detector_clear(s);
        (void)detector_feed(s, loss);
        return MPIDP_OK;
    }
    if (detector_feed(s, loss)) on_plateau(s);
    return MPIDP_OK;
}

int mpidp_schedule_reconfigure(mpidp_schedule_t *s, const mpidp_schedule_config_t *cfg)
{
    int rc = mpidp_schedule_validate(s);
    if (rc != MPIDP_OK) return rc;
    rc = mpidp_schedule_config_validate(cfg);
    if (rc != MPIDP_OK) return rc;
    if (s->next_batch != 0 || s->pending)
        return mpidp__fail(MPIDP_ESTATE, "the schedule can only be reconfigured between epochs "
                           "(next batch %" PRId64 ", %s)", s->next_batch,
                           s->pending ? "a global sync pending" : "nothing pending");
    if (cfg->n_groups != s->cfg.n_groups)
        return mpidp__fail(MPIDP_EINVAL, "n_groups (processes per node) cannot change: %" PRId64
                           " saved, %" PRId64 " now", s->cfg.n_groups, cfg->n_groups);
    mpidp_schedule_t before = *s;
    s->cfg = *cfg;
    /* The phase is decided at the last epoch_end (epoch 0 before any), as
     * validate() checks it; s->epoch differs when epoch_end was skipped. */
    const int64_t phase = phase_at(&s->cfg, s->logic_epoch < 0 ? 0 : s->logic_epoch);
    if (phase != MPIDP_SCHEDULE_CYCLING) {
        enter_phase(s, phase);
        /* Back into warmup (more warmup epochs than done): the detector is
         * fed only from cycling on, and cycling will start it fresh. */
        if (phase == MPIDP_SCHEDULE_WARMUP) detector_clear(s);
    } else if (before.phase != MPIDP_SCHEDULE_CYCLING) {
        /* Into cycling without a loss to judge: a fresh detector takes the
         * next epoch's loss as its first value. */
        enter_phase(s, MPIDP_SCHEDULE_CYCLING);
        detector_clear(s);
    } else {
        /* Still cycling: keep the tuned skips, within the new bound. */
        if (s->global_skip > cfg->max_global_skips) s->global_skip = cfg->max_global_skips;
        if (s->local_skip > s->global_skip) s->local_skip = s->global_skip;
        if (s->batches_to_wait > s->global_skip) s->batches_to_wait = s->global_skip;
    }
    rc = mpidp_schedule_validate(s);
    if (rc != MPIDP_OK) *s = before;
    return rc;
}

static void no_actions(const mpidp_schedule_t *s, mpidp_schedule_actions_t *out)
{
    out->complete = 0;
    out->complete_group = 0;
    out->complete_btw = 0;
    out->send = 0;
    out->send_group = 0;
    out->send_btw = 0;
    out->send_blocking = 0;
    out->local_sync = s ? (int)s->local_sync : 1;
    out->epoch_done = 0;
}

/* Check the batch event against the position: the first batch of an epoch is 0
 * and fixes last_batch; every later one is the next index with the same
 * last_batch. */
static int check_batch_event(const mpidp_schedule_t *s, int64_t batch,
                             int64_t last_batch)
{
    if (batch < 0)
        return mpidp__fail(MPIDP_EINVAL, "batch must be >= 0, got %" PRId64, batch);
    if (last_batch < 0)
        return mpidp__fail(MPIDP_EINVAL, "last_batch must be >= 0 (it is "
                           "len(loader) - 1), got %" PRId64, last_batch);
    if (batch > last_batch)
        return mpidp__fail(MPIDP_ESTATE,
                           "batch %" PRId64 " is past last_batch %" PRId64
                           " (last_batch is the index of the last batch, "
                           "len(loader) - 1)", batch, last_batch);
    /* validate() accepts epoch counters up to INT64_MAX - 1; ending an epoch
     * there would give a counter it refuses (a restored state could get here). */
    if (batch == last_batch && s->epoch >= INT64_MAX - 1)
        return mpidp__fail(MPIDP_ESTATE, "epoch counter %" PRId64 " cannot advance",
                           s->epoch);
    if (s->next_batch == 0) {
        if (batch != 0)
            return mpidp__fail(MPIDP_ESTATE,
                               "epoch %" PRId64 " must start at batch 0, got batch "
                               "%" PRId64 " (a skipped batch, or a batch repeated "
                               "after the previous epoch's last one)",
                               s->epoch, batch);
        return MPIDP_OK;
    }
    if (last_batch != s->last_batch)
        return mpidp__fail(MPIDP_ESTATE,
                           "last_batch changed within epoch %" PRId64 " from %" PRId64
                           " to %" PRId64, s->epoch, s->last_batch, last_batch);
    if (batch < s->next_batch)
        return mpidp__fail(MPIDP_ESTATE,
                           "batch %" PRId64 " repeated in epoch %" PRId64
                           " (expected batch %" PRId64 ")",
                           batch, s->epoch, s->next_batch);
    if (batch > s->next_batch)
        return mpidp__fail(MPIDP_ESTATE,
                           "batch %" PRId64 " skips batch %" PRId64 " in epoch %" PRId64,
                           batch, s->next_batch, s->epoch);
    return MPIDP_OK;
}

int mpidp_schedule_batch(mpidp_schedule_t *s, int64_t batch, int64_t last_batch,
                         mpidp_schedule_actions_t *out)
{
    if (!out) return mpidp__fail(MPIDP_EINVAL, "actions pointer is NULL");
    no_actions(s, out);
    int rc = mpidp_schedule_validate(s);
    if (rc != MPIDP_OK) return rc;
    rc = check_batch_event(s, batch, last_batch);
    if (rc != MPIDP_OK) return rc;

    /* 1. Complete the pending sync on exactly the batch it was meant for.
     * validate() guarantees sent_at + btw >= batch, and that it is at most the
     * next global-sync batch, so it is never overtaken by a second send. */
    if (s->pending && s->pending_sent_at + s->pending_btw == batch) {
        out->complete = 1;
        out->complete_group = s->pending_group;
        out->complete_btw = s->pending_btw;
        clear_pending(s);
    }

    /* 2. Post a global sync on global-sync batches, after the completion, so
     * that only one is ever in flight. Its btw is clamped so that it completes
     * by the last batch; the last batch itself therefore always blocks. */
    if (is_global_batch(s, batch, last_batch)) {
        int64_t btw = min64(s->batches_to_wait, last_batch - batch);
        out->send = 1;
        out->send_group = s->send_mod;
        out->send_btw = btw;
        out->send_blocking = btw == 0;
        if (btw > 0) {
            s->pending = 1;
            s->pending_group = s->send_mod;
            s->pending_btw = btw;
            s->pending_sent_at = batch;
        }
        s->send_mod = (s->send_mod + 1) % s->cfg.n_groups;
    }

    /* 3. Local sync for the next backward, then advance the position. */
    /* (batch + 1 would overflow for batch == last_batch == INT64_MAX; after the
     * last batch local sync is on anyway, for batch 0 of the next epoch.) */
    s->local_sync = batch == last_batch
                        ? 1
                        : want_local_sync(s, batch + 1, last_batch, (int)s->pending);
    out->local_sync = (int)s->local_sync;
    if (batch == last_batch) {
        s->epoch++;
        s->next_batch = 0;
        s->last_batch = -1;
        out->epoch_done = 1;
    } else {
        s->next_batch = batch + 1;
        s->last_batch = last_batch;
    }
    return MPIDP_OK;
}
