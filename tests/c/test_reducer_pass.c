/* The reducer's pass at one rank: from what the caller saw of each `.grad`
 * to what it must do with it, in blocking mode, in staged mode and in
 * non-blocking mode (deferred step, and accumulation without a step), with
 * the values the core delivers into the buckets. (The rules themselves are
 * swept exhaustively in test_reducer.c; the Python tests check the same
 * habits against a single-process reference at 1-4 ranks.) */
#include "mpidp/status.h"
#include "test.h"

#include "reducer_fixture.h"

/* Layout of the fixture: bucket 0 holds parameters 2 and 3, bucket 1 holds
 * 0 and 1 (members in index order). */
enum { VIEW = MPIDP_SEEN_VIEW, NONE = MPIDP_SEEN_NONE, OTHER = MPIDP_SEEN_OTHER };

static float *slice(fixture_t *f, size_t i) { return &f->storage[f->bucket[i]][f->offset[i]]; }

static void fill(fixture_t *f, size_t i, float v)
{
    for (int k = 0; k < 8; k++) slice(f, i)[k] = v;
}

/* Marks every parameter that no hook marked as unhooked, its .grad still the
 * view prepare() pointed it at, as the glue does before finalize. */
static int mark_rest_unhooked(fixture_t *f)
{
    int rc = MPIDP_OK;
    for (size_t i = 0; rc == MPIDP_OK && i < NP; i++)
        if (!mpidp_reducer_is_ready(f->r, i)) rc = mpidp_reducer_mark_unhooked(f->r, i, VIEW);
    return rc;
}

/* What the caller saw of each .grad in the blocking pass of the first and
 * the last blocking test: 0 and 2 had none, 1 its view, 3 a tensor of its
 * own. */
static const uint8_t hooked_seen[NP] = {NONE, VIEW, NONE, OTHER};

/* That pass up to its hooks: prepare() with hooked_seen (its actions in act),
 * then the hooks of 1 and 3 (3's after the caller adopted its view). */
static int hooked_pass(fixture_t *f, uint8_t *act)
{
    int rc = setup(f);
    if (rc == MPIDP_OK) rc = mpidp_reducer_prepare(f->r, hooked_seen, act);
    if (rc == MPIDP_OK) rc = mpidp_reducer_grad_arrived(f->r, 1, 1);
    if (rc == MPIDP_OK) rc = mpidp_reducer_grad_arrived(f->r, 3, 1);
    return rc;
}

#define ASSERT_ACTS(act, a0, a1)                                                \
    do {                                                                        \
        ASSERT_EQ_INT((act)[0], (a0));                                          \
        ASSERT_EQ_INT((act)[1], (a1));                                          \
    } while (0)

