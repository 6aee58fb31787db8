/* The DASO schedule, epoch level: configuration, phases, the plateau detector
 * and the skip reductions. Per-batch traces are in test_daso_schedule_batches.c,
 * the invariant fuzzer and validate() in test_daso_schedule_fuzz.c.
 *
 * Epoch traces are written as one string, one token per epoch: the phase
 * letter (w warmup, c cycling, d cooldown) and the (gs, ls, btw) in force
 * during that epoch, so a failure prints the whole trace side by side. */
#include "mpidp/daso_schedule.h"
#include "mpidp/status.h"
#include "test.h"

#include <stddef.h>

static char phase_letter(int64_t phase)
{
    switch (phase) {
    case MPIDP_SCHEDULE_WARMUP: return 'w';
    case MPIDP_SCHEDULE_CYCLING: return 'c';
    case MPIDP_SCHEDULE_COOLDOWN: return 'd';
    }
    return '?';
}

/* Run `n` epochs of `last_batch + 1` batches each, calling epoch_end with
 * losses[e] after epoch e, and write the per-epoch settings to `trace`.
 * Returns the first failing status, or -100 when the epoch counter does not
 * follow Heat's "after 0-based epoch e it is e + 1". */
static int run_epochs(mpidp_schedule_t *s, int n, const double *losses,
                      int64_t last_batch, char *trace, size_t cap)
{
    size_t used = 0;
    trace[0] = '\0';
    for (int e = 0; e < n; e++) {
        int w = snprintf(trace + used, cap - used, "%s%c%lld,%lld,%lld",
                         e ? " " : "", phase_letter(s->phase),
                         (long long)s->global_skip, (long long)s->local_skip,
                         (long long)s->batches_to_wait);
        if (w < 0 || (size_t)w >= cap - used) return -101;
        used += (size_t)w;
        for (int64_t b = 0; b <= last_batch; b++) {
            mpidp_schedule_actions_t a;
            int rc = mpidp_schedule_batch(s, b, last_batch, &a);
            if (rc != MPIDP_OK) return rc;
        }
        if (s->epoch != e + 1) return -100;
        int rc = mpidp_schedule_epoch_end(s, losses[e]);
        if (rc != MPIDP_OK) return rc;
        rc = mpidp_schedule_validate(s);
        if (rc != MPIDP_OK) return rc;
    }
    return MPIDP_OK;
}

static void fill(double *losses, int n, double v)
{
    for (int i = 0; i < n; i++) losses[i] = v;
}

/* A fresh schedule of `cfg` run for `n` (at most 64) epochs of
 * `last_batch + 1` batches with a flat loss (1.0 every epoch, which never
 * improves on the first), its trace written as run_epochs does. */
static int flat_trace(mpidp_schedule_t *s, const mpidp_schedule_config_t *cfg, int n,
                      int64_t last_batch, char *trace, size_t cap)
{
    double losses[64];
    if (n > 64) return -102;
    fill(losses, n, 1.0);
    int rc = mpidp_schedule_init(s, cfg);
    return rc == MPIDP_OK ? run_epochs(s, n, losses, last_batch, trace, cap) : rc;
}

static mpidp_schedule_config_t config(int64_t total, int64_t warmup, int64_t cooldown)
{
    mpidp_schedule_config_t cfg;
    mpidp_schedule_config_default(&cfg);
    cfg.total_epochs = total;
    cfg.warmup_epochs = warmup;
    cfg.cooldown_epochs = cooldown;
    return cfg;
}

TEST(defaults_are_heats)
{
    mpidp_schedule_config_t cfg;
    mpidp_schedule_config_default(&cfg);
    ASSERT_EQ_INT(cfg.total_epochs, 0);
    ASSERT_EQ_INT(cfg.warmup_epochs, 4);
    ASSERT_EQ_INT(cfg.cooldown_epochs, 4);
    ASSERT_EQ_INT(cfg.max_global_skips, 8);
    ASSERT_EQ_INT(cfg.skip_reduction_factor, 2);
    ASSERT_EQ_INT(cfg.local_skip_factor, 4);
    ASSERT_EQ_INT(cfg.n_groups, 1);
    ASSERT_NEAR(cfg.stability_level, 0.05, 0);
    /* total_epochs has no sensible default: the default config is refused. */
    ASSERT_EQ_INT(mpidp_schedule_config_validate(&cfg), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "total_epochs") != NULL);
    mpidp_schedule_config_default(NULL);
}

