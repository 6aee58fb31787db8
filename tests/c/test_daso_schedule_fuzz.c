/* The DASO schedule under long pseudo-random runs, checked step by step
 * against its invariants with an independent shadow of the pending sync, plus
 * validate() against corrupted states and the checkpoint round trip. */
#include "mpidp/daso_schedule.h"
#include "mpidp/status.h"
#include "daso_schedule_actions.h"
#include "test.h"

#include <stddef.h>

/* xorshift64*: deterministic, so a failure reproduces from the seed. */
static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next_rand(void)
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 0x2545f4914f6cdd1dull;
}

/* Uniform in [lo, hi]. */
static int64_t rand_in(int64_t lo, int64_t hi)
{
    return lo + (int64_t)(next_rand() % (uint64_t)(hi - lo + 1));
}

/* What the test itself knows about the sync in flight, from the actions alone. */
typedef struct {
    int pending;
    int64_t group, btw, sent_at;
    int64_t sends;       /* sends posted so far, over all epochs */
    int64_t completions; /* completions of non-blocking sends so far */
} shadow_t;

/* Save the state through the public field list and load it into a struct full
 * of garbage, as a checkpoint restore would. */
static void checkpoint_round_trip(const mpidp_schedule_t *src, mpidp_schedule_t *dst)
{
    unsigned char saved[sizeof *src];
    size_t at = 0;
#define SAVE(type, member)                                                      \
    memcpy(saved + at, &src->member, sizeof(type));                             \
    at += sizeof(type);
    MPIDP_SCHEDULE_FIELDS(SAVE)
#undef SAVE
    memset(dst, 0xa5, sizeof *dst);
    at = 0;
#define LOAD(type, member)                                                      \
    memcpy(&dst->member, saved + at, sizeof(type));                             \
    at += sizeof(type);
    MPIDP_SCHEDULE_FIELDS(LOAD)
#undef LOAD
}

/* Check one step's actions against the invariants and update the shadow.
 * Returns 0, or a number naming the broken invariant. */
static int check_step(const mpidp_schedule_t *s, shadow_t *sh, int64_t b, int64_t last,
                      int64_t gs, const mpidp_schedule_actions_t *a)
{
    const mpidp_schedule_config_t *cfg = &s->cfg;
    /* Skips within bounds, as in force for this epoch. */
    if (s->batches_to_wait < 0 || s->batches_to_wait > s->global_skip) return 1;
    if (s->local_skip < 0 || s->global_skip > cfg->max_global_skips) return 2;
    if (s->phase == MPIDP_SCHEDULE_CYCLING &&
        (s->global_skip < 1 || s->local_skip < 1 || s->batches_to_wait < 1))
        return 3;

    /* Completion: only of the one pending send, once, after exactly its btw. */
    if (a->complete) {
        if (!sh->pending) return 10;
        if (a->complete_group != sh->group || a->complete_btw != sh->btw) return 11;
        if (a->complete_btw < 1) return 12;
        if (b != sh->sent_at + sh->btw) return 13;
        sh->pending = 0;
        sh->completions++;
    } else if (sh->pending && b >= sh->sent_at + sh->btw) {
        return 14; /* overdue */
    }

    /* Sends: exactly on global-sync batches, never while one is pending. */
    int global = gs == 0 || b % gs == 0 || b == last;
    if (a->send != global) return 20;
    if (a->send) {
        if (sh->pending) return 21;
        if (a->send_group != sh->sends % cfg->n_groups) return 22;
        if (a->send_btw < 0 || a->send_btw > gs || a->send_btw > last - b) return 23;
        if (a->send_blocking != (a->send_btw == 0)) return 24;
        sh->sends++;
        if (!a->send_blocking) {
            sh->pending = 1;
            sh->group = a->send_group;
            sh->btw = a->send_btw;
            sh->sent_at = b;
        }
    } else if (a->send_blocking || a->send_btw || a->send_group) {
        return 25;
    }

    /* The last batch blocks and leaves nothing pending. */
    if (b == last) {
        if (!a->send || !a->send_blocking || !a->epoch_done || sh->pending) return 30;
        if (s->next_batch != 0 || s->last_batch != -1) return 31;
    } else if (a->epoch_done || s->next_batch != b + 1) {
        return 32;
    }

    /* Local sync on before every global-sync batch and before the last. */
    if (a->local_sync != (int)s->local_sync) return 40;
    if (b == last && !a->local_sync) return 41;
    if (b < last && (gs == 0 || (b + 1) % gs == 0 || b + 1 == last) && !a->local_sync)
        return 42;
    if (b < last && s->local_skip == 1 && !a->local_sync) return 43;

    /* The state agrees with the shadow. */
    if (s->pending != sh->pending) return 50;
    if (sh->pending && (s->pending_group != sh->group || s->pending_btw != sh->btw ||
                        s->pending_sent_at != sh->sent_at))
        return 51;
    return 0;
}