TEST(blocking_pass_fixes_missing_grads_like_one_process)
{
    fixture_t f;
    uint8_t act[NP];
    ASSERT_OK(hooked_pass(&f, act));
    ASSERT_EQ_INT(act[0], MPIDP_GRAD_ZERO_VIEW); /* prepare()'s actions */
    ASSERT_EQ_INT(act[1], MPIDP_GRAD_KEEP);
    ASSERT_EQ_INT(act[2], MPIDP_GRAD_ZERO_VIEW);
    ASSERT_EQ_INT(act[3], MPIDP_GRAD_KEEP);
    /* Unhooked: 0's view holds prepare's zeros (no gradient), 2's .grad was set to None. */
    ASSERT_EQ_INT(mpidp_reducer_unhooked_action(f.r, 0, VIEW), MPIDP_GRAD_KEEP);
    ASSERT_EQ_INT(mpidp_reducer_unhooked_action(f.r, 2, NONE), MPIDP_GRAD_KEEP);
    ASSERT_OK(mpidp_reducer_mark_unhooked(f.r, 0, VIEW));
    ASSERT_EQ_INT(mpidp_reducer_missing_grads(f.r, 0, act), MPIDP_ESTATE); /* not finalized */
    ASSERT_EQ_INT(mpidp_reducer_finalize(f.r, NULL), MPIDP_ESTATE);       /* 2 unmarked */
    ASSERT_TRUE(strstr(mpidp_error_detail(), "1 of 4 parameters") != NULL);
    ASSERT_OK(mpidp_reducer_mark_unhooked(f.r, 2, NONE));
    ASSERT_OK(mpidp_reducer_finalize(f.r, NULL));
    ASSERT_EQ_INT(mpidp_reducer_finalized(f.r), 1);
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    /* One rank: no other rank had a gradient for 0 or 2, so they go back to None. */
    ASSERT_OK(mpidp_reducer_missing_grads(f.r, 0, act));
    ASSERT_ACTS(act, MPIDP_GRAD_SET_NONE, MPIDP_GRAD_KEEP);
    ASSERT_OK(mpidp_reducer_missing_grads(f.r, 0, act)); /* fixed once */
    ASSERT_ACTS(act, MPIDP_GRAD_KEEP, MPIDP_GRAD_KEEP);
    ASSERT_OK(mpidp_reducer_missing_grads(f.r, 1, act));
    ASSERT_ACTS(act, MPIDP_GRAD_SET_NONE, MPIDP_GRAD_KEEP);
    /* Non-blocking calls are refused in blocking mode. */
    ASSERT_EQ_INT(mpidp_reducer_deliver_for_step(f.r, 0, 0, hooked_seen, act), MPIDP_ESTATE);
    ASSERT_EQ_INT(mpidp_reducer_accumulate(f.r, 0, 0, -1, hooked_seen, act), MPIDP_ESTATE);
    ASSERT_OK(mpidp_reducer_reset(f.r));
    ASSERT_EQ_INT(mpidp_reducer_finalized(f.r), 0);
    /* While a pass is open prepare changes nothing. */
    ASSERT_OK(mpidp_reducer_grad_arrived(f.r, 0, 1));
    uint8_t all_none[NP] = {NONE, NONE, NONE, NONE};
    ASSERT_OK(mpidp_reducer_prepare(f.r, all_none, act));
    for (int i = 0; i < NP; i++) ASSERT_EQ_INT(act[i], MPIDP_GRAD_KEEP);
    ASSERT_EQ_INT(mpidp_reducer_grad_arrived(f.r, 9, 1), MPIDP_EINVAL);
    /* join's shadow pass: refused while a pass is open; else every bucket is
     * posted with zeros and no "had a gradient" flag. */
    ASSERT_EQ_INT(mpidp_reducer_contribute_nothing(f.r), MPIDP_ESTATE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "still open") != NULL);
    ASSERT_OK(mpidp_reducer_mark_unhooked(f.r, 1, VIEW));
    ASSERT_OK(mpidp_reducer_mark_unhooked(f.r, 2, VIEW));
    ASSERT_OK(mpidp_reducer_mark_unhooked(f.r, 3, VIEW));
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    ASSERT_OK(mpidp_reducer_reset(f.r));
    fill(&f, 2, 5.0f);
    ASSERT_OK(mpidp_reducer_contribute_nothing(f.r));
    ASSERT_EQ_INT(mpidp_reducer_n_ready(f.r), NP);
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    for (size_t i = 0; i < NP; i++) {
        int used = -1;
        ASSERT_OK(mpidp_reducer_used_globally(f.r, i, &used));
        ASSERT_EQ_INT(used, 0);
    }
    ASSERT_NEAR(slice(&f, 2)[0], 0.0, 0);
    teardown(&f);
}

