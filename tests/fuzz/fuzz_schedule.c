/* libFuzzer harness: the DASO schedule state machine (mpidp/daso_schedule.h).
 *
 * The input is a config followed by a program of operations on one schedule:
 * in-order batches, whole epochs, epoch ends with any loss (NaN, infinities,
 * negatives, huge, subnormal), raw batch events (out of order, repeated,
 * negative, past the end, a changed last_batch), resets, re-inits with valid
 * and invalid configs, reconfigure() between epochs and elsewhere, field-by-field corruption of the state (as a tampered
 * checkpoint would give), consistent restores at any batch position and epoch
 * counter (up to 2^63 - 1), checkpoint round trips, NULL arguments.
 *
 * Before every call the harness asks validate() whether the state is valid,
 * then checks the call against the header's contract, recomputed here:
 *   - on an invalid state batch() and epoch_end() fail with MPIDP_EINVAL;
 *   - on a valid state a batch event is accepted exactly when it is the
 *     expected one, and epoch_end exactly between epochs, once per counter;
 *   - every failed call leaves the state byte-for-byte unchanged and, for
 *     batch(), the actions "nothing to do, keep local sync";
 *   - every successful call from a valid state yields the state and actions
 *     the contract gives (a reference model of batch() and of the epoch-end
 *     logic with its plateau detector) and a state validate() accepts;
 *   - the invariants, checked directly as well, against a shadow that knows
 *     only what the actions said: 0 <= btw <= gs <= max_global_skips, ls >= 0
 *     (>= 1 and <= gs when cycling); a blocking send on every epoch's last
 *     batch and nothing pending after it; no completion without a pending
 *     send; at most one pending; a completion exactly btw batches after its
 *     send, with that send's group and btw; groups taken in turn;
 *   - no UB anywhere (UBSan), in particular no signed overflow with huge
 *     counters, batch indices, n_groups or skips.
 *
 * Input layout (fz_int/fz_double: see fuzz_common.h; make_seeds.py writes it):
 *   config: total fz_int(1,40), warmup fz_int(0,5), cooldown fz_int(0,5),
 *           max_global_skips fz_int(1,16), skip_reduction_factor fz_int(2,5),
 *           local_skip_factor fz_int(1,6), n_groups fz_int(1,4),
 *           stability: u8 k < 0xC0 -> {0, .01, .05, .2, .5, .99}[k % 6],
 *           else fz_double
 *   then ops until the input ends, each a u8 (value % 16, see run_op()).
 * reconfigure() (added later) is checked like the rest: its contract, recomputed,
 * and a valid result. */
#include "mpidp/daso_schedule.h"
#include "mpidp/status.h"

#include "../c/daso_schedule_actions.h" /* same_actions(), shared with the C tests */
#include "fuzz_common.h"

#define CODE_BIT(status) (1u << (unsigned)(-(status)))

/* ---- the field list, for corruption, checkpoints and comparisons ---- */

typedef struct {
    const char *name;
    size_t off;
    int is_double;
} field_t;