/* A pseudo-random loss: mostly a noisy decay with flat stretches so that both
 * improvement and plateaus happen, sometimes NaN or an infinity. */
static double next_loss(double *level)
{
    int64_t r = rand_in(0, 99);
    if (r < 3) return NAN;
    if (r < 5) return r == 3 ? INFINITY : -INFINITY;
    if (r < 45) *level *= 0.8 + 0.15 * (double)rand_in(0, 100) / 100.0;
    if (r >= 95) *level = -*level; /* negative losses too */
    return *level + 0.01 * (double)rand_in(-10, 10) * (*level >= 0 ? *level : -*level);
}

/* Try a wrong call and check it is refused without any change. */
static int misuse(mpidp_schedule_t *s, int64_t b, int64_t last)
{
    mpidp_schedule_t before = *s;
    mpidp_schedule_actions_t a;
    int rc;
    switch (rand_in(0, 4)) {
    case 0: rc = mpidp_schedule_batch(s, b + 1, last, &a); break; /* skip */
    case 1:
        if (b == 0) return 0;
        rc = mpidp_schedule_batch(s, b - 1, last, &a); /* repeat */
        break;
    case 2:
        if (b == 0) return 0;
        rc = mpidp_schedule_batch(s, b, last + 1, &a); /* last_batch changes */
        break;
    case 3: rc = mpidp_schedule_batch(s, last + 1, last, &a); break; /* past end */
    default:
        if (b == 0) return 0;
        rc = mpidp_schedule_epoch_end(s, 1.0); /* mid-epoch */
        break;
    }
    if (rc != MPIDP_ESTATE) return 2;
    if (memcmp(s, &before, sizeof before) != 0) return 3;
    return 0;
}