TEST(staged_unhooked_parameters_are_zeroed_where_the_gradients_live)
{
    fixture_t f;
    ASSERT_OK(setup_mode(&f, 1, 0));
    uint8_t seen[NP] = {NONE, VIEW, VIEW, VIEW}, act[NP];
    ASSERT_OK(mpidp_reducer_prepare(f.r, seen, act)); /* parameter 0: zeros from prepare */
    ASSERT_EQ_INT(mpidp_reducer_unhooked_action(f.r, 0, VIEW), MPIDP_GRAD_ZERO_ONLY);
    ASSERT_EQ_INT(mpidp_reducer_unhooked_action(f.r, 1, NONE), MPIDP_GRAD_ZERO_ONLY);
    ASSERT_EQ_INT(mpidp_reducer_unhooked_action(f.r, 2, VIEW), MPIDP_GRAD_KEEP);
    ASSERT_EQ_INT(mpidp_reducer_unhooked_action(f.r, 3, OTHER), MPIDP_GRAD_ADOPT);
    /* The core does not write staged gradients itself. */
    fill(&f, 0, 7.0f);
    ASSERT_OK(mpidp_reducer_mark_unhooked(f.r, 0, VIEW));
    ASSERT_NEAR(slice(&f, 0)[3], 7.0, 0);
    teardown(&f);
}

/* Separate mode, one pass: prepare (all None), gradients of 1 + i for
 * parameters 0-2, none for 3; finalize with versions 10 and 20. */
static int deferred_pass(fixture_t *f, uint8_t *act)
{
    uint8_t seen[NP] = {NONE, NONE, NONE, NONE};
    int rc = mpidp_reducer_prepare(f->r, seen, act);
    for (size_t i = 0; rc == MPIDP_OK && i < 3; i++) {
        fill(f, i, 1.0f + (float)i);
        rc = mpidp_reducer_grad_arrived(f->r, i, 1);
    }
    if (rc == MPIDP_OK) rc = mpidp_reducer_mark_unhooked(f->r, 3, VIEW);
    long long versions[2] = {10, 20};
    if (rc == MPIDP_OK) rc = mpidp_reducer_finalize(f->r, versions);
    return rc == MPIDP_OK ? mpidp_reducer_wait_all(f->r, 1.0) : rc;
}

TEST(deferred_step_gives_grads_back_as_the_user_left_them)
{
    fixture_t f;
    uint8_t act[NP];
    ASSERT_OK(setup_mode(&f, 0, 1));
    ASSERT_EQ_INT(mpidp_reducer_finalize(f.r, NULL), MPIDP_ESTATE); /* nothing marked */
    ASSERT_OK(deferred_pass(&f, act));
    ASSERT_NEAR(slice(&f, 2)[0], 0.0, 0); /* posted: the bucket starts from zero */
    /* Bucket 0, nothing changed in place; the user set 2's .grad to None. */
    uint8_t seen0[2] = {NONE, VIEW};
    ASSERT_OK(mpidp_reducer_deliver_for_step(f.r, 0, 10, seen0, act));
    ASSERT_ACTS(act, MPIDP_GRAD_SET_VIEW, MPIDP_GRAD_SET_NONE); /* 3: no rank had one */
    ASSERT_NEAR(slice(&f, 2)[5], 3.0, 0);                       /* the mean, for the step */
    ASSERT_OK(mpidp_reducer_deliver_for_step(f.r, 0, 10, seen0, act)); /* once */
    ASSERT_ACTS(act, MPIDP_GRAD_KEEP, MPIDP_GRAD_KEEP);
    ASSERT_EQ_INT(mpidp_reducer_delivered(f.r, 0), 1);
    int over = -1;
    ASSERT_EQ_INT(mpidp_reducer_after_step(f.r, 1, act, &over), MPIDP_ESTATE); /* not delivered */
    /* Bucket 1 was zeroed in place (version moved); replacing a .grad is refused. */
    uint8_t replaced[2] = {VIEW, OTHER}, views[2] = {VIEW, VIEW};
    ASSERT_EQ_INT(mpidp_reducer_deliver_for_step(f.r, 1, 21, replaced, act), MPIDP_ESTATE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "parameter 1 was replaced") != NULL);
    ASSERT_OK(mpidp_reducer_deliver_for_step(f.r, 1, 21, views, act));
    ASSERT_ACTS(act, MPIDP_GRAD_SET_VIEW, MPIDP_GRAD_SET_VIEW);
    ASSERT_NEAR(slice(&f, 0)[7], 1.0, 0);
    ASSERT_NEAR(slice(&f, 1)[0], 2.0, 0);
    /* After the step: None where it was None at the step or nobody had one;
     * zeros where the user zeroed in place. */
    ASSERT_OK(mpidp_reducer_after_step(f.r, 0, act, &over));
    ASSERT_ACTS(act, MPIDP_GRAD_SET_NONE, MPIDP_GRAD_SET_NONE);
    ASSERT_EQ_INT(over, 0);
    ASSERT_EQ_INT(mpidp_reducer_stepped(f.r, 0), 1);
    ASSERT_EQ_INT(mpidp_reducer_stepped(f.r, 1), 0);
    ASSERT_OK(mpidp_reducer_after_step(f.r, 0, act, &over)); /* once */
    ASSERT_ACTS(act, MPIDP_GRAD_KEEP, MPIDP_GRAD_KEEP);
    uint8_t seen[2] = {VIEW, VIEW};
    ASSERT_EQ_INT(mpidp_reducer_accumulate(f.r, 1, 21, -1, seen, act), MPIDP_ESTATE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "half applied") != NULL);
    ASSERT_OK(mpidp_reducer_after_step(f.r, 1, act, &over));
    ASSERT_ACTS(act, MPIDP_GRAD_ZERO_VIEW, MPIDP_GRAD_ZERO_VIEW);
    ASSERT_EQ_INT(over, 1);
    ASSERT_OK(mpidp_reducer_reset(f.r));
    ASSERT_EQ_INT(mpidp_reducer_stepped(f.r, 0), 0);
    ASSERT_EQ_INT(mpidp_reducer_delivered(f.r, 0), 0);
    teardown(&f);
}