/* The trace of the behaviour document, defaults and a flat loss over 30 epochs.
 * Derivation (c = epoch counter when epoch_end runs, after 0-based epoch c-1):
 * c = 1..3 < warmup: (0,0,0) for epochs 1-3 (epoch 0 from init). c = 4 ==
 * warmup: cycling (4,1,1) for epochs 4-6; the detector takes loss 1.0 as its
 * best. c = 5, 6: non-improving 1 and 2; c = 7: 3 > patience, plateau: gs 4/2,
 * ls max(1/2, 1), btw max(0, 1) -> (2,1,1) for 7-9. c = 10: (1,1,1) for 10-12.
 * c = 13, plateau at gs 1: reset to (8, 8/4, 8/4) for 13-15. Then (4,1,1)
 * 16-18, (2,1,1) 19-21, (1,1,1) 22-24, (8,2,2) at c = 25 for epoch 25, and
 * c >= 30 - 4 = 26 is cooldown for epochs 26-29. */
TEST(flat_loss_30_epochs_matches_heat)
{
    mpidp_schedule_config_t cfg = config(30, 4, 4);
    mpidp_schedule_t s;
    char trace[1024];
    ASSERT_OK(flat_trace(&s, &cfg, 30, 9, trace, sizeof trace));
    ASSERT_STREQ(trace,
                 "w0,0,0 w0,0,0 w0,0,0 w0,0,0 "
                 "c4,1,1 c4,1,1 c4,1,1 c2,1,1 c2,1,1 c2,1,1 c1,1,1 c1,1,1 c1,1,1 "
                 "c8,2,2 c8,2,2 c8,2,2 c4,1,1 c4,1,1 c4,1,1 c2,1,1 c2,1,1 c2,1,1 "
                 "c1,1,1 c1,1,1 c1,1,1 c8,2,2 "
                 "d0,0,0 d0,0,0 d0,0,0 d0,0,0");
    ASSERT_EQ_INT(s.epoch, 30);
    ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_COOLDOWN);
}

/* A loss that improves by more than 5 % every epoch never plateaus, so the
 * cycling phase keeps its first setting. */
TEST(improving_loss_stays_at_4_1_1)
{
    mpidp_schedule_config_t cfg = config(30, 4, 4);
    mpidp_schedule_t s;
    double losses[30];
    char trace[1024];
    for (int e = 0; e < 30; e++) losses[e] = 10.0 * pow(0.9, e);
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    ASSERT_OK(run_epochs(&s, 30, losses, 3, trace, sizeof trace));
    ASSERT_STREQ(trace,
                 "w0,0,0 w0,0,0 w0,0,0 w0,0,0 "
                 "c4,1,1 c4,1,1 c4,1,1 c4,1,1 c4,1,1 c4,1,1 c4,1,1 c4,1,1 c4,1,1 "
                 "c4,1,1 c4,1,1 c4,1,1 c4,1,1 c4,1,1 c4,1,1 c4,1,1 c4,1,1 c4,1,1 "
                 "c4,1,1 c4,1,1 c4,1,1 c4,1,1 "
                 "d0,0,0 d0,0,0 d0,0,0 d0,0,0");
}

/* Heat never leaves warmup with warmup_epochs = 0; mpidp starts cycling at
 * once. No epoch_end precedes epoch 0, so the detector's first value is epoch
 * 0's loss (c = 1) and the plateau comes at c = 4: the first setting lasts four
 * epochs here, three after a warmup. Then as in the default trace, shifted. */
TEST(warmup_zero_starts_cycling)
{
    mpidp_schedule_config_t cfg = config(20, 0, 0);
    mpidp_schedule_t s;
    double losses[20];
    char trace[1024];
    fill(losses, 20, 2.5);
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_CYCLING);
    /* Batch 0 of epoch 0 already posts a non-blocking global sync. */
    mpidp_schedule_t copy = s;
    mpidp_schedule_actions_t a;
    ASSERT_OK(mpidp_schedule_batch(&copy, 0, 9, &a));
    ASSERT_TRUE(a.send && !a.send_blocking && a.send_btw == 1);
    ASSERT_OK(run_epochs(&s, 20, losses, 9, trace, sizeof trace));
    ASSERT_STREQ(trace,
                 "c4,1,1 c4,1,1 c4,1,1 c4,1,1 c2,1,1 c2,1,1 c2,1,1 "
                 "c1,1,1 c1,1,1 c1,1,1 c8,2,2 c8,2,2 c8,2,2 c4,1,1 c4,1,1 c4,1,1 "
                 "c2,1,1 c2,1,1 c2,1,1 c1,1,1");
}