TEST(random_runs_keep_every_invariant)
{
    int64_t total_steps = 0, total_completions = 0, plateaus_seen = 0, resets_seen = 0;
    for (int run = 0; run < 250; run++) {
        mpidp_schedule_config_t cfg;
        mpidp_schedule_config_default(&cfg);
        cfg.total_epochs = rand_in(1, 60);
        cfg.warmup_epochs = rand_in(0, 6);
        cfg.cooldown_epochs = rand_in(0, 6);
        cfg.max_global_skips = rand_in(1, 16);
        cfg.skip_reduction_factor = rand_in(2, 5);
        cfg.local_skip_factor = rand_in(1, 6);
        cfg.n_groups = rand_in(1, 4);
        static const double levels[] = {0.0, 0.01, 0.05, 0.2};
        cfg.stability_level = levels[rand_in(0, 3)];

        mpidp_schedule_t s;
        shadow_t sh = {0};
        double level = 10.0;
        ASSERT_OK(mpidp_schedule_init(&s, &cfg));
        int64_t epochs = cfg.total_epochs + rand_in(0, 5);
        for (int64_t e = 0; e < epochs; e++) {
            int64_t last = rand_in(1, 50) - 1;
            int64_t gs = s.global_skip, prev_gs = gs;
            for (int64_t b = 0; b <= last; b++) {
                if (rand_in(0, 19) == 0) {
                    int m = misuse(&s, b, last);
                    if (m) fprintf(stderr, "  run %d epoch %lld batch %lld: misuse %d\n",
                                   run, (long long)e, (long long)b, m);
                    ASSERT_EQ_INT(m, 0);
                }
                if (rand_in(0, 49) == 0) {
                    mpidp_schedule_t restored;
                    checkpoint_round_trip(&s, &restored);
                    ASSERT_OK(mpidp_schedule_validate(&restored));
                    ASSERT_TRUE(memcmp(&restored, &s, sizeof s) == 0);
                    s = restored;
                }
                mpidp_schedule_actions_t a;
                ASSERT_OK(mpidp_schedule_batch(&s, b, last, &a));
                ASSERT_OK(mpidp_schedule_validate(&s));
                int bad = check_step(&s, &sh, b, last, gs, &a);
                if (bad)
                    fprintf(stderr, "  run %d epoch %lld batch %lld/%lld (gs %lld): "
                            "invariant %d\n", run, (long long)e, (long long)b,
                            (long long)last, (long long)gs, bad);
                ASSERT_EQ_INT(bad, 0);
                total_steps++;
            }
            ASSERT_EQ_INT(s.epoch, e + 1);
            ASSERT_EQ_INT(sh.pending, 0);
            /* Usually one epoch_end per epoch; sometimes none, sometimes two. */
            int64_t r = rand_in(0, 9);
            if (r != 0) {
                ASSERT_OK(mpidp_schedule_epoch_end(&s, next_loss(&level)));
                ASSERT_OK(mpidp_schedule_validate(&s));
                if (r == 1) {
                    mpidp_schedule_t before = s;
                    ASSERT_EQ_INT(mpidp_schedule_epoch_end(&s, 1.0), MPIDP_ESTATE);
                    ASSERT_TRUE(memcmp(&s, &before, sizeof s) == 0);
                }
            }
            if (s.phase == MPIDP_SCHEDULE_CYCLING && prev_gs > 0) {
                if (s.global_skip < prev_gs) plateaus_seen++;
                if (s.global_skip > prev_gs) resets_seen++;
            }
            /* The phase follows the counter: cooldown is final. */
            if (s.logic_epoch >= cfg.total_epochs - cfg.cooldown_epochs &&
                s.logic_epoch >= cfg.warmup_epochs)
                ASSERT_EQ_INT(s.phase, MPIDP_SCHEDULE_COOLDOWN);
        }
        total_completions += sh.completions;
    }
    /* The runs exercised what they are meant to. */
    ASSERT_TRUE(total_steps > 100000);
    ASSERT_TRUE(total_completions > 10000);
    ASSERT_TRUE(plateaus_seen > 100);
    ASSERT_TRUE(resets_seen > 20);
}

/* A mid-epoch cycling state, three groups. Epoch 0 is warmup (4 blocking
 * sends: groups 0, 1, 2, 0); epoch 1 runs (8,2,2) with last batch 12. Stopping
 * after batch 8: batch 0 sent on group 1 (completed on 2), batch 8 on group 2
 * with btw 2, pending until 10, so local sync is on and send_mod is 0.
 * Stopping after batch 2 instead: nothing pending, local sync off for 3. */
static int sample_state(mpidp_schedule_t *s, int64_t stop_after)
{
    mpidp_schedule_config_t cfg;
    mpidp_schedule_config_default(&cfg);
    cfg.total_epochs = 50;
    cfg.warmup_epochs = 1;
    cfg.n_groups = 3;
    int rc = mpidp_schedule_init(s, &cfg);
    mpidp_schedule_actions_t a;
    for (int64_t b = 0; rc == MPIDP_OK && b <= 3; b++) rc = mpidp_schedule_batch(s, b, 3, &a);
    if (rc == MPIDP_OK) rc = mpidp_schedule_epoch_end(s, 4.0);
    if (rc != MPIDP_OK) return rc;
    s->global_skip = 8;
    s->local_skip = 2;
    s->batches_to_wait = 2;
    for (int64_t b = 0; rc == MPIDP_OK && b <= stop_after; b++)
        rc = mpidp_schedule_batch(s, b, 12, &a);
    if (rc == MPIDP_OK) rc = mpidp_schedule_validate(s);
    return rc;
}