TEST(accumulating_without_a_step_adds_the_mean_unless_cleared)
{
    fixture_t f;
    uint8_t act[NP];
    ASSERT_OK(setup_mode(&f, 0, 1));
    ASSERT_OK(deferred_pass(&f, act));
    /* A second backward's first gradient (parameter 0) was already added into
     * its view: that moved bucket 1's counter by one, and is kept. */
    fill(&f, 0, 100.0f);
    uint8_t seen[2] = {VIEW, VIEW};
    ASSERT_OK(mpidp_reducer_accumulate(f.r, 1, 21, 0, seen, act));
    ASSERT_ACTS(act, MPIDP_GRAD_KEEP, MPIDP_GRAD_KEEP);
    ASSERT_NEAR(slice(&f, 0)[2], 101.0, 0);
    ASSERT_NEAR(slice(&f, 1)[2], 2.0, 0);
    /* Bucket 0 was cleared in place since backward: the mean is dropped; 3
     * (None before backward, no gradient anywhere) would go back to None, but
     * the clearing wins and leaves it as the user made it. */
    ASSERT_OK(mpidp_reducer_accumulate(f.r, 0, 11, 0, seen, act));
    ASSERT_ACTS(act, MPIDP_GRAD_KEEP, MPIDP_GRAD_KEEP);
    ASSERT_NEAR(slice(&f, 2)[2], 0.0, 0);
    ASSERT_OK(mpidp_reducer_reset(f.r));
    /* Unchanged bucket 0: 2 gets its mean added, 3 goes back to None. */
    ASSERT_OK(deferred_pass(&f, act));
    ASSERT_OK(mpidp_reducer_accumulate(f.r, 0, 10, -1, seen, act));
    ASSERT_ACTS(act, MPIDP_GRAD_KEEP, MPIDP_GRAD_SET_NONE);
    ASSERT_NEAR(slice(&f, 2)[6], 3.0, 0);
    /* A .grad the user set to None since is left alone (and nothing added). */
    uint8_t gone[2] = {NONE, VIEW};
    ASSERT_OK(mpidp_reducer_accumulate(f.r, 1, 20, -1, gone, act));
    ASSERT_ACTS(act, MPIDP_GRAD_KEEP, MPIDP_GRAD_KEEP);
    ASSERT_NEAR(slice(&f, 0)[0], 0.0, 0);
    ASSERT_NEAR(slice(&f, 1)[0], 2.0, 0);
    teardown(&f);
}

