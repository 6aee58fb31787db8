/* The DASO schedule, batch level: the actions of every step of an epoch for
 * chosen (gs, ls, btw, last_batch, n_groups), and the refused batch sequences.
 *
 * An epoch's actions are written as one string, one token per batch:
 *   r<g>/<w>   complete the pending sync sent on group g with btw w (first)
 *   s<g>/<w>   post a global sync on group g carrying btw w (second)
 *   !          ... and complete that send at once (blocking)
 *   + or -     node-local gradient sync on / off for the next backward
 *   $          last batch: the epoch counter advanced
 *
 * The rules the expected strings are derived from (daso_schedule.h):
 *   G  batch b is a global-sync batch when b % gs == 0 or b == last; it sends
 *      on group send_mod (then send_mod = (send_mod + 1) % n_groups) with
 *      btw' = min(btw, last - b); btw' == 0 is blocking.
 *   R  a pending send posted on batch t with btw' completes on batch t + btw',
 *      before any send of that batch.
 *   L  local sync for the next batch n: on when n is a G batch, when ls == 1,
 *      or while a send is still pending; else on iff n % ls == 0. */
#include "mpidp/daso_schedule.h"
#include "mpidp/status.h"
#include "test.h"

/* Append the token of one step to buf. */
static void put_step(char *buf, size_t cap, const mpidp_schedule_actions_t *a)
{
    size_t used = strlen(buf);
    if (used) used += (size_t)snprintf(buf + used, cap - used, " ");
    if (a->complete)
        used += (size_t)snprintf(buf + used, cap - used, "r%lld/%lld",
                                 (long long)a->complete_group,
                                 (long long)a->complete_btw);
    if (a->send)
        used += (size_t)snprintf(buf + used, cap - used, "s%lld/%lld%s",
                                 (long long)a->send_group, (long long)a->send_btw,
                                 a->send_blocking ? "!" : "");
    used += (size_t)snprintf(buf + used, cap - used, "%c%s",
                             a->local_sync ? '+' : '-', a->epoch_done ? "$" : "");
}

/* Run one whole epoch 0..last and write its trace; returns the first failing
 * status. validate() must accept the state after every step. */
static int epoch_trace(mpidp_schedule_t *s, int64_t last, char *buf, size_t cap)
{
    buf[0] = '\0';
    for (int64_t b = 0; b <= last; b++) {
        mpidp_schedule_actions_t a;
        int rc = mpidp_schedule_batch(s, b, last, &a);
        if (rc != MPIDP_OK) return rc;
        rc = mpidp_schedule_validate(s);
        if (rc != MPIDP_OK) return rc;
        put_step(buf, cap, &a);
    }
    return MPIDP_OK;
}

/* The default config with the given epochs and groups. */
static mpidp_schedule_config_t config(int64_t total, int64_t warmup, int64_t cooldown,
                                      int64_t n_groups)
{
    mpidp_schedule_config_t cfg;
    mpidp_schedule_config_default(&cfg);
    cfg.total_epochs = total;
    cfg.warmup_epochs = warmup;
    cfg.cooldown_epochs = cooldown;
    cfg.n_groups = n_groups;
    return cfg;
}

/* A cycling schedule with the given skips, as a restored checkpoint would set
 * them; validate() confirms it is a state the schedule accepts. */
static int cycling(mpidp_schedule_t *s, int64_t gs, int64_t ls, int64_t btw,
                   int64_t n_groups)
{
    mpidp_schedule_config_t cfg = config(100, 0, 0, n_groups);
    cfg.max_global_skips = 16;
    int rc = mpidp_schedule_init(s, &cfg);
    if (rc != MPIDP_OK) return rc;
    s->global_skip = gs;
    s->local_skip = ls;
    s->batches_to_wait = btw;
    return mpidp_schedule_validate(s);
}

/* One epoch of a trace: its last batch index and the actions it must give. */
typedef struct {
    int64_t last;
    const char *want;
} epoch_want_t;

/* A cycling schedule set to (gs, ls, btw) with n_groups groups, run through
 * its epochs in turn (up to the first without a `want`), so the group
 * rotation carries on from one epoch to the next. */
typedef struct {
    const char *name;
    int64_t gs, ls, btw, n_groups;
    epoch_want_t epochs[6];
} trace_case_t;

