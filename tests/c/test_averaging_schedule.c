/* The averaging schedule (mpidp/averaging_schedule.h) against the timings of the
 * implementations it follows: torch's PeriodicModelAverager and
 * HierarchicalModelAverager (the steps torch's own tests expect), fairscale's
 * LocalSGD + SlowMo counting, and torchft's Streaming DiLoCo fragments.
 *
 * Traces are one character per step 0, 1, 2, ..: '.' nothing, a digit the
 * level averaged, 'S' a slow step ('s' with an average at level 0 as well). */
#include "mpidp/averaging_schedule.h"
#include "mpidp/status.h"
#include "test.h"

#include <stdio.h>
#include <string.h>

static mpidp_avgsched_config_t levels(int64_t warmup, int n, const int64_t *periods, int from_warmup,
                                      int after)
{
    mpidp_avgsched_config_t c = {.warmup_steps = warmup, .n_levels = n,
                                 .count_from_warmup = from_warmup, .after_period = after};
    for (int l = 0; l < n; l++) c.periods[l] = periods[l];
    return c;
}

/* The trace of steps 0 .. n-1 into buf (n + 1 bytes), or "!" on a failure. */
static const char *trace(const mpidp_avgsched_config_t *c, int n, char *buf)
{
    for (int t = 0; t < n; t++) {
        mpidp_avgsched_actions_t a;
        if (mpidp_avgsched_actions(c, t, &a) != MPIDP_OK) return "!";
        buf[t] = a.slow_step ? (a.average ? 's' : 'S') : a.average ? (char)('0' + a.level) : '.';
    }
    buf[n] = '\0';
    return buf;
}

TEST(periodic_averager_counts_from_the_end_of_warmup)
{
    /* torch: average when step >= warmup and (step - warmup) % period == 0. */
    char buf[32];
    int64_t p4[] = {4};
    mpidp_avgsched_config_t c = levels(10, 1, p4, 1, 0);
    ASSERT_STREQ(trace(&c, 24, buf), "..........0...0...0...0.");
    c = levels(0, 1, p4, 1, 0);
    ASSERT_STREQ(trace(&c, 10, buf), "0...0...0.");
    int64_t p1[] = {1};
    c = levels(3, 1, p1, 1, 0);
    ASSERT_STREQ(trace(&c, 6, buf), "...000");
}

TEST(hierarchical_averager_takes_the_largest_period_that_divides_the_step)
{
    /* torch's test_3_level_hierarchical_model_averager ({2: 2, 4: 4, 8: 8},
     * warm-up 10): pairs at 10, 14, 18, 22; groups of 4 at 12, 20; all at 16, 24. */
    char buf[32];
    int64_t p[] = {2, 4, 8};
    mpidp_avgsched_config_t c = levels(10, 3, p, 0, 0);
    ASSERT_STREQ(trace(&c, 26, buf), "..........0.1.0.2.0.1.0.2.");
    /* Without warm-up, step 0 is divisible by everything. */
    c = levels(0, 3, p, 0, 0);
    ASSERT_STREQ(trace(&c, 9, buf), "2.0.1.0.2");
}

TEST(localsgd_and_slowmo_act_after_their_periods)
{
    /* fairscale: average when (step + 1) % localsgd_frequency == 0, slow
     * momentum when (step + 1) % slowmo_frequency == 0. */
    char buf[32];
    int64_t p3[] = {3};
    mpidp_avgsched_config_t c = levels(0, 1, p3, 0, 1);
    c.slow_every = 6;
    ASSERT_STREQ(trace(&c, 13, buf), "..0..s..0..s.");
    /* Memory-efficient SlowMo: the sharded slow step averages by itself. */
    c.slow_replaces_average = 1;
    ASSERT_STREQ(trace(&c, 13, buf), "..0..S..0..S.");
    /* Slow steps need not be multiples of the base period. */
    c.slow_replaces_average = 0, c.slow_every = 4;
    ASSERT_STREQ(trace(&c, 13, buf), "..0S.0.S0..s.");
}

TEST(fragments_sync_in_turn_with_the_send_delayed_ahead)
{
    /* sync_every 6 over 3 fragments: one every 2 steps, applied after steps
     * 1, 3, 5, 7 to fragments 0, 1, 2, 0; a delay of 1 sends each a step earlier. */
    mpidp_avgsched_config_t c = {.n_fragments = 3, .fragment_every = 2, .fragment_delay = 1};
    static const int64_t send[] = {0, -1, 1, -1, 2, -1, 0, -1};
    static const int64_t apply[] = {-1, 0, -1, 1, -1, 2, -1, 0};
    for (int t = 0; t < 8; t++) {
        mpidp_avgsched_actions_t a;
        ASSERT_OK(mpidp_avgsched_actions(&c, t, &a));
        ASSERT_EQ_INT(a.send_fragment, send[t]);
        ASSERT_EQ_INT(a.apply_fragment, apply[t]);
        ASSERT_EQ_INT(a.average, 0);
        ASSERT_EQ_INT(a.slow_step, 0);
    }
    /* No delay: sent and applied on the same step (one fragment: plain DiLoCo). */
    c = (mpidp_avgsched_config_t){.n_fragments = 1, .fragment_every = 3};
    for (int t = 0; t < 9; t++) {
        mpidp_avgsched_actions_t a;
        ASSERT_OK(mpidp_avgsched_actions(&c, t, &a));
        ASSERT_EQ_INT(a.send_fragment, t % 3 == 2 ? 0 : -1);
        ASSERT_EQ_INT(a.apply_fragment, a.send_fragment);
    }
}