TEST(synchronizing_before_the_step_delivers_the_mean_now)
{
    fixture_t f;
    uint8_t act[NP];
    ASSERT_OK(setup_mode(&f, 0, 1));
    ASSERT_OK(deferred_pass(&f, act));
    ASSERT_EQ_INT(mpidp_reducer_version_moved(f.r, 0, 10), 0);
    ASSERT_EQ_INT(mpidp_reducer_version_moved(f.r, 0, 11), 1);
    uint8_t views[2] = {VIEW, VIEW}, replaced[2] = {VIEW, OTHER}, none_first[2] = {NONE, VIEW};
    /* Clipping on the zeros before synchronize() would be lost: refused. */
    ASSERT_EQ_INT(mpidp_reducer_deliver_now(f.r, 0, 11, views, act), MPIDP_ESTATE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "changed in place") != NULL);
    ASSERT_EQ_INT(mpidp_reducer_deliver_now(f.r, 0, 10, replaced, act), MPIDP_ESTATE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "parameter 3 was replaced") != NULL);
    ASSERT_OK(mpidp_reducer_deliver_now(f.r, 0, 10, views, act));
    ASSERT_ACTS(act, MPIDP_GRAD_SET_VIEW, MPIDP_GRAD_SET_NONE); /* 3: None before, none anywhere */
    ASSERT_NEAR(slice(&f, 2)[4], 3.0, 0);
    ASSERT_OK(mpidp_reducer_deliver_now(f.r, 1, 20, none_first, act));
    ASSERT_ACTS(act, MPIDP_GRAD_KEEP, MPIDP_GRAD_SET_VIEW);     /* 0: set to None since: stays */
    ASSERT_NEAR(slice(&f, 1)[4], 2.0, 0);
    ASSERT_OK(mpidp_reducer_reset(f.r));
    ASSERT_EQ_INT(mpidp_reducer_version_moved(f.r, 0, 11), 0); /* no pass: nothing to compare */
    teardown(&f);
}

TEST(gradients_held_without_communication_count_in_the_next_pass)
{
    /* no_sync: prepare, then a paused backward whose hooks only hold (0 and 2
     * get gradients, 1 and 3 none), then a pass whose hooks fire for 1 only. */
    fixture_t f;
    ASSERT_OK(setup(&f));
    uint8_t seen[NP] = {NONE, NONE, NONE, NONE}, act[NP];
    ASSERT_OK(mpidp_reducer_prepare(f.r, seen, act));
    ASSERT_OK(mpidp_reducer_set_paused(f.r, 1));
    ASSERT_EQ_INT(mpidp_reducer_opens_backward(f.r), 0);  /* paused hooks open nothing */
    ASSERT_EQ_INT(mpidp_reducer_held(f.r), 0);
    ASSERT_OK(mpidp_reducer_grad_arrived(f.r, 0, 1));
    ASSERT_OK(mpidp_reducer_grad_arrived(f.r, 2, 1));
    fill(&f, 0, 3.0f);
    fill(&f, 2, 4.0f);
    ASSERT_EQ_INT(mpidp_reducer_n_ready(f.r), 0);        /* nothing marked or posted */
    ASSERT_EQ_INT(mpidp_reducer_held(f.r), 1);
    ASSERT_OK(mpidp_reducer_set_paused(f.r, 0));
    ASSERT_EQ_INT(mpidp_reducer_opens_backward(f.r), 1);
    ASSERT_OK(mpidp_reducer_grad_arrived(f.r, 1, 1));
    ASSERT_EQ_INT(mpidp_reducer_held(f.r), 0);           /* this pass reduces what was held */
    ASSERT_EQ_INT(mpidp_reducer_opens_backward(f.r), 0); /* open until finalize */
    ASSERT_EQ_INT(mpidp_reducer_set_paused(f.r, 1), MPIDP_ESTATE); /* a pass is open */
    ASSERT_OK(mark_rest_unhooked(&f));
    ASSERT_OK(mpidp_reducer_finalize(f.r, NULL));
    ASSERT_EQ_INT(mpidp_reducer_opens_backward(f.r), 1);
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    /* 0 and 2 contributed what they held; 3 held nothing and goes back to None. */
    for (size_t i = 0; i < NP; i++) {
        int used = -1;
        ASSERT_OK(mpidp_reducer_used_globally(f.r, i, &used));
        ASSERT_EQ_INT(used, i != 3);
    }
    ASSERT_NEAR(slice(&f, 0)[0], 3.0, 0);
    ASSERT_NEAR(slice(&f, 2)[7], 4.0, 0);
    ASSERT_OK(mpidp_reducer_missing_grads(f.r, 0, act));   /* bucket 0: parameters 2, 3 */
    ASSERT_ACTS(act, MPIDP_GRAD_KEEP, MPIDP_GRAD_SET_NONE);
    ASSERT_EQ_INT(mpidp_reducer_set_paused(NULL, 1), MPIDP_EINVAL);
    teardown(&f);
}