/* A flat-loss run of config(total, warmup, cooldown) with some skip settings
 * changed (0 keeps the default), over `epochs` epochs (0: total) of
 * last_batch + 1 batches, and the trace it must give. */
typedef struct {
    int64_t total, warmup, cooldown, epochs, last_batch;
    int64_t max_global_skips, skip_reduction_factor, local_skip_factor;
    const char *want;
} flat_case_t;

/* Runs every case; returns how many gave another trace (each printed). */
static int flat_cases_failed(const flat_case_t *c, size_t n)
{
    int failed = 0;
    for (size_t i = 0; i < n; i++) {
        mpidp_schedule_config_t cfg = config(c[i].total, c[i].warmup, c[i].cooldown);
        if (c[i].max_global_skips) cfg.max_global_skips = c[i].max_global_skips;
        if (c[i].skip_reduction_factor) cfg.skip_reduction_factor = c[i].skip_reduction_factor;
        if (c[i].local_skip_factor) cfg.local_skip_factor = c[i].local_skip_factor;
        mpidp_schedule_t s;
        char trace[512] = "";
        int epochs = (int)(c[i].epochs ? c[i].epochs : c[i].total);
        int rc = flat_trace(&s, &cfg, epochs, c[i].last_batch, trace, sizeof trace);
        if (rc != MPIDP_OK) {
            fprintf(stderr, "  case %zu: status %d (%s)\n", i, rc, mpidp_error_detail());
            failed++;
        } else if (strcmp(trace, c[i].want) != 0) {
            fprintf(stderr, "  case %zu: trace\n    \"%s\", expected\n    \"%s\"\n", i, trace,
                    c[i].want);
            failed++;
        }
    }
    return failed;
}

#define N_CASES(cases) (sizeof(cases) / sizeof((cases)[0]))

/* Cooldown at the end, short runs where phases overlap or leave no cycling. */
TEST(cooldown_and_overlapping_phases)
{
    static const flat_case_t cases[] = {
        /* Warmup 1, cooldown 3 of 6: c = 1 enters cycling, c >= 3 is cooldown. */
        {.total = 6, .warmup = 1, .cooldown = 3, .last_batch = 2,
         .want = "w0,0,0 c4,1,1 c4,1,1 d0,0,0 d0,0,0 d0,0,0"},
        /* Cooldown covering every epoch: cooldown from init. */
        {.total = 3, .cooldown = 3, .epochs = 4, .last_batch = 2,
         .want = "d0,0,0 d0,0,0 d0,0,0 d0,0,0"},
        /* Heat's defaults on a 5-epoch smoke test: warmup 4 + cooldown 4 > 5 is
         * accepted; warmup wins while it lasts, then cooldown, never cycling. */
        {.total = 5, .warmup = 4, .cooldown = 4, .epochs = 7, .last_batch = 2,
         .want = "w0,0,0 w0,0,0 w0,0,0 w0,0,0 d0,0,0 d0,0,0 d0,0,0"},
        /* warmup + cooldown == total: no cycling either. */
        {.total = 4, .warmup = 2, .cooldown = 2, .last_batch = 0,
         .want = "w0,0,0 w0,0,0 d0,0,0 d0,0,0"},
        /* Training past total_epochs stays in cooldown. */
        {.total = 2, .cooldown = 1, .epochs = 5, .last_batch = 1,
         .want = "c4,1,1 d0,0,0 d0,0,0 d0,0,0 d0,0,0"},
    };
    ASSERT_EQ_INT(flat_cases_failed(cases, N_CASES(cases)), 0);
}

/* max_global_skips below Heat's fixed first gs of 4: the first setting is
 * clamped to max_global_skips; ls = btw = max / 4 = 0 on a reset becomes 1. */