TEST(huge_steps_do_not_overflow)
{
    int64_t p[] = {1, 3, 7};
    mpidp_avgsched_config_t c = levels(5, 3, p, 1, 1);
    c.slow_every = INT64_MAX;
    c.n_fragments = 5, c.fragment_every = INT64_MAX, c.fragment_delay = INT64_MAX - 1;
    mpidp_avgsched_actions_t a;
    ASSERT_OK(mpidp_avgsched_actions(&c, INT64_MAX, &a));
    /* k = INT64_MAX - 5 + 1 = 2^63 - 5 (a multiple of 3, not of 7). */
    uint64_t k = (uint64_t)INT64_MAX - 5 + 1;
    ASSERT_EQ_INT(a.level, k % 7 == 0 ? 2 : k % 3 == 0 ? 1 : 0);
    ASSERT_EQ_INT(a.slow_step, k % (uint64_t)INT64_MAX == 0);
    ASSERT_EQ_INT(a.apply_fragment, -1); /* INT64_MAX + 1 is not a multiple of INT64_MAX */
    ASSERT_EQ_INT(a.send_fragment, -1);  /* its apply would fall past INT64_MAX */
    ASSERT_OK(mpidp_avgsched_actions(&c, INT64_MAX - 1, &a));
    ASSERT_EQ_INT(a.apply_fragment, 0);  /* the first sync: after step INT64_MAX - 1 */
    ASSERT_OK(mpidp_avgsched_actions(&c, 0, &a));
    ASSERT_EQ_INT(a.send_fragment, 0);   /* sent INT64_MAX - 1 steps ahead */
}

TEST(bad_configs_and_steps_are_refused_by_name)
{
    int64_t p[] = {4, 2};
    mpidp_avgsched_config_t ok = levels(0, 1, p, 0, 0), c;
    mpidp_avgsched_actions_t a;
    struct { mpidp_avgsched_config_t c; const char *needle; } bad[8];
    int n = 0;
    c = ok, c.warmup_steps = -1, bad[n].c = c, bad[n++].needle = "warmup_steps";
    c = ok, c.n_levels = MPIDP_AVGSCHED_MAX_LEVELS + 1, bad[n].c = c, bad[n++].needle = "periods";
    c = ok, c.periods[0] = 0, bad[n].c = c, bad[n++].needle = "period must be >= 1";
    c = levels(0, 2, p, 0, 0), bad[n].c = c, bad[n++].needle = "ascending";
    c = ok, c.after_period = 2, bad[n].c = c, bad[n++].needle = "after_period";
    c = ok, c.slow_every = -3, bad[n].c = c, bad[n++].needle = "slow_every";
    c = ok, c.n_fragments = 2, c.fragment_every = 0, bad[n].c = c, bad[n++].needle = "fragment_every";
    c = ok, c.n_fragments = 2, c.fragment_every = 3, c.fragment_delay = 3, bad[n].c = c,
    bad[n++].needle = "fragment_delay";
    for (int i = 0; i < n; i++) {
        ASSERT_EQ_INT(mpidp_avgsched_config_validate(&bad[i].c), MPIDP_EINVAL);
        ASSERT_TRUE(strstr(mpidp_error_detail(), bad[i].needle) != NULL);
        ASSERT_EQ_INT(mpidp_avgsched_actions(&bad[i].c, 0, &a), MPIDP_EINVAL);
        ASSERT_EQ_INT(a.average + a.slow_step, 0);
        ASSERT_EQ_INT(a.send_fragment + a.apply_fragment, -2);
    }
    ASSERT_EQ_INT(mpidp_avgsched_actions(&ok, -1, &a), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "step") != NULL);
    ASSERT_EQ_INT(mpidp_avgsched_actions(NULL, 0, &a), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_avgsched_actions(&ok, 0, NULL), MPIDP_EINVAL);
}

TEST_MAIN(periodic_averager_counts_from_the_end_of_warmup,
          hierarchical_averager_takes_the_largest_period_that_divides_the_step,
          localsgd_and_slowmo_act_after_their_periods,
          fragments_sync_in_turn_with_the_send_delayed_ahead, huge_steps_do_not_overflow,
          bad_configs_and_steps_are_refused_by_name)