static const trace_case_t cycling_traces[] = {
    /* (4,1,1), last 9, one group. G: 0, 4, 8, 9. Each send has btw 1 and
     * completes on the next batch (R); the one of batch 8 has btw' = min(1,
     * 9-8) = 1 and completes on 9, before 9's blocking send. ls == 1: always
     * on (L). */
    {"4_1_1", 4, 1, 1, 1, {{9, "s0/1+ r0/1+ + + s0/1+ r0/1+ + + s0/1+ r0/1s0/0!+$"}}},
    /* (8,2,2), last 9, two groups. G: 0 (group 0), 8 (group 1), 9 (group 0).
     * Batch 0 sends btw 2, pending through 1 (+), completed on 2. After 2, L
     * gives n % 2 == 0: 3 -, 4 +, 5 -, 6 +; 7 is followed by G batch 8: +.
     * Batch 8: btw' = min(2, 1) = 1, completed on 9 before the blocking send.
     * The second epoch starts on group 1 because the rotation runs on across
     * epochs. */
    {"8_2_2_two_groups", 8, 2, 2, 2,
     {{9, "s0/2+ + r0/2- + - + - + s1/1+ r1/1s0/0!+$"},
      {9, "s1/2+ + r1/2- + - + - + s0/1+ r0/1s1/0!+$"}}},
    /* last_batch 3 < gs 8, three groups. G: 0 and 3 only. Batch 0: btw' =
     * min(2, 3) = 2, completed on 2; batch 3 is next after 2 and the last: +.
     * Groups rotate 0, 1 | 2, 0 | 1, 2 over three epochs. Then last 1: btw' =
     * min(2, 1) = 1, completed on the last batch; and a single-batch epoch is
     * one blocking sync. */
    {"short_epoch_three_groups", 8, 2, 2, 3,
     {{3, "s0/2+ + r0/2+ s1/0!+$"},
      {3, "s2/2+ + r2/2+ s0/0!+$"},
      {3, "s1/2+ + r1/2+ s2/0!+$"},
      {1, "s0/1+ r0/1s1/0!+$"},
      {0, "s2/0!+$"}}},
    /* btw clamped at the epoch end: (4,2,3), last 5. G: 0, 4, 5. Batch 0:
     * btw' = min(3, 5) = 3, pending on 1, 2 (+), completed on 3, after which 4
     * is G (+). Batch 4: btw' = min(3, 1) = 1, completed on 5 before its
     * blocking send. Then last 2: btw' = min(3, 2) = 2, completed on the last
     * batch itself. */
    {"btw_clamped_at_epoch_end", 4, 2, 3, 1,
     {{5, "s0/3+ + + r0/3+ s0/1+ r0/1s0/0!+$"},
      {2, "s0/2+ + r0/2s0/0!+$"}}},
    /* btw == gs: (4,4,4), last 9. Each send completes on the next G batch,
     * just before that batch's own send; one sync is always pending, so local
     * sync stays on. Batch 8: btw' = min(4, 1) = 1. */
    {"btw_equals_gs_completes_then_sends", 4, 4, 4, 2,
     {{9, "s0/4+ + + + r0/4s1/4+ + + + r1/4s0/1+ r0/1s1/0!+$"}}},
    /* Local sync toggling with ls = 4 > btw: (8,4,1), last 12. G: 0, 8, 12.
     * Batch 0 sends btw 1, completed on 1; then L: next 2 -, 3 -, 4 + (4 % 4),
     * 5 -, 6 -, 7 -, 8 + (G). Batch 8: btw' = min(1, 4) = 1, completed on 9;
     * next 10 -, 11 -, 12 + (the last batch). */
    {"local_skip_toggling", 8, 4, 1, 1,
     {{12, "s0/1+ r0/1- - + - - - + s0/1+ r0/1- - + s0/0!+$"}}},
    /* ls = 3 with gs = 6, btw 2, last 13. G: 0, 6, 12, 13. After each
     * completion (2, 8) the next batch is a multiple of 3 (+), then two off,
     * then the batch before the G batch (+). Batch 12: btw' = min(2, 1) = 1. */
    {"local_skip_three", 6, 3, 2, 1,
     {{13, "s0/2+ + r0/2+ - - + s0/2+ + r0/2+ - - + s0/1+ r0/1s0/0!+$"}}},
    /* (2,1,1), last 4, two groups. Heat skips the receive when the next batch
     * is a G batch and does it one batch late in the global sync; here every
     * send completes after exactly its btw, so the merge weight matches the
     * lag. */
    {"2_1_1_completes_on_time", 2, 1, 1, 2, {{4, "s0/1+ r0/1+ s1/1+ r1/1+ s0/0!+$"}}},
    /* gs = 1: every batch is G; each completes the previous send, then sends. */
    {"1_1_1_every_batch", 1, 1, 1, 2, {{3, "s0/1+ r0/1s1/1+ r1/1s0/1+ r0/1s1/0!+$"}}},
    /* One group: every send and completion is on group 0. G: 0, 3, 6, 7;
     * batch 6: btw' = min(1, 1) = 1. */
    {"one_group", 3, 1, 1, 1, {{7, "s0/1+ r0/1+ + s0/1+ r0/1+ + s0/1+ r0/1s0/0!+$"}}},
};