TEST(max_global_skips_1_2_3)
{
    static const flat_case_t cases[] = {
        /* gs == 1 plateaus reset to (1, 1, 1) */
        {.total = 13, .last_batch = 4, .max_global_skips = 1,
         .want = "c1,1,1 c1,1,1 c1,1,1 c1,1,1 c1,1,1 c1,1,1 c1,1,1 "
                 "c1,1,1 c1,1,1 c1,1,1 c1,1,1 c1,1,1 c1,1,1"},
        /* 2 -> 1 -> reset (2, max(2/4, 1), 1) */
        {.total = 13, .last_batch = 4, .max_global_skips = 2,
         .want = "c2,1,1 c2,1,1 c2,1,1 c2,1,1 c1,1,1 c1,1,1 c1,1,1 "
                 "c2,1,1 c2,1,1 c2,1,1 c1,1,1 c1,1,1 c1,1,1"},
        /* 3 -> 3/2 = 1 -> reset (3, 1, 1) */
        {.total = 13, .last_batch = 4, .max_global_skips = 3,
         .want = "c3,1,1 c3,1,1 c3,1,1 c3,1,1 c1,1,1 c1,1,1 c1,1,1 "
                 "c3,1,1 c3,1,1 c3,1,1 c1,1,1 c1,1,1 c1,1,1"},
    };
    ASSERT_EQ_INT(flat_cases_failed(cases, N_CASES(cases)), 0);
}

/* skip_reduction_factor 3: 4/3 = 1, then reset (8,2,2), 8/3 = 2 with ls
 * 2/3 = 0 -> 1 and btw 2-1 = 1, then 2/3 = 0, which Heat would keep (a
 * blocking cycling phase it never leaves); mpidp holds gs at 1 so the cycle
 * restarts. A huge factor drops straight to 1 every time. */
TEST(skip_reduction_factor_edges)
{
    static const flat_case_t cases[] = {
        {.total = 16, .last_batch = 5, .skip_reduction_factor = 3,
         .want = "c4,1,1 c4,1,1 c4,1,1 c4,1,1 c1,1,1 c1,1,1 c1,1,1 "
                 "c8,2,2 c8,2,2 c8,2,2 c2,1,1 c2,1,1 c2,1,1 "
                 "c1,1,1 c1,1,1 c1,1,1"},
        {.total = 16, .last_batch = 5, .skip_reduction_factor = 1000000,
         .want = "c4,1,1 c4,1,1 c4,1,1 c4,1,1 c1,1,1 c1,1,1 c1,1,1 "
                 "c8,2,2 c8,2,2 c8,2,2 c1,1,1 c1,1,1 c1,1,1 "
                 "c8,2,2 c8,2,2 c8,2,2"},
    };
    ASSERT_EQ_INT(flat_cases_failed(cases, N_CASES(cases)), 0);

    /* 1 would never reduce anything: refused. */
    mpidp_schedule_t s;
    mpidp_schedule_config_t cfg = config(16, 0, 0);
    cfg.skip_reduction_factor = 1;
    ASSERT_EQ_INT(mpidp_schedule_init(&s, &cfg), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "skip_reduction_factor") != NULL);
}

/* local_skip_factor 1 resets to (8,8,8); the next reduction gives btw 7 > gs 4
 * in Heat, clamped to 4 here so the pending sync is done by the next global
 * sync: (4,4,4), then (2,2,2), (1,1,1), (8,8,8). */
TEST(local_skip_factor_one_keeps_btw_within_gs)
{
    static const flat_case_t cases[] = {
        {.total = 19, .last_batch = 11, .local_skip_factor = 1,
         .want = "c4,1,1 c4,1,1 c4,1,1 c4,1,1 c2,1,1 c2,1,1 c2,1,1 "
                 "c1,1,1 c1,1,1 c1,1,1 c8,8,8 c8,8,8 c8,8,8 "
                 "c4,4,4 c4,4,4 c4,4,4 c2,2,2 c2,2,2 c2,2,2"},
        /* A larger max with factor 3: reset to (9, 3, 3) -> (4, 1, 2) -> (2,1,1). */
        {.total = 19, .last_batch = 11, .max_global_skips = 9, .local_skip_factor = 3,
         .want = "c4,1,1 c4,1,1 c4,1,1 c4,1,1 c2,1,1 c2,1,1 c2,1,1 "
                 "c1,1,1 c1,1,1 c1,1,1 c9,3,3 c9,3,3 c9,3,3 "
                 "c4,1,2 c4,1,2 c4,1,2 c2,1,1 c2,1,1 c2,1,1"},
    };
    ASSERT_EQ_INT(flat_cases_failed(cases, N_CASES(cases)), 0);
}

/* NaN and infinite losses never improve and never become the best: -inf
 * would otherwise make every later loss non-improving for good. */