#define FIELD(type, member)                                                     \
    {#member, offsetof(mpidp_schedule_t, member), (type)0.5 != 0},
static const field_t FIELDS[] = {MPIDP_SCHEDULE_FIELDS(FIELD)};
#undef FIELD
#define N_FIELDS (sizeof FIELDS / sizeof FIELDS[0])

/* Field-wise equality (by bits, so NaN == NaN); returns the first differing
 * field's name, or NULL. */
static const char *diff_state(const mpidp_schedule_t *a, const mpidp_schedule_t *b)
{
    for (size_t i = 0; i < N_FIELDS; i++)
        if (memcmp((const char *)a + FIELDS[i].off, (const char *)b + FIELDS[i].off, 8) != 0)
            return FIELDS[i].name;
    return NULL;
}

static int64_t field_i64(const mpidp_schedule_t *s, const char *name)
{
    for (size_t i = 0; i < N_FIELDS; i++)
        if (strcmp(FIELDS[i].name, name) == 0) {
            int64_t v;
            memcpy(&v, (const char *)s + FIELDS[i].off, 8);
            return v;
        }
    return 0;
}

static void dump_state(const char *title, const mpidp_schedule_t *s)
{
    fprintf(stderr, "%s:", title);
    for (size_t i = 0; i < N_FIELDS; i++) {
        if (FIELDS[i].is_double) {
            double d;
            memcpy(&d, (const char *)s + FIELDS[i].off, 8);
            fprintf(stderr, " %s=%g", FIELDS[i].name, d);
        } else {
            fprintf(stderr, " %s=%lld", FIELDS[i].name,
                    (long long)field_i64(s, FIELDS[i].name));
        }
    }
    fputc('\n', stderr);
}

#define CHECK_STATE(cond, s, ...)                                               \
    do {                                                                        \
        if (!(cond)) {                                                          \
            dump_state("state", (s));                                           \
            FZ_CHECK(cond, __VA_ARGS__);                                        \
        }                                                                       \
    } while (0)

/* ---- reference model, from the contract in mpidp/daso_schedule.h ---- */

static int64_t rmin(int64_t a, int64_t b) { return a < b ? a : b; }
/* Saturating a + b, so that the harness stays free of UB whatever the state. */
static int64_t sadd(int64_t a, int64_t b)
{
    int64_t r;
    if (__builtin_add_overflow(a, b, &r)) return a > 0 ? INT64_MAX : INT64_MIN;
    return r;
}
static int64_t rmax(int64_t a, int64_t b) { return a > b ? a : b; }

static int ref_config_valid(const mpidp_schedule_config_t *c)
{
    return c->total_epochs > 0 && c->warmup_epochs >= 0 && c->cooldown_epochs >= 0 &&
           c->max_global_skips >= 1 && c->skip_reduction_factor >= 2 &&
           c->local_skip_factor >= 1 && c->n_groups >= 1 && c->stability_level >= 0.0 &&
           c->stability_level < 1.0;
}

static int64_t ref_phase_at(const mpidp_schedule_config_t *c, int64_t epoch)
{
    if (epoch < c->warmup_epochs) return MPIDP_SCHEDULE_WARMUP;
    /* epoch >= total - cooldown, without forming total - cooldown. */
    if (epoch >= c->total_epochs || c->total_epochs - epoch <= c->cooldown_epochs)
        return MPIDP_SCHEDULE_COOLDOWN;
    return MPIDP_SCHEDULE_CYCLING;
}

static void ref_enter(mpidp_schedule_t *r, int64_t phase)
{
    r->phase = phase;
    if (phase == MPIDP_SCHEDULE_CYCLING) {
        r->global_skip = rmin(4, r->cfg.max_global_skips);
        r->local_skip = 1;
        r->batches_to_wait = 1;
    } else {
        r->global_skip = r->local_skip = r->batches_to_wait = 0;
    }
}

static void ref_fresh(mpidp_schedule_t *r, const mpidp_schedule_config_t *cfg)
{
    memset(r, 0, sizeof *r);
    r->cfg = *cfg;
    r->logic_epoch = -1;
    r->last_batch = -1;
    r->local_sync = 1;
    ref_enter(r, ref_phase_at(cfg, 0));
}

/* Returns 1 on a plateau. */
static int ref_feed(mpidp_schedule_t *r, double loss)
{
    int improving = isfinite(loss) &&
                    (!r->has_best ||
                     loss < r->best_loss - fabs(r->best_loss) * r->cfg.stability_level);
    if (improving) {
        r->has_best = 1;
        r->best_loss = loss;
        r->bad_epochs = 0;
        return 0;
    }
    if (++r->bad_epochs > MPIDP_SCHEDULE_PATIENCE) {
        r->bad_epochs = 0;
        return 1;
    }
    return 0;
}

static void ref_epoch_end(mpidp_schedule_t *r, double loss)
{
    int64_t c = r->epoch;
    int64_t phase = ref_phase_at(&r->cfg, c);
    r->logic_epoch = c;
    if (phase != MPIDP_SCHEDULE_CYCLING) {
        ref_enter(r, phase);
        return;
    }
    if (r->phase != MPIDP_SCHEDULE_CYCLING) {
        ref_enter(r, MPIDP_SCHEDULE_CYCLING);
        r->has_best = 0;
        r->bad_epochs = 0;
        r->best_loss = 0.0;
        FZ_CHECK(!ref_feed(r, loss), "a fresh detector reported a plateau");
        return;
    }
    if (!ref_feed(r, loss)) return;
    if (r->global_skip > 1) {
        int64_t f = r->cfg.skip_reduction_factor;
        r->global_skip = rmax(r->global_skip / f, 1);
        r->local_skip = rmax(r->local_skip / f, 1);
        r->batches_to_wait = rmin(rmax(r->batches_to_wait - 1, 1), r->global_skip);
    } else {
        int64_t sub = rmax(r->cfg.max_global_skips / r->cfg.local_skip_factor, 1);
        r->global_skip = r->cfg.max_global_skips;
        r->local_skip = sub;
        r->batches_to_wait = sub;
    }
}

static int ref_is_global(const mpidp_schedule_t *r, int64_t b, int64_t last)
{
    return r->global_skip == 0 || b % r->global_skip == 0 || b == last;
}

/* One accepted batch event on a valid state. */
static void ref_batch(mpidp_schedule_t *r, int64_t b, int64_t last, mpidp_schedule_actions_t *x)
{
    memset(x, 0, sizeof *x);
    CHECK_STATE(!(r->pending && b > sadd(r->pending_sent_at, r->pending_btw)), r,
                "validate() passed a state whose pending sync (sent %lld, btw %lld) is "
                "overdue at batch %lld", (long long)r->pending_sent_at,
                (long long)r->pending_btw, (long long)b);
    if (r->pending && sadd(r->pending_sent_at, r->pending_btw) == b) {
        x->complete = 1;
        x->complete_group = r->pending_group;
        x->complete_btw = r->pending_btw;
        r->pending = r->pending_group = r->pending_btw = r->pending_sent_at = 0;
    }
    if (ref_is_global(r, b, last)) {
        CHECK_STATE(!r->pending, r, "a send at batch %lld while one is still pending",
                    (long long)b);
        int64_t btw = rmin(r->batches_to_wait, last - b);
        x->send = 1;
        x->send_group = r->send_mod;
        x->send_btw = btw;
        x->send_blocking = btw == 0;
        if (btw > 0) {
            r->pending = 1;
            r->pending_group = r->send_mod;
            r->pending_btw = btw;
            r->pending_sent_at = b;
        }
        r->send_mod = r->send_mod == r->cfg.n_groups - 1 ? 0 : r->send_mod + 1;
    }
    int ls;
    if (b == last) {
        ls = 1;
    } else {
        int64_t n = b + 1;
        if (ref_is_global(r, n, last) || r->local_skip <= 1 || r->pending)
            ls = 1;
        else
            ls = n % r->local_skip == 0;
    }
    r->local_sync = ls;
    x->local_sync = ls;
    if (b == last) {
        r->epoch++;
        r->next_batch = 0;
        r->last_batch = -1;
        x->epoch_done = 1;
    } else {
        r->next_batch = b + 1;
        r->last_batch = last;
    }
}

/* ---- the shadow: what the caller knows from the actions alone ---- */

typedef struct {
    int pending;
    int64_t group, btw, sent_at;
    int64_t next_group; /* group the next send must use */
} shadow_t;

/* After init/reset, or a corrupted state that validate() accepted: take the
 * state's word for it. */
static void shadow_sync(shadow_t *sh, const mpidp_schedule_t *s)
{
    sh->pending = (int)s->pending;
    sh->group = s->pending_group;
    sh->btw = s->pending_btw;
    sh->sent_at = s->pending_sent_at;
    sh->next_group = s->send_mod;
}

static void print_actions(const char *title, const mpidp_schedule_actions_t *a)
{
    fprintf(stderr, "%s: complete %d (g %lld btw %lld) send %d (g %lld btw %lld blocking %d) "
            "local_sync %d epoch_done %d\n", title, a->complete, (long long)a->complete_group,
            (long long)a->complete_btw, a->send, (long long)a->send_group,
            (long long)a->send_btw, a->send_blocking, a->local_sync, a->epoch_done);
}

/* The bounds every valid state keeps. */
static void check_bounds(const mpidp_schedule_t *s)
{
    CHECK_STATE(s->batches_to_wait >= 0 && s->batches_to_wait <= s->global_skip, s,
                "btw out of [0, gs]");
    CHECK_STATE(s->local_skip >= 0 && s->global_skip >= 0 &&
                s->global_skip <= s->cfg.max_global_skips, s, "skips out of bounds");
    if (s->phase == MPIDP_SCHEDULE_CYCLING)
        CHECK_STATE(s->global_skip >= 1 && s->local_skip >= 1 && s->batches_to_wait >= 1 &&
                    s->local_skip <= s->global_skip, s, "cycling skips below 1 or ls > gs");
    else
        CHECK_STATE(s->global_skip == 0 && s->local_skip == 0 && s->batches_to_wait == 0, s,
                    "warmup/cooldown not blocking");
    CHECK_STATE(s->pending == 0 || s->pending == 1, s, "pending not 0/1");
    CHECK_STATE(!s->has_best || isfinite(s->best_loss), s, "non-finite best loss");
    CHECK_STATE(s->bad_epochs >= 0 && s->bad_epochs <= MPIDP_SCHEDULE_PATIENCE, s,
                "bad_epochs out of range");
    CHECK_STATE(s->send_mod >= 0 && s->send_mod < s->cfg.n_groups, s, "send_mod");
}

/* ---- checked calls ---- */

typedef struct {
    mpidp_schedule_t s;
    shadow_t sh;
    int64_t steps, completions, epochs, plateaus; /* for -print_final_stats style debugging */
} world_t;

static int is_valid(const mpidp_schedule_t *s)
{
    mpidp_schedule_t copy = *s;
    int rc = mpidp_schedule_validate(s);
    FZ_CHECK(memcmp(&copy, s, sizeof copy) == 0, "validate() wrote the state");
    FZ_CHECK(rc == MPIDP_OK || rc == MPIDP_EINVAL, "validate() returned %d", rc);
    if (rc != MPIDP_OK) FZ_CHECK(mpidp_error_detail()[0] != '\0', "validate: no detail");
    return rc == MPIDP_OK;
}

static void expect_failed(int rc, unsigned allowed, const mpidp_schedule_t *before,
                          const mpidp_schedule_t *after, const char *what)
{
    FZ_CHECK(rc < 0 && rc >= -31 && (allowed & CODE_BIT(rc)),
             "%s: returned %s (%s), expected a failure in 0x%x", what, mpidp_status_name(rc),
             mpidp_error_detail(), allowed);
    FZ_CHECK(mpidp_error_detail()[0] != '\0', "%s: failed without a detail", what);
    const char *d = diff_state(before, after);
    FZ_CHECK(d == NULL && memcmp(before, after, sizeof *before) == 0,
             "%s: failed call changed the state (%s)", what, d ? d : "padding");
}

static void do_batch(world_t *w, int64_t b, int64_t last)
{
    mpidp_schedule_t *s = &w->s;
    const mpidp_schedule_t before = *s;
    int valid = is_valid(s);
    mpidp_schedule_actions_t a;
    memset(&a, 0x5A, sizeof a);
    mpidp_error_clear();
    int rc = mpidp_schedule_batch(s, b, last, &a);

    unsigned must = 0;
    if (!valid) {
        must = CODE_BIT(MPIDP_EINVAL);
    } else {
        if (b < 0 || last < 0) must |= CODE_BIT(MPIDP_EINVAL);
        if (b > last) must |= CODE_BIT(MPIDP_ESTATE);
        if (before.next_batch == 0 ? b != 0
                                   : b != before.next_batch || last != before.last_batch)
            must |= CODE_BIT(MPIDP_ESTATE);
        /* An epoch cannot end when its counter could not advance to a value
         * validate() accepts. */
        if (b == last && before.epoch >= INT64_MAX - 1) must |= CODE_BIT(MPIDP_ESTATE);
    }
    if (must) {
        expect_failed(rc, must, &before, s, "batch");
        mpidp_schedule_actions_t none = {0};
        none.local_sync = (int)before.local_sync;
        if (!same_actions(&a, &none)) {
            print_actions("got", &a);
            FZ_CHECK(0, "refused batch(%lld, %lld) did not set 'no action, keep local sync'",
                     (long long)b, (long long)last);
        }
        return;
    }
    if (rc != MPIDP_OK) dump_state("before", &before);
    FZ_CHECK(rc == MPIDP_OK, "batch(%lld, %lld) refused a valid event: %s (%s)", (long long)b,
             (long long)last, mpidp_status_name(rc), mpidp_error_detail());

    mpidp_schedule_t r = before;
    mpidp_schedule_actions_t x;
    ref_batch(&r, b, last, &x);
    const char *d = diff_state(&r, s);
    if (d || !same_actions(&a, &x)) {
        dump_state("before", &before);
        dump_state("expected", &r);
        dump_state("got", s);
        print_actions("expected", &x);
        print_actions("got", &a);
        FZ_CHECK(0, "batch(%lld, %lld) differs from the contract (field %s)", (long long)b,
                 (long long)last, d ? d : "actions");
    }
    if (!is_valid(s)) {
        dump_state("before", &before);
        dump_state("after", s);
        FZ_CHECK(0, "batch(%lld, %lld) took a valid state to one validate() refuses: %s",
                 (long long)b, (long long)last, mpidp_error_detail());
    }
    check_bounds(s);

    /* The invariants, from the actions alone. */
    shadow_t *sh = &w->sh;
    if (a.complete) {
        FZ_CHECK(sh->pending, "completion at batch %lld without a pending send", (long long)b);
        FZ_CHECK(a.complete_btw >= 1 && a.complete_btw == sh->btw && a.complete_group == sh->group,
                 "completion (g %lld btw %lld) is not of the send (g %lld btw %lld)",
                 (long long)a.complete_group, (long long)a.complete_btw, (long long)sh->group,
                 (long long)sh->btw);
        FZ_CHECK(b == sadd(sh->sent_at, sh->btw), "completion at %lld, send at %lld with btw %lld",
                 (long long)b, (long long)sh->sent_at, (long long)sh->btw);
        sh->pending = 0;
        w->completions++;
    } else {
        FZ_CHECK(!sh->pending || b < sadd(sh->sent_at, sh->btw), "pending send overdue at %lld",
                 (long long)b);
    }
    if (a.send) {
        FZ_CHECK(!sh->pending, "second send at %lld while one is pending", (long long)b);
        FZ_CHECK(a.send_group == sh->next_group, "send on group %lld, turn of %lld",
                 (long long)a.send_group, (long long)sh->next_group);
        FZ_CHECK(a.send_btw >= 0 && a.send_btw <= last - b &&
                 a.send_btw <= before.batches_to_wait,
                 "send_btw %lld", (long long)a.send_btw);
        FZ_CHECK(a.send_blocking == (a.send_btw == 0), "blocking flag");
        sh->next_group = a.send_group + 1 == s->cfg.n_groups ? 0 : a.send_group + 1;
        if (!a.send_blocking) {
            sh->pending = 1;
            sh->group = a.send_group;
            sh->btw = a.send_btw;
            sh->sent_at = b;
        }
    }
    if (b == last) {
        FZ_CHECK(a.epoch_done && a.send && a.send_blocking && !sh->pending && !s->pending,
                 "last batch %lld did not end in a blocking sync with nothing pending",
                 (long long)b);
        FZ_CHECK(a.local_sync, "local sync off before batch 0");
        w->epochs++;
    } else {
        FZ_CHECK(!a.epoch_done, "epoch_done before the last batch");
    }
    FZ_CHECK(s->pending == sh->pending, "state pending %lld, actions imply %d",
             (long long)s->pending, sh->pending);
    w->steps++;
}

static void do_epoch_end(world_t *w, double loss)
{
    mpidp_schedule_t *s = &w->s;
    const mpidp_schedule_t before = *s;
    int valid = is_valid(s);
    mpidp_error_clear();
    int rc = mpidp_schedule_epoch_end(s, loss);
    if (!valid) {
        expect_failed(rc, CODE_BIT(MPIDP_EINVAL), &before, s, "epoch_end on an invalid state");
        return;
    }
    if (before.next_batch != 0 || before.logic_epoch == before.epoch) {
        expect_failed(rc, CODE_BIT(MPIDP_ESTATE), &before, s, "epoch_end out of place");
        return;
    }
    FZ_CHECK(rc == MPIDP_OK, "epoch_end(%g) refused: %s (%s)", loss, mpidp_status_name(rc),
             mpidp_error_detail());
    mpidp_schedule_t r = before;
    ref_epoch_end(&r, loss);
    const char *d = diff_state(&r, s);
    if (d) {
        dump_state("before", &before);
        dump_state("expected", &r);
        dump_state("got", s);
        FZ_CHECK(0, "epoch_end(%g) differs from the contract in %s", loss, d);
    }
    if (!is_valid(s)) {
        dump_state("after", s);
        FZ_CHECK(0, "epoch_end(%g) left a state validate() refuses: %s", loss,
                 mpidp_error_detail());
    }
    check_bounds(s);
    if (s->global_skip < before.global_skip && s->phase == MPIDP_SCHEDULE_CYCLING &&
        before.phase == MPIDP_SCHEDULE_CYCLING)
        w->plateaus++;
}

/* reconfigure(), from its contract: between epochs with nothing pending, the
 * next epoch's phase is recomputed for the new config; cycling that stays
 * cycling keeps its tuned skips clamped to the new max_global_skips; entering
 * cycling starts fresh; n_groups cannot change. */
static void ref_reconfigure(mpidp_schedule_t *r, const mpidp_schedule_config_t *cfg)
{
    int64_t old_phase = r->phase;
    r->cfg = *cfg;
    /* The phase in force is the one decided at the last epoch_end (epoch 0
     * before any), which is what validate() checks. */
    int64_t phase = ref_phase_at(cfg, r->logic_epoch < 0 ? 0 : r->logic_epoch);
    if (phase != MPIDP_SCHEDULE_CYCLING) {
        ref_enter(r, phase);
        if (phase == MPIDP_SCHEDULE_WARMUP) { /* validate(): no fed detector in warmup */
            r->has_best = 0;
            r->bad_epochs = 0;
            r->best_loss = 0.0;
        }
    } else if (old_phase != MPIDP_SCHEDULE_CYCLING) {
        ref_enter(r, MPIDP_SCHEDULE_CYCLING);
        r->has_best = 0;
        r->bad_epochs = 0;
        r->best_loss = 0.0;
    } else {
        r->global_skip = rmin(r->global_skip, cfg->max_global_skips);
        r->local_skip = rmin(r->local_skip, r->global_skip);
        r->batches_to_wait = rmin(r->batches_to_wait, r->global_skip);
    }
}

static void do_reconfigure(world_t *w, const mpidp_schedule_config_t *cfg)
{
    mpidp_schedule_t *s = &w->s;
    const mpidp_schedule_t before = *s;
    int valid = is_valid(s);
    mpidp_error_clear();
    int rc = mpidp_schedule_reconfigure(s, cfg);
    unsigned must = 0;
    if (!valid || !ref_config_valid(cfg)) must |= CODE_BIT(MPIDP_EINVAL);
    if (valid && (before.next_batch != 0 || before.pending)) must |= CODE_BIT(MPIDP_ESTATE);
    if (valid && cfg->n_groups != before.cfg.n_groups) must |= CODE_BIT(MPIDP_EINVAL);
    if (must) {
        expect_failed(rc, must, &before, s, "reconfigure");
        return;
    }
    mpidp_schedule_t r = before;
    ref_reconfigure(&r, cfg);
    if (rc != MPIDP_OK) {
        dump_state("before", &before);
        dump_state("contract gives", &r);
        FZ_CHECK(0, "reconfigure refused a valid call between epochs: %s (%s)",
                 mpidp_status_name(rc), mpidp_error_detail());
    }
    const char *d = diff_state(&r, s);
    if (d) {
        dump_state("before", &before);
        dump_state("expected", &r);
        dump_state("got", s);
        FZ_CHECK(0, "reconfigure differs from the contract in %s", d);
    }
    FZ_CHECK(is_valid(s), "reconfigure left a state validate() refuses: %s", mpidp_error_detail());
    check_bounds(s);
}

static void gen_config(fz_t *f, mpidp_schedule_config_t *c)
{
    static const double levels[6] = {0.0, 0.01, 0.05, 0.2, 0.5, 0.99};
    c->total_epochs = fz_int(f, 1, 40);
    c->warmup_epochs = fz_int(f, 0, 5);
    c->cooldown_epochs = fz_int(f, 0, 5);
    c->max_global_skips = fz_int(f, 1, 16);
    c->skip_reduction_factor = fz_int(f, 2, 5);
    c->local_skip_factor = fz_int(f, 1, 6);
    c->n_groups = fz_int(f, 1, 4);
    uint8_t k = fz_u8(f);
    c->stability_level = k < 0xC0 ? levels[k % 6] : fz_double(f);
}

/* init(), or reset() when cfg is NULL; self_cfg: init(&s, &s.cfg). */
static void do_init(world_t *w, const mpidp_schedule_config_t *cfg, int self_cfg)
{
    mpidp_schedule_t *s = &w->s;
    const mpidp_schedule_t before = *s;
    const mpidp_schedule_config_t *want = cfg && !self_cfg ? cfg : &before.cfg;
    mpidp_schedule_config_t want_copy = *want;
    mpidp_error_clear();
    int crc = mpidp_schedule_config_validate(want);
    FZ_CHECK((crc == MPIDP_OK) == ref_config_valid(want), "config_validate says %s",
             mpidp_status_name(crc));
    mpidp_error_clear();
    int rc = cfg == NULL ? mpidp_schedule_reset(s)
             : self_cfg  ? mpidp_schedule_init(s, &s->cfg)
                         : mpidp_schedule_init(s, cfg);
    if (!ref_config_valid(&want_copy)) {
        expect_failed(rc, CODE_BIT(MPIDP_EINVAL), &before, s, cfg ? "init" : "reset");
        return;
    }
    FZ_CHECK(rc == MPIDP_OK, "init/reset with a valid config: %s (%s)", mpidp_status_name(rc),
             mpidp_error_detail());
    mpidp_schedule_t r;
    ref_fresh(&r, &want_copy);
    const char *d = diff_state(&r, s);
    if (d) {
        dump_state("expected", &r);
        dump_state("got", s);
        FZ_CHECK(0, "init/reset state differs in %s", d);
    }
    FZ_CHECK(is_valid(s), "fresh state refused by validate: %s", mpidp_error_detail());
    check_bounds(s);
    shadow_sync(&w->sh, s);
}

static void do_corrupt(world_t *w, fz_t *f)
{
    const field_t *fd = &FIELDS[fz_u8(f) % N_FIELDS];
    char *p = (char *)&w->s + fd->off;
    if (fd->is_double) {
        double v = fz_double(f);
        memcpy(p, &v, 8);
    } else {
        int64_t v;
        uint8_t mode = fz_u8(f);
        memcpy(&v, p, 8);
        switch (mode % 4) {
        case 0: v = fz_int(f, -2, 16); break;
        case 1: v = (int64_t)((uint64_t)v + (uint64_t)fz_int(f, -3, 3)); break; /* off a little */
        case 2: v = fz_int(f, 0, 255); break;
        default: v = (int64_t)((uint64_t)v ^ ((uint64_t)1 << (fz_u8(f) % 64))); break;
        }
        memcpy(p, &v, 8);
    }
    if (is_valid(&w->s)) {
        check_bounds(&w->s);
        shadow_sync(&w->sh, &w->s);
    }
}

/* Restore a checkpoint taken at batch n of an epoch ending at last (and, on
 * request, at another epoch counter and send group): the batch-level fields
 * are derived from the header's rules, so validate() must accept the result.
 * This reaches positions no run could (batch 2^63 - 1) in one step. */
static void do_jump(world_t *w, fz_t *f)
{
    mpidp_schedule_t *s = &w->s;
    int64_t n = fz_int(f, 0, 12), last = fz_int(f, 0, 12);
    uint8_t k = fz_u8(f);
    int64_t epoch = k & 1 ? fz_int(f, 0, 12) : s->epoch;
    int64_t send_mod = k & 2 ? fz_int(f, 0, 3) : s->send_mod;
    if (!is_valid(s) || n < 0 || last < 0 || epoch < s->epoch || epoch == INT64_MAX ||
        send_mod < 0)
        return;
    if (n > last) {
        int64_t t = n;
        n = last;
        last = t;
    }
    s->epoch = epoch;
    s->send_mod = send_mod % s->cfg.n_groups;
    s->pending = s->pending_group = s->pending_btw = s->pending_sent_at = 0;
    if (n == 0) {
        s->next_batch = 0;
        s->last_batch = -1;
        s->local_sync = 1;
    } else {
        const int64_t gs = s->global_skip;
        s->next_batch = n;
        s->last_batch = last;
        if (gs > 0) {
            /* The latest send: the last multiple of gs before n. */
            int64_t sent_at = (n - 1) / gs * gs;
            int64_t btw = rmin(s->batches_to_wait, last - sent_at);
            if (btw > 0 && sent_at + btw >= n) {
                s->pending = 1;
                s->pending_sent_at = sent_at;
                s->pending_btw = btw;
                s->pending_group = s->send_mod == 0 ? s->cfg.n_groups - 1 : s->send_mod - 1;
            }
        }
        s->local_sync = ref_is_global(s, n, last) || s->local_skip <= 1 || s->pending ||
                        n % s->local_skip == 0;
    }
    if (!is_valid(s)) {
        dump_state("restored", s);
        FZ_CHECK(0, "validate() refuses a state derived from the rules: %s",
                 mpidp_error_detail());
    }
    check_bounds(s);
    shadow_sync(&w->sh, s);
}

static void do_checkpoint(world_t *w)
{
    unsigned char saved[sizeof(mpidp_schedule_t)];
    size_t at = 0;
    const mpidp_schedule_t *src = &w->s;
#define SAVE(type, member)                                                      \
    memcpy(saved + at, &src->member, sizeof(type));                             \
    at += sizeof(type);
    MPIDP_SCHEDULE_FIELDS(SAVE)
#undef SAVE
    FZ_CHECK(at == sizeof *src, "MPIDP_SCHEDULE_FIELDS covers %zu of %zu bytes", at, sizeof *src);
    mpidp_schedule_t dst;
    memset(&dst, 0xA5, sizeof dst);
    at = 0;
#define LOAD(type, member)                                                      \
    memcpy(&dst.member, saved + at, sizeof(type));                              \
    at += sizeof(type);
    MPIDP_SCHEDULE_FIELDS(LOAD)
#undef LOAD
    FZ_CHECK(memcmp(&dst, src, sizeof dst) == 0, "checkpoint round trip differs");
    FZ_CHECK(is_valid(&dst) == is_valid(src), "validate differs after a round trip");
    w->s = dst;
}

static void do_nulls(world_t *w, fz_t *f)
{
    mpidp_schedule_config_t cfg;
    mpidp_schedule_config_default(NULL);
    mpidp_schedule_config_default(&cfg);
    FZ_CHECK(cfg.total_epochs == 0 && !ref_config_valid(&cfg), "default config");
    cfg.total_epochs = 1;
    FZ_CHECK(ref_config_valid(&cfg), "default config with total_epochs = 1");
    mpidp_schedule_actions_t a;
    memset(&a, 0x5A, sizeof a);
    mpidp_error_clear();
    FZ_CHECK(mpidp_schedule_config_validate(NULL) == MPIDP_EINVAL, "config_validate(NULL)");
    FZ_CHECK(mpidp_schedule_init(NULL, &cfg) == MPIDP_EINVAL, "init(NULL, cfg)");
    FZ_CHECK(mpidp_schedule_reset(NULL) == MPIDP_EINVAL, "reset(NULL)");
    FZ_CHECK(mpidp_schedule_validate(NULL) == MPIDP_EINVAL, "validate(NULL)");
    FZ_CHECK(mpidp_schedule_epoch_end(NULL, 1.0) == MPIDP_EINVAL, "epoch_end(NULL)");
    FZ_CHECK(mpidp_schedule_batch(NULL, 0, 0, &a) == MPIDP_EINVAL, "batch(NULL)");
    mpidp_schedule_actions_t none = {0};
    none.local_sync = 1;
    FZ_CHECK(same_actions(&a, &none), "batch(NULL) actions");
    const mpidp_schedule_t before = w->s;
    FZ_CHECK(mpidp_schedule_init(&w->s, NULL) == MPIDP_EINVAL, "init(s, NULL)");
    FZ_CHECK(mpidp_schedule_batch(&w->s, w->s.next_batch, w->s.last_batch, NULL) ==
             MPIDP_EINVAL, "batch(s, NULL actions)");
    FZ_CHECK(memcmp(&before, &w->s, sizeof before) == 0, "NULL-argument calls changed s");
    int64_t any = fz_int(f, -1, 3);
    const char *name = mpidp_schedule_phase_name(any);
    FZ_CHECK(name != NULL && ((any >= 0 && any <= 2) == (strcmp(name, "unknown") != 0)),
             "phase_name(%lld) = %s", (long long)any, name);
}

/* Runs batches in order to the end of the current epoch (at most `cap`). */
static void run_epoch(world_t *w, fz_t *f, int64_t cap)
{
    int64_t last = w->s.next_batch == 0 ? fz_int(f, 0, 12) : w->s.last_batch;
    for (int64_t i = 0; i < cap; i++) {
        int64_t b = w->s.next_batch;
        int ended = b == last;
        do_batch(w, b, last);
        if (ended || w->s.next_batch != b + 1) break;
    }
}

static void run_op(world_t *w, fz_t *f)
{
    uint8_t op = fz_u8(f) % 16;
    switch (op) {
    case 0: case 1: case 2: case 3: { /* the next batch, in order */
        int64_t last = w->s.next_batch == 0 ? fz_int(f, 0, 12) : w->s.last_batch;
        do_batch(w, w->s.next_batch, last);
        break;
    }
    case 4: case 5: /* the rest of the epoch, then its end */
        run_epoch(w, f, 4096);
        do_epoch_end(w, fz_double(f));
        break;
    case 6: /* an epoch end, wherever we are */
        do_epoch_end(w, fz_double(f));
        break;
    case 7: { /* any batch event: repeated, skipped, negative, past the end... */
        uint8_t k = fz_u8(f);
        int64_t n = w->s.next_batch, l = w->s.last_batch;
        /* Near the expected event, wrapping (unsigned arithmetic: the harness
         * itself must not overflow), or anywhere. */
        int64_t b = k & 1 ? fz_int(f, -1, 12) : (int64_t)((uint64_t)n + k % 5 - 2);
        int64_t last = k & 2 ? fz_int(f, -1, 12) : (int64_t)((uint64_t)l + (k >> 2) % 3 - 1);
        do_batch(w, b, last);
        break;
    }
    case 8: do_init(w, NULL, 0); break;
    case 9: do_corrupt(w, f); break;
    case 10: do_jump(w, f); break;
    case 11: do_checkpoint(w); break;
    case 12: {
        mpidp_schedule_config_t cfg;
        gen_config(f, &cfg);
        do_init(w, &cfg, fz_u8(f) & 1);
        break;
    }
    case 13: do_nulls(w, f); break;
    case 15: { /* a new config between epochs (usually with the same n_groups) */
        mpidp_schedule_config_t cfg;
        gen_config(f, &cfg);
        if (fz_u8(f) < 0xE0) cfg.n_groups = w->s.cfg.n_groups;
        do_reconfigure(w, &cfg);
        break;
    }
    default: { /* many epochs on autopilot: losses that plateau or improve */
        uint8_t n = fz_u8(f), pattern = fz_u8(f);
        double loss = 10.0;
        for (unsigned i = 0; i < n && is_valid(&w->s); i++) {
            if (w->s.next_batch == 0 && w->s.logic_epoch != w->s.epoch && w->s.epoch > 0) {
                if ((pattern >> (i % 8)) & 1) loss *= 0.5;
                do_epoch_end(w, loss);
            } else {
                int64_t last = w->s.next_batch == 0 ? (int64_t)((pattern + i) % 13)
                                                     : w->s.last_batch;
                int64_t b = w->s.next_batch;
                do_batch(w, b, last);
            }
        }
        break;
    }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_t f = {data, size};
    world_t w;
    memset(&w, 0, sizeof w);
    memset(&w.s, 0xA5, sizeof w.s); /* garbage: every call must refuse it */
    mpidp_schedule_config_t cfg;
    gen_config(&f, &cfg);
    do_init(&w, &cfg, 0);
    if (!ref_config_valid(&cfg)) {
        /* A few calls on the garbage state, then a valid config so that the
         * rest of the input still explores the machine. */
        do_batch(&w, 0, 3);
        do_epoch_end(&w, 1.0);
        mpidp_schedule_config_default(&cfg);
        cfg.total_epochs = 12;
        do_init(&w, &cfg, 0);
    }
    for (int ops = 0; !fz_empty(&f) && ops < 4096; ops++) run_op(&w, &f);
    return 0;
}