/* Runs one case; 0 when every epoch gives its trace and ends with the epoch
 * counter advanced and no sync pending, else 1 with what went wrong on
 * stderr. */
static int run_trace_case(const trace_case_t *c)
{
    mpidp_schedule_t s;
    char t[512];
    int rc = cycling(&s, c->gs, c->ls, c->btw, c->n_groups);
    if (rc != MPIDP_OK) {
        fprintf(stderr, "  %s: refused: %s\n", c->name, mpidp_error_detail());
        return 1;
    }
    for (int e = 0; e < 6 && c->epochs[e].want; e++) {
        rc = epoch_trace(&s, c->epochs[e].last, t, sizeof t);
        if (rc != MPIDP_OK) {
            fprintf(stderr, "  %s, epoch %d: refused: %s\n", c->name, e, mpidp_error_detail());
            return 1;
        }
        if (strcmp(t, c->epochs[e].want) != 0) {
            fprintf(stderr, "  %s, epoch %d: \"%s\" != \"%s\"\n", c->name, e, t,
                    c->epochs[e].want);
            return 1;
        }
        if (s.epoch != e + 1 || s.pending != 0) {
            fprintf(stderr, "  %s, epoch %d: epoch counter %lld, pending %lld after it\n",
                    c->name, e, (long long)s.epoch, (long long)s.pending);
            return 1;
        }
    }
    return 0;
}

/* Every case runs, so one failure does not hide the others. */
TEST(cycling_traces)
{
    int failed = 0;
    for (size_t i = 0; i < sizeof cycling_traces / sizeof cycling_traces[0]; i++)
        failed += run_trace_case(&cycling_traces[i]);
    ASSERT_EQ_INT(failed, 0);
}

/* Warmup and cooldown: every batch a blocking sync, groups taking turns. */
TEST(trace_blocking_phases)
{
    mpidp_schedule_t s;
    char t[512];
    mpidp_schedule_config_t cfg = config(3, 1, 2, 3);
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_WARMUP);
    ASSERT_OK(epoch_trace(&s, 3, t, sizeof t));
    ASSERT_STREQ(t, "s0/0!+ s1/0!+ s2/0!+ s0/0!+$");
    ASSERT_OK(mpidp_schedule_epoch_end(&s, 1.0));
    ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_COOLDOWN);
    ASSERT_OK(epoch_trace(&s, 1, t, sizeof t));
    ASSERT_STREQ(t, "s1/0!+ s2/0!+$");
}

/* The transition from warmup into cycling at an epoch boundary, and the
 * counter: epoch advances on each last batch. */
TEST(trace_across_phase_change)
{
    mpidp_schedule_t s;
    char t[512];
    mpidp_schedule_config_t cfg = config(10, 1, 4, 2); /* cooldown 4: the default */
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    ASSERT_OK(epoch_trace(&s, 5, t, sizeof t));
    ASSERT_STREQ(t, "s0/0!+ s1/0!+ s0/0!+ s1/0!+ s0/0!+ s1/0!+$");
    ASSERT_EQ_INT(s.epoch, 1);
    ASSERT_OK(mpidp_schedule_epoch_end(&s, 3.0));
    ASSERT_EQ_INT(s.global_skip, 4);
    ASSERT_OK(epoch_trace(&s, 5, t, sizeof t));
    ASSERT_STREQ(t, "s0/1+ r0/1+ + + s1/1+ r1/1s0/0!+$");
    ASSERT_EQ_INT(s.epoch, 2);
}