TEST(non_finite_losses_count_as_not_improving)
{
    mpidp_schedule_config_t cfg = config(100, 0, 0);
    mpidp_schedule_t s;
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    const double seq[] = {1.0, -INFINITY, NAN, 0.5, INFINITY, NAN};
    for (size_t i = 0; i < sizeof seq / sizeof seq[0]; i++) {
        mpidp_schedule_actions_t a;
        ASSERT_OK(mpidp_schedule_batch(&s, 0, 0, &a));
        ASSERT_OK(mpidp_schedule_epoch_end(&s, seq[i]));
        ASSERT_OK(mpidp_schedule_validate(&s));
    }
    /* 1.0 best; -inf, NaN bad 1, 2; 0.5 improves (resets); +inf, NaN bad 1, 2. */
    ASSERT_EQ_INT(s.global_skip, 4);
    ASSERT_EQ_INT(s.has_best, 1);
    ASSERT_NEAR(s.best_loss, 0.5, 0);
    ASSERT_EQ_INT(s.bad_epochs, 2);
    mpidp_schedule_actions_t a;
    ASSERT_OK(mpidp_schedule_batch(&s, 0, 0, &a));
    ASSERT_OK(mpidp_schedule_epoch_end(&s, -INFINITY)); /* third: plateau */
    ASSERT_EQ_INT(s.global_skip, 2);
    ASSERT_EQ_INT(s.bad_epochs, 0);
    ASSERT_NEAR(s.best_loss, 0.5, 0);

    /* Only non-finite losses from the start: no best, plateaus still come. */
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    for (int i = 0; i < 3; i++) {
        ASSERT_OK(mpidp_schedule_batch(&s, 0, 0, &a));
        ASSERT_OK(mpidp_schedule_epoch_end(&s, NAN));
    }
    ASSERT_EQ_INT(s.has_best, 0);
    ASSERT_EQ_INT(s.global_skip, 2);
}

/* The threshold is relative to |best|: for best = -1 and 5 %, a loss must be
 * below -1.05 to improve (Heat's best * 0.95 = -0.95 would accept -0.96, a
 * worse loss). With stability 0 any strict decrease improves. */
TEST(relative_threshold_and_negative_losses)
{
    mpidp_schedule_config_t cfg = config(100, 0, 0);
    mpidp_schedule_t s;
    mpidp_schedule_actions_t a;
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    const double seq[] = {-1.0, -0.96, -1.04, -1.06};
    const int64_t bad[] = {0, 1, 2, 0};
    for (int i = 0; i < 4; i++) {
        ASSERT_OK(mpidp_schedule_batch(&s, 0, 0, &a));
        ASSERT_OK(mpidp_schedule_epoch_end(&s, seq[i]));
        ASSERT_EQ_INT(s.bad_epochs, bad[i]);
    }
    ASSERT_NEAR(s.best_loss, -1.06, 0);

    cfg.stability_level = 0.0;
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    const double seq0[] = {1.0, 0.999999, 0.999999, 0.999999, 0.999999};
    const int64_t bad0[] = {0, 0, 1, 2, 0};
    const int64_t gs0[] = {4, 4, 4, 4, 2};
    for (int i = 0; i < 5; i++) {
        ASSERT_OK(mpidp_schedule_batch(&s, 0, 0, &a));
        ASSERT_OK(mpidp_schedule_epoch_end(&s, seq0[i]));
        ASSERT_EQ_INT(s.bad_epochs, bad0[i]);
        ASSERT_EQ_INT(s.global_skip, gs0[i]);
    }

    /* Within 5 % of best is no progress, just beyond it is: 94.9 < 95 and
     * later 90.16 > 94.9 * 0.95 = 90.155. */
    cfg.stability_level = 0.05;
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    const double seq5[] = {100.0, 95.5, 94.9, 90.2, 90.16};
    const int64_t bad5[] = {0, 1, 0, 1, 2};
    for (int i = 0; i < 5; i++) {
        ASSERT_OK(mpidp_schedule_batch(&s, 0, 0, &a));
        ASSERT_OK(mpidp_schedule_epoch_end(&s, seq5[i]));
        ASSERT_EQ_INT(s.bad_epochs, bad5[i]);
    }
    ASSERT_NEAR(s.best_loss, 94.9, 0);
}

/* The detector count carries across a reduction: after a plateau it counts
 * from zero with the old best, so a loss equal to the best is still bad. */