TEST(decisions_of_the_other_mode_are_refused)
{
    /* Blocking pass, every bucket done: missing_grads decides; the
     * non-blocking decisions are refused, and after_step wants its out-argument. */
    fixture_t f;
    ASSERT_OK(setup(&f));
    uint8_t seen[NP] = {NONE, NONE, NONE, NONE}, act[NP];
    int over = -1;
    ASSERT_OK(mpidp_reducer_prepare(f.r, seen, act));
    ASSERT_OK(mpidp_reducer_grad_arrived(f.r, 2, 1));
    ASSERT_OK(mark_rest_unhooked(&f));
    ASSERT_OK(mpidp_reducer_finalize(f.r, NULL));
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    ASSERT_OK(mpidp_reducer_missing_grads(f.r, 0, act));
    ASSERT_ACTS(act, MPIDP_GRAD_KEEP, MPIDP_GRAD_SET_NONE);   /* 2 had a gradient, 3 none */
    ASSERT_EQ_INT(mpidp_reducer_deliver_for_step(f.r, 0, 0, seen, act), MPIDP_ESTATE);
    ASSERT_EQ_INT(mpidp_reducer_after_step(f.r, 0, act, NULL), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_reducer_after_step(f.r, 0, act, &over), MPIDP_ESTATE);
    teardown(&f);
}

/* end_blocking: the pass after mark_unhooked in one call gives the actions
 * of finalize + wait + missing_grads per bucket, in members order, and
 * resets; it refuses a pass with unmarked parameters and non-blocking mode. */
TEST(end_blocking_is_the_blocking_pass_in_one_call)
{
    fixture_t f;
    uint8_t act[NP];
    ASSERT_OK(hooked_pass(&f, act));
    ASSERT_OK(mpidp_reducer_mark_unhooked(f.r, 0, VIEW));
    ASSERT_EQ_INT(mpidp_reducer_end_blocking(f.r, 1.0, act), MPIDP_ESTATE); /* 2 unmarked */
    ASSERT_OK(mpidp_reducer_mark_unhooked(f.r, 2, NONE));
    memset(act, 0xff, sizeof act);
    ASSERT_OK(mpidp_reducer_end_blocking(f.r, 1.0, act));
    const size_t *members = mpidp_reducer_members(f.r);
    size_t expect_members[NP] = {2, 3, 0, 1}; /* bucket 0, then bucket 1 */
    for (int k = 0; k < NP; k++) ASSERT_EQ_INT(members[k], expect_members[k]);
    /* One rank: 2 and 0 had no gradient anywhere -> None; 3 and 1 keep theirs. */
    ASSERT_EQ_INT(act[0], MPIDP_GRAD_SET_NONE);
    ASSERT_EQ_INT(act[1], MPIDP_GRAD_KEEP);
    ASSERT_EQ_INT(act[2], MPIDP_GRAD_SET_NONE);
    ASSERT_EQ_INT(act[3], MPIDP_GRAD_KEEP);
    ASSERT_EQ_INT(mpidp_reducer_finalized(f.r), 0); /* reset: a new pass may start */
    ASSERT_EQ_INT(mpidp_reducer_n_ready(f.r), 0);
    teardown(&f);
    /* Non-blocking mode needs the version counters: refused. */
    ASSERT_OK(setup_mode(&f, 0, 1));
    for (size_t i = 0; i < NP; i++) ASSERT_OK(mpidp_reducer_grad_arrived(f.r, i, 1));
    ASSERT_EQ_INT(mpidp_reducer_end_blocking(f.r, 1.0, act), MPIDP_EINVAL);
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    teardown(&f);
}