TEST(validate_catches_corruption)
{
    mpidp_schedule_t good, off, s;
    ASSERT_OK(sample_state(&good, 8));
    ASSERT_EQ_INT(good.pending, 1);
    ASSERT_EQ_INT(good.pending_sent_at, 8);
    ASSERT_EQ_INT(good.pending_group, 2);
    ASSERT_EQ_INT(good.send_mod, 0);
    ASSERT_OK(sample_state(&off, 2));
    ASSERT_EQ_INT(off.pending, 0);
    ASSERT_EQ_INT(off.local_sync, 0);

    int cases = 0;
#define CORRUPT(base, stmt, part)                                               \
    do {                                                                        \
        s = base;                                                               \
        stmt;                                                                   \
        mpidp_error_clear();                                                    \
        ASSERT_EQ_INT(mpidp_schedule_validate(&s), MPIDP_EINVAL);               \
        if (!strstr(mpidp_error_detail(), part))                                \
            fprintf(stderr, "  detail: %s\n", mpidp_error_detail());            \
        ASSERT_TRUE(strstr(mpidp_error_detail(), part) != NULL);                \
        mpidp_schedule_t kept = s;                                              \
        mpidp_schedule_actions_t act;                                           \
        ASSERT_EQ_INT(mpidp_schedule_batch(&s, s.next_batch, 12, &act),         \
                      MPIDP_EINVAL);                                            \
        ASSERT_EQ_INT(mpidp_schedule_epoch_end(&s, 1.0), MPIDP_EINVAL);         \
        ASSERT_TRUE(memcmp(&s, &kept, sizeof s) == 0);                          \
        cases++;                                                                \
    } while (0)

    /* Config. */
    CORRUPT(good, s.cfg.total_epochs = 0, "total_epochs");
    CORRUPT(good, s.cfg.n_groups = 0, "n_groups");
    CORRUPT(good, s.cfg.stability_level = NAN, "stability_level");
    CORRUPT(good, s.cfg.max_global_skips = 4, "max_global_skips");
    /* Phase and skips. */
    CORRUPT(good, s.phase = 7, "phase");
    CORRUPT(good, s.phase = MPIDP_SCHEDULE_COOLDOWN, "phase");
    CORRUPT(good, s.phase = MPIDP_SCHEDULE_WARMUP, "phase");
    CORRUPT(good, s.global_skip = 0, "global_skip");
    CORRUPT(good, s.global_skip = 9, "global_skip");
    CORRUPT(good, s.local_skip = 0, "local_skip");
    CORRUPT(good, s.local_skip = 9, "local_skip");
    CORRUPT(good, s.batches_to_wait = 0, "batches_to_wait");
    CORRUPT(good, s.batches_to_wait = 9, "batches_to_wait");
    /* Counters. */
    CORRUPT(good, s.epoch = -1, "epoch");
    CORRUPT(good, s.epoch = INT64_MAX, "epoch");
    CORRUPT(good, s.logic_epoch = s.epoch + 1, "logic_epoch");
    CORRUPT(good, s.logic_epoch = -2, "logic_epoch");
    CORRUPT(good, s.logic_epoch = 0, "phase"); /* counter 0 is warmup */
    CORRUPT(good, s.logic_epoch = 60, "logic_epoch");
    /* Detector. */
    CORRUPT(good, s.has_best = 2, "has_best");
    CORRUPT(good, s.bad_epochs = 3, "bad_epochs");
    CORRUPT(good, s.bad_epochs = -1, "bad_epochs");
    CORRUPT(good, s.best_loss = INFINITY, "best_loss");
    CORRUPT(good, (s.has_best = 0, s.best_loss = 1.0), "best_loss");
    /* Batch position. */
    CORRUPT(good, s.next_batch = 13, "next_batch");
    CORRUPT(good, s.next_batch = -1, "next_batch");
    CORRUPT(good, s.last_batch = 5, "next_batch");
    CORRUPT(good, (s.next_batch = 0, s.pending = 0), "last_batch");
    CORRUPT(good, s.send_mod = 3, "send_mod");
    CORRUPT(good, s.send_mod = -1, "send_mod");
    /* Pending sync and local sync. */
    CORRUPT(good, s.pending = 0, "pending");
    CORRUPT(good, s.pending = 2, "pending");
    CORRUPT(good, s.pending_group = 1, "pending sync");
    CORRUPT(good, s.send_mod = 2, "pending sync");
    CORRUPT(good, s.pending_btw = 1, "pending sync");
    CORRUPT(good, s.pending_sent_at = 7, "pending sync");
    CORRUPT(good, s.local_sync = 0, "local_sync");
    CORRUPT(good, s.local_sync = 2, "local_sync");
    CORRUPT(off, s.local_sync = 1, "local_sync");
    CORRUPT(off, s.pending = 1, "pending");
    CORRUPT(off, s.pending_btw = 2, "pending_group/btw/sent_at");
    CORRUPT(off, s.next_batch = 4, "local_sync"); /* 4 % ls == 0: should be on */
#undef CORRUPT
    ASSERT_EQ_INT(cases, 42);
    ASSERT_EQ_INT(mpidp_schedule_validate(NULL), MPIDP_EINVAL);

    /* A fed detector during warmup cannot happen. */
    mpidp_schedule_config_t cfg;
    mpidp_schedule_config_default(&cfg);
    cfg.total_epochs = 10;
    ASSERT_OK(mpidp_schedule_init(&s, &cfg));
    s.bad_epochs = 1;
    ASSERT_EQ_INT(mpidp_schedule_validate(&s), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "detector") != NULL);

    /* The uncorrupted states continue normally to the end of the epoch. */
    mpidp_schedule_actions_t a;
    for (int64_t b = good.next_batch; b <= 12; b++)
        ASSERT_OK(mpidp_schedule_batch(&good, b, 12, &a));
    ASSERT_TRUE(a.epoch_done && !a.complete && a.send_blocking);
}