TEST(plateau_resets_count_keeps_best)
{
    mpidp_schedule_config_t cfg = config(100, 0, 0);
    mpidp_schedule_t s;
    mpidp_schedule_actions_t a;
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    const double seq[] = {5.0, 6.0, 7.0, 8.0, 5.0, 5.0, 5.0, 4.0};
    const int64_t gs[] = {4, 4, 4, 2, 2, 2, 1, 1};
    const int64_t bad[] = {0, 1, 2, 0, 1, 2, 0, 0};
    for (int i = 0; i < 8; i++) {
        ASSERT_OK(mpidp_schedule_batch(&s, 0, 0, &a));
        ASSERT_OK(mpidp_schedule_epoch_end(&s, seq[i]));
        ASSERT_EQ_INT(s.global_skip, gs[i]);
        ASSERT_EQ_INT(s.bad_epochs, bad[i]);
    }
    ASSERT_NEAR(s.best_loss, 4.0, 0);
}

/* Heat keeps epoch in step(): it advances on the last batch, and epoch_end
 * reads it. epoch_end must come between epochs, once per epoch; skipping it
 * is allowed, and the phase then catches up at the next call. */
/* Calls epoch_end where it must be refused: 0 when it fails with
 * MPIDP_ESTATE, a detail containing `needle` and the state unchanged, else
 * 1, 2 or 3 for the first of those that did not hold. */
static int epoch_end_refused(mpidp_schedule_t *s, const char *needle)
{
    mpidp_schedule_t before = *s;
    if (mpidp_schedule_epoch_end(s, 1.0) != MPIDP_ESTATE) return 1;
    if (!strstr(mpidp_error_detail(), needle)) return 2;
    return memcmp(s, &before, sizeof before) == 0 ? 0 : 3;
}

TEST(epoch_end_placement)
{
    mpidp_schedule_config_t cfg = config(30, 4, 4);
    mpidp_schedule_t s;
    mpidp_schedule_actions_t a;
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    ASSERT_EQ_INT(s.epoch, 0);
    /* Before any batch: allowed once (counter 0, still warmup). */
    ASSERT_OK(mpidp_schedule_epoch_end(&s, 1.0));
    ASSERT_EQ_INT(epoch_end_refused(&s, "already"), 0);

    /* In the middle of an epoch: refused, state unchanged. */
    ASSERT_OK(mpidp_schedule_batch(&s, 0, 3, &a));
    ASSERT_OK(mpidp_schedule_batch(&s, 1, 3, &a));
    ASSERT_EQ_INT(epoch_end_refused(&s, "middle"), 0);
    ASSERT_OK(mpidp_schedule_batch(&s, 2, 3, &a));
    ASSERT_OK(mpidp_schedule_batch(&s, 3, 3, &a));
    ASSERT_TRUE(a.epoch_done);
    ASSERT_EQ_INT(s.epoch, 1);

    /* Epochs 1..5 run without epoch_end; at counter 6 the first call enters
     * cycling (Heat would only do so at exactly counter 4). */
    for (int e = 1; e < 6; e++)
        for (int64_t b = 0; b <= 3; b++) ASSERT_OK(mpidp_schedule_batch(&s, b, 3, &a));
    ASSERT_EQ_INT(s.epoch, 6);
    ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_WARMUP);
    ASSERT_OK(mpidp_schedule_epoch_end(&s, 1.0));
    ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_CYCLING);
    ASSERT_EQ_INT(s.global_skip, 4);
    ASSERT_EQ_INT(s.logic_epoch, 6);

    ASSERT_EQ_INT(mpidp_schedule_epoch_end(NULL, 1.0), MPIDP_EINVAL);
}