/* Each refused batch sequence: the right status, a detail saying what was
 * wrong, the state unchanged and the actions "nothing, keep local sync". */
static int refuse(mpidp_schedule_t *s, int64_t batch, int64_t last, int want,
                  const char *detail_part)
{
    mpidp_schedule_t before = *s;
    mpidp_schedule_actions_t a;
    memset(&a, 0x77, sizeof a);
    mpidp_error_clear();
    int rc = mpidp_schedule_batch(s, batch, last, &a);
    if (rc != want) return 1;
    if (!strstr(mpidp_error_detail(), detail_part)) return 2;
    if (memcmp(s, &before, sizeof before) != 0) return 3;
    if (a.complete || a.send || a.send_blocking || a.epoch_done) return 4;
    if (a.local_sync != (int)s->local_sync) return 5;
    return 0;
}

TEST(invalid_batch_sequences)
{
    mpidp_schedule_t s;
    mpidp_schedule_actions_t a;
    ASSERT_OK(cycling(&s, 8, 2, 2, 2));

    /* The first batch of an epoch must be 0. */
    ASSERT_EQ_INT(refuse(&s, 1, 5, MPIDP_ESTATE, "must start at batch 0"), 0);
    ASSERT_EQ_INT(refuse(&s, -1, 5, MPIDP_EINVAL, "batch must be >= 0"), 0);
    ASSERT_EQ_INT(refuse(&s, 0, -1, MPIDP_EINVAL, "last_batch must be >= 0"), 0);
    ASSERT_EQ_INT(refuse(&s, 6, 5, MPIDP_ESTATE, "past last_batch"), 0);

    ASSERT_OK(mpidp_schedule_batch(&s, 0, 5, &a));
    ASSERT_OK(mpidp_schedule_batch(&s, 1, 5, &a));
    /* Repeated, skipped, past the end, last_batch changed. */
    ASSERT_EQ_INT(refuse(&s, 1, 5, MPIDP_ESTATE, "repeated"), 0);
    ASSERT_EQ_INT(refuse(&s, 0, 5, MPIDP_ESTATE, "repeated"), 0);
    ASSERT_EQ_INT(refuse(&s, 3, 5, MPIDP_ESTATE, "skips batch 2"), 0);
    ASSERT_EQ_INT(refuse(&s, 7, 5, MPIDP_ESTATE, "past last_batch"), 0);
    ASSERT_EQ_INT(refuse(&s, 2, 6, MPIDP_ESTATE, "last_batch changed"), 0);
    ASSERT_EQ_INT(refuse(&s, 2, 4, MPIDP_ESTATE, "last_batch changed"), 0);
    ASSERT_EQ_INT(refuse(&s, 2, 1, MPIDP_ESTATE, "past last_batch"), 0);

    /* The sequence goes on undisturbed after the refusals. */
    for (int64_t b = 2; b <= 5; b++) ASSERT_OK(mpidp_schedule_batch(&s, b, 5, &a));
    ASSERT_TRUE(a.epoch_done);
    /* The last batch again, after the epoch ended: the next must be 0. */
    ASSERT_EQ_INT(refuse(&s, 5, 5, MPIDP_ESTATE, "must start at batch 0"), 0);
    /* A new epoch may have a different length. */
    ASSERT_OK(mpidp_schedule_batch(&s, 0, 2, &a));

    /* NULL pointers. */
    ASSERT_EQ_INT(mpidp_schedule_batch(&s, 1, 2, NULL), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_schedule_batch(NULL, 0, 2, &a), MPIDP_EINVAL);
    ASSERT_EQ_INT(a.send, 0);
    ASSERT_EQ_INT(a.local_sync, 1);

    /* A corrupted state is refused by batch() too. */
    s.send_mod = 7;
    ASSERT_EQ_INT(refuse(&s, 1, 2, MPIDP_EINVAL, "send_mod"), 0);
}

TEST_MAIN(cycling_traces, trace_blocking_phases, trace_across_phase_change,
          invalid_batch_sequences)