/* Restoring a checkpoint taken mid-epoch replays exactly what the original
 * would have done. */
TEST(checkpoint_restore_replays_exactly)
{
    mpidp_schedule_t a_state, b_state;
    ASSERT_OK(sample_state(&a_state, 4));
    checkpoint_round_trip(&a_state, &b_state);
    ASSERT_OK(mpidp_schedule_validate(&b_state));
    for (int e = 0; e < 20; e++) {
        int64_t last = e == 0 ? 12 : (int64_t)(e * 7 % 23);
        for (int64_t b = e == 0 ? 5 : 0; b <= last; b++) {
            mpidp_schedule_actions_t x, y;
            ASSERT_OK(mpidp_schedule_batch(&a_state, b, last, &x));
            ASSERT_OK(mpidp_schedule_batch(&b_state, b, last, &y));
            ASSERT_TRUE(same_actions(&x, &y));
        }
        ASSERT_OK(mpidp_schedule_epoch_end(&a_state, 1.0 / (e % 5 + 1)));
        ASSERT_OK(mpidp_schedule_epoch_end(&b_state, 1.0 / (e % 5 + 1)));
        ASSERT_TRUE(memcmp(&a_state, &b_state, sizeof a_state) == 0);
    }
}

TEST_MAIN(random_runs_keep_every_invariant, validate_catches_corruption,
          checkpoint_restore_replays_exactly)