/* Each config field is checked, with a detail naming it. */
TEST(invalid_configs)
{
    mpidp_schedule_config_t good = config(10, 4, 4), c;
    mpidp_schedule_t s;
    ASSERT_OK(mpidp_schedule_config_validate(&good));

#define BAD(stmt, name)                                                         \
    do {                                                                        \
        c = good;                                                               \
        stmt;                                                                   \
        mpidp_error_clear();                                                    \
        ASSERT_EQ_INT(mpidp_schedule_config_validate(&c), MPIDP_EINVAL);        \
        ASSERT_TRUE(strstr(mpidp_error_detail(), name) != NULL);                \
        memset(&s, 0x5a, sizeof s);                                             \
        mpidp_schedule_t untouched = s;                                         \
        ASSERT_EQ_INT(mpidp_schedule_init(&s, &c), MPIDP_EINVAL);               \
        ASSERT_TRUE(memcmp(&s, &untouched, sizeof s) == 0);                     \
    } while (0)

    BAD(c.total_epochs = 0, "total_epochs");
    BAD(c.total_epochs = -3, "total_epochs");
    BAD(c.warmup_epochs = -1, "warmup_epochs");
    BAD(c.cooldown_epochs = -1, "cooldown_epochs");
    BAD(c.max_global_skips = 0, "max_global_skips");
    BAD(c.skip_reduction_factor = 1, "skip_reduction_factor");
    BAD(c.skip_reduction_factor = 0, "skip_reduction_factor");
    BAD(c.local_skip_factor = 0, "local_skip_factor");
    BAD(c.n_groups = 0, "n_groups");
    BAD(c.stability_level = -0.01, "stability_level");
    BAD(c.stability_level = 1.0, "stability_level");
    BAD(c.stability_level = NAN, "stability_level");
    BAD(c.stability_level = INFINITY, "stability_level");
#undef BAD

    ASSERT_EQ_INT(mpidp_schedule_config_validate(NULL), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_schedule_init(NULL, &good), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_schedule_init(&s, NULL), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_schedule_reset(NULL), MPIDP_EINVAL);

    /* Boundary values that are valid. */
    c = good;
    c.warmup_epochs = 0;
    c.cooldown_epochs = 0;
    c.max_global_skips = 1;
    c.local_skip_factor = 1;
    c.n_groups = 1;
    c.stability_level = 0.0;
    ASSERT_OK(mpidp_schedule_init(&s, &c));
    c.stability_level = 0.999;
    c.warmup_epochs = 1000;
    c.cooldown_epochs = 1000;
    ASSERT_OK(mpidp_schedule_init(&s, &c));
}

/* reset() is init() again for the stored config, from any point. */
TEST(reset_returns_to_base_state)
{
    mpidp_schedule_config_t cfg = config(30, 2, 4);
    cfg.n_groups = 3;
    mpidp_schedule_t s, fresh;
    char trace[512];
    ASSERT_OK(mpidp_schedule_init(&fresh, &cfg));
    ASSERT_OK(flat_trace(&s, &cfg, 12, 6, trace, sizeof trace));
    mpidp_schedule_actions_t a;
    ASSERT_OK(mpidp_schedule_batch(&s, 0, 6, &a)); /* leaves a sync pending */
    ASSERT_EQ_INT(s.pending, 1);
    ASSERT_OK(mpidp_schedule_reset(&s));
    ASSERT_TRUE(memcmp(&s, &fresh, sizeof s) == 0);
    ASSERT_OK(mpidp_schedule_validate(&s));

    /* A corrupted config is refused and left as is. */
    s.cfg.n_groups = 0;
    mpidp_schedule_t bad = s;
    ASSERT_EQ_INT(mpidp_schedule_reset(&s), MPIDP_EINVAL);
    ASSERT_TRUE(memcmp(&s, &bad, sizeof s) == 0);
}

TEST(phase_names)
{
    ASSERT_STREQ(mpidp_schedule_phase_name(MPIDP_SCHEDULE_WARMUP), "warmup");
    ASSERT_STREQ(mpidp_schedule_phase_name(MPIDP_SCHEDULE_CYCLING), "cycling");
    ASSERT_STREQ(mpidp_schedule_phase_name(MPIDP_SCHEDULE_COOLDOWN), "cooldown");
    ASSERT_STREQ(mpidp_schedule_phase_name(3), "unknown");
    ASSERT_STREQ(mpidp_schedule_phase_name(-1), "unknown");
}

/* The field list the glue uses for checkpoints covers the struct exactly:
 * ascending offsets, no gaps, nothing left over. */
TEST(field_list_covers_state)
{
    static const struct {
        const char *name;
        size_t offset, size;
    } fields[] = {
#define F(type, member) {#member, offsetof(mpidp_schedule_t, member), sizeof(type)},
        MPIDP_SCHEDULE_FIELDS(F)
#undef F
    };
    size_t n = sizeof fields / sizeof fields[0], end = 0;
    for (size_t i = 0; i < n; i++) {
        ASSERT_EQ_INT(fields[i].offset, end);
        end += fields[i].size;
    }
    ASSERT_EQ_INT(end, sizeof(mpidp_schedule_t));
    ASSERT_STREQ(fields[0].name, "cfg.total_epochs");
    ASSERT_STREQ(fields[n - 1].name, "pending_sent_at");
}