/* A hook's call marks like grad_arrived and, asked to, progresses the
 * table, but not while paused (no_sync posts nothing to progress). */
TEST(a_hook_marks_and_progresses_what_is_in_flight)
{
    fixture_t f;
    ASSERT_OK(setup_mode(&f, 0, 1)); /* non-blocking: even one rank posts its buckets */
    ASSERT_OK(mpidp_reducer_grad_hooked(f.r, 2, 1, -1.0));
    ASSERT_OK(mpidp_reducer_grad_hooked(f.r, 3, 1, -1.0));     /* bucket 0 full: posted */
    ASSERT_EQ_INT(mpidp_reducer_n_ready(f.r), 2);
    ASSERT_EQ_INT(mpidp_reqtable_pending(f.reqs), 1);       /* not progressed */
    ASSERT_OK(mpidp_reducer_grad_hooked(f.r, 1, 1, 0.0));
    ASSERT_EQ_INT(mpidp_reducer_n_ready(f.r), 3);
    ASSERT_EQ_INT(mpidp_reqtable_pending(f.reqs), 0);       /* one rank: done once tested */
    ASSERT_EQ_INT(mpidp_reducer_grad_hooked(f.r, 1, 1, 0.0), MPIDP_ESTATE); /* second gradient */
    ASSERT_OK(mpidp_reducer_grad_hooked(f.r, 0, 1, 0.0));
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    teardown(&f);
    /* Paused (no_sync): held, neither marked nor posted. */
    ASSERT_OK(setup(&f));
    ASSERT_OK(mpidp_reducer_set_paused(f.r, 1));
    ASSERT_OK(mpidp_reducer_grad_hooked(f.r, 0, 1, 0.0));
    ASSERT_EQ_INT(mpidp_reducer_n_ready(f.r), 0);
    ASSERT_EQ_INT(mpidp_reducer_held(f.r), 1);
    teardown(&f);
}

/* Hooks progress at most once per interval: the first does, one within the
 * interval after it does not, and an interval of 0 always does. */
TEST(hooks_progress_at_most_once_per_interval)
{
    fixture_t f;
    ASSERT_OK(setup_mode(&f, 0, 1));
    ASSERT_OK(mpidp_reducer_grad_hooked(f.r, 2, 1, 3600.0)); /* the first: progresses */
    ASSERT_OK(mpidp_reducer_grad_hooked(f.r, 3, 1, 3600.0)); /* posts bucket 0, too soon */
    ASSERT_EQ_INT(mpidp_reqtable_pending(f.reqs), 1);
    ASSERT_OK(mpidp_reducer_grad_hooked(f.r, 1, 1, 0.0));
    ASSERT_EQ_INT(mpidp_reqtable_pending(f.reqs), 0);
    ASSERT_OK(mpidp_reducer_grad_hooked(f.r, 0, 1, -1.0));
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    teardown(&f);
}

TEST_MAIN_MPI(a_hook_marks_and_progresses_what_is_in_flight,
              end_blocking_is_the_blocking_pass_in_one_call,
              hooks_progress_at_most_once_per_interval,
              blocking_pass_fixes_missing_grads_like_one_process,
              staged_unhooked_parameters_are_zeroed_where_the_gradients_live,
              deferred_step_gives_grads_back_as_the_user_left_them,
              accumulating_without_a_step_adds_the_mean_unless_cleared,
              synchronizing_before_the_step_delivers_the_mean_now,
              gradients_held_without_communication_count_in_the_next_pass,
              decisions_of_the_other_mode_are_refused)