/* Continue an existing schedule for n epochs of 4 batches (flat loss). */
static int continue_epochs(mpidp_schedule_t *s, int n)
{
    for (int e = 0; e < n; e++) {
        mpidp_schedule_actions_t a;
        for (int64_t b = 0; b <= 3; b++) {
            int rc = mpidp_schedule_batch(s, b, 3, &a);
            if (rc != MPIDP_OK) return rc;
        }
        int rc = mpidp_schedule_epoch_end(s, 1.0);
        if (rc != MPIDP_OK) return rc;
    }
    return mpidp_schedule_validate(s);
}

/* A job restarted with more epochs: the saved state, reconfigured for the new
 * total, runs the new epochs in the phase a fresh run of that length would. */
TEST(reconfigure_between_epochs)
{
    char trace[512];
    mpidp_schedule_config_t two = config(2, 1, 0), three = config(3, 1, 0);
    mpidp_schedule_t s;
    ASSERT_OK(flat_trace(&s, &two, 2, 3, trace, sizeof trace));
    ASSERT_STREQ(trace, "w0,0,0 c4,1,1");
    ASSERT_OK(mpidp_schedule_reconfigure(&s, &three));
    ASSERT_EQ_INT(s.cfg.total_epochs, 3);
    ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_CYCLING);
    ASSERT_EQ_INT(s.global_skip, 4);
    ASSERT_OK(continue_epochs(&s, 1));
    ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_COOLDOWN);

    /* Ending in cooldown, then extended: back to a fresh cycling phase. */
    mpidp_schedule_config_t c1 = config(3, 1, 1), c2 = config(6, 1, 1);
    ASSERT_OK(flat_trace(&s, &c1, 3, 3, trace, sizeof trace));
    ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_COOLDOWN);
    ASSERT_OK(mpidp_schedule_reconfigure(&s, &c2));
    ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_CYCLING);
    ASSERT_EQ_INT(s.has_best, 0);
    ASSERT_OK(continue_epochs(&s, 2));
    ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_COOLDOWN);

    /* Cycling stays cycling: skips kept but clamped to a smaller maximum. */
    mpidp_schedule_config_t big = config(40, 1, 1), small = config(40, 1, 1);
    small.max_global_skips = 2;
    ASSERT_OK(flat_trace(&s, &big, 2, 3, trace, sizeof trace));
    ASSERT_EQ_INT(s.global_skip, 4);
    ASSERT_OK(mpidp_schedule_reconfigure(&s, &small));
    ASSERT_EQ_INT(s.global_skip, 2);
    ASSERT_TRUE(s.batches_to_wait <= 2 && s.local_skip <= 2);
}

TEST(reconfigure_refusals_leave_the_state_alone)
{
    mpidp_schedule_config_t cfg = config(10, 1, 1), other = config(12, 1, 1);
    mpidp_schedule_t s;
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    mpidp_schedule_actions_t a;
    ASSERT_OK(mpidp_schedule_batch(&s, 0, 3, &a));
    mpidp_schedule_t before = s;
    ASSERT_EQ_INT(mpidp_schedule_reconfigure(&s, &other), MPIDP_ESTATE);   /* mid-epoch */
    ASSERT_TRUE(memcmp(&before, &s, sizeof s) == 0);
    for (int64_t b = 1; b <= 3; b++) ASSERT_OK(mpidp_schedule_batch(&s, b, 3, &a));
    other.n_groups = 2;
    before = s;
    ASSERT_EQ_INT(mpidp_schedule_reconfigure(&s, &other), MPIDP_EINVAL);   /* topology changed */
    other.n_groups = 1;
    other.total_epochs = 0;
    ASSERT_EQ_INT(mpidp_schedule_reconfigure(&s, &other), MPIDP_EINVAL);   /* invalid config */
    ASSERT_TRUE(memcmp(&before, &s, sizeof s) == 0);
}

TEST_MAIN(reconfigure_between_epochs, reconfigure_refusals_leave_the_state_alone, defaults_are_heats, flat_loss_30_epochs_matches_heat,
          improving_loss_stays_at_4_1_1, warmup_zero_starts_cycling,
          cooldown_and_overlapping_phases, max_global_skips_1_2_3,
          skip_reduction_factor_edges, local_skip_factor_one_keeps_btw_within_gs,
          non_finite_losses_count_as_not_improving,
          relative_threshold_and_negative_losses, plateau_resets_count_keeps_best,
          epoch_end_placement, invalid_configs, reset_returns_to_base_state,
          phase_names, field_list_covers_state)
