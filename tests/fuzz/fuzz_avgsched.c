/* libFuzzer harness: the averaging schedule (mpidp/averaging_schedule.h).
 *
 * The input is a config followed by steps to ask about. For each step the
 * harness checks the call against the header's contract, recomputed here in
 * 128-bit arithmetic:
 *   - an invalid config, a negative step or a NULL argument fail with
 *     MPIDP_EINVAL and the actions "nothing to do"; validity is recomputed;
 *   - on a valid config the actions are exactly the recomputed ones;
 *   - invariants across steps: no base average or slow step during warm-up;
 *     the level is the highest one due; with slow_replaces_average no step
 *     both averages and takes a slow step; a fragment sent after step t is
 *     applied after step t + fragment_delay, to the same fragment; the
 *     fragment applied fragment_every steps later is the next in turn;
 *   - against a step-by-step simulation of torchft's counters (a local step
 *     counter reset at each sync, fragments taken in turn) over the first
 *     steps of every valid config with small periods;
 *   - no UB anywhere (UBSan), for steps and periods up to INT64_MAX.
 *
 * Input layout (fz_int: see fuzz_common.h; make_seeds.py writes it):
 *   warmup fz_int(0,20), n_levels fz_int(0,3), periods[l] fz_int(1,12) each,
 *   count_from_warmup, after_period, slow_replaces_average: u8 & 1 (u8 bit 1
 *   set: the raw u8 instead, for invalid flags), slow_every fz_int(0,12),
 *   n_fragments fz_int(0,4), fragment_every fz_int(1,8), fragment_delay
 *   fz_int(0,7); then steps fz_int(0,64) until the input ends. */
#include "mpidp/averaging_schedule.h"
#include "mpidp/status.h"

#include "fuzz_common.h"

#define FZ_FAIL(...) FZ_CHECK(0, __VA_ARGS__)

typedef __int128 i128;

static int flag(fz_t *f)
{
    uint8_t b = fz_u8(f);
    return (b & 2) ? (int)b : (b & 1);
}

static int ref_valid(const mpidp_avgsched_config_t *c)
{
    if (c->warmup_steps < 0 || c->n_levels < 0 || c->n_levels > MPIDP_AVGSCHED_MAX_LEVELS) return 0;
    for (int l = 0; l < c->n_levels; l++)
        if (c->periods[l] < 1 || (l > 0 && c->periods[l] <= c->periods[l - 1])) return 0;
    if ((unsigned)c->count_from_warmup > 1 || (unsigned)c->after_period > 1 ||
        (unsigned)c->slow_replaces_average > 1 || c->slow_every < 0 || c->n_fragments < 0)
        return 0;
    if (c->n_fragments > 0 &&
        (c->fragment_every < 1 || c->fragment_delay < 0 || c->fragment_delay >= c->fragment_every))
        return 0;
    return 1;
}

static int64_t ref_fragment(const mpidp_avgsched_config_t *c, i128 u)
{
    return u % c->fragment_every == 0 ? (int64_t)((u / c->fragment_every - 1) % c->n_fragments) : -1;
}

static mpidp_avgsched_actions_t reference(const mpidp_avgsched_config_t *c, int64_t t)
{
    mpidp_avgsched_actions_t r = {0, -1, 0, -1, -1};
    if (t >= c->warmup_steps) {
        i128 k = (i128)t - (c->count_from_warmup ? c->warmup_steps : 0) + c->after_period;
        r.slow_step = c->slow_every > 0 && k % c->slow_every == 0;
        for (int l = 0; l < c->n_levels; l++)
            if (k % c->periods[l] == 0) r.level = l;
        if (r.slow_step && c->slow_replaces_average) r.level = -1;
        r.average = r.level >= 0;
    }
    if (c->n_fragments > 0) {
        r.apply_fragment = ref_fragment(c, (i128)t + 1);
        if ((i128)t + c->fragment_delay <= INT64_MAX)
            r.send_fragment = ref_fragment(c, (i128)t + 1 + c->fragment_delay);
    }
    return r;
}

static void check_equal(const mpidp_avgsched_actions_t *a, const mpidp_avgsched_actions_t *b,
                        int64_t t)
{
    if (a->average != b->average || a->level != b->level || a->slow_step != b->slow_step ||
        a->send_fragment != b->send_fragment || a->apply_fragment != b->apply_fragment)
        FZ_FAIL("step %lld: got avg %d level %d slow %d send %lld apply %lld, expected %d %d %d "
                "%lld %lld", (long long)t, a->average, a->level, a->slow_step,
                (long long)a->send_fragment, (long long)a->apply_fragment, b->average, b->level,
                b->slow_step, (long long)b->send_fragment, (long long)b->apply_fragment);
}

static mpidp_avgsched_actions_t at(const mpidp_avgsched_config_t *c, int64_t t)
{
    mpidp_avgsched_actions_t a;
    if (mpidp_avgsched_actions(c, t, &a) != MPIDP_OK) FZ_FAIL("step %lld refused", (long long)t);
    return a;
}

static void check_step(const mpidp_avgsched_config_t *c, int64_t t)
{
    mpidp_avgsched_actions_t a = at(c, t), r = reference(c, t);
    check_equal(&a, &r, t);
    if (t < c->warmup_steps && (a.average || a.slow_step)) FZ_FAIL("acted during warm-up");
    if (a.average && a.slow_step && c->slow_replaces_average) FZ_FAIL("slow step and average");
    if (a.send_fragment >= 0) {
        mpidp_avgsched_actions_t later = at(c, t + c->fragment_delay); /* no overflow: contract */
        if (later.apply_fragment != a.send_fragment) FZ_FAIL("send without its apply");
    }
    if (a.apply_fragment >= 0 && t <= INT64_MAX - c->fragment_every) {
        mpidp_avgsched_actions_t next = at(c, t + c->fragment_every);
        if (next.apply_fragment != (a.apply_fragment + 1) % c->n_fragments)
            FZ_FAIL("fragments out of turn");
    }
}

/* torchft's counters: local step 1, 2, .. reset at each sync; the fragment of
 * a sync is the number of syncs so far mod F; send at local step every - delay. */
static void simulate(const mpidp_avgsched_config_t *c, int64_t steps)
{
    int64_t local = 0, syncs = 0;
    for (int64_t t = 0; t < steps; t++) {
        mpidp_avgsched_actions_t a = at(c, t);
        local++;
        int64_t send = local == c->fragment_every - c->fragment_delay ? syncs % c->n_fragments : -1;
        int64_t apply = -1;
        if (local == c->fragment_every) {
            apply = syncs++ % c->n_fragments;
            local = 0;
        }
        if (a.send_fragment != send || a.apply_fragment != apply)
            FZ_FAIL("step %lld: simulation sends %lld applies %lld, schedule %lld %lld",
                    (long long)t, (long long)send, (long long)apply, (long long)a.send_fragment,
                    (long long)a.apply_fragment);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_t f = {data, size};
    mpidp_avgsched_config_t c = {0};
    c.warmup_steps = fz_int(&f, 0, 20);
    c.n_levels = (int)fz_int(&f, 0, 3);
    for (int l = 0; l < c.n_levels && l < MPIDP_AVGSCHED_MAX_LEVELS; l++) c.periods[l] = fz_int(&f, 1, 12);
    c.count_from_warmup = flag(&f);
    c.after_period = flag(&f);
    c.slow_replaces_average = flag(&f);
    c.slow_every = fz_int(&f, 0, 12);
    c.n_fragments = fz_int(&f, 0, 4);
    c.fragment_every = fz_int(&f, 1, 8);
    c.fragment_delay = fz_int(&f, 0, 7);

    mpidp_avgsched_actions_t a;
    int valid = ref_valid(&c);
    if ((mpidp_avgsched_config_validate(&c) == MPIDP_OK) != valid) FZ_FAIL("validity differs");
    if (mpidp_avgsched_actions(NULL, 0, &a) != MPIDP_EINVAL || mpidp_avgsched_actions(&c, 0, NULL) != MPIDP_EINVAL)
        FZ_FAIL("NULL accepted");
    if (valid && c.n_fragments > 0 && c.fragment_every <= 64) simulate(&c, 200);
    while (!fz_empty(&f)) {
        int64_t t = fz_int(&f, 0, 64);
        if (!valid || t < 0) {
            if (mpidp_avgsched_actions(&c, t, &a) != MPIDP_EINVAL) FZ_FAIL("bad input accepted");
            if (a.average || a.level != -1 || a.slow_step || a.send_fragment != -1 || a.apply_fragment != -1)
                FZ_FAIL("a refusal with actions");
            continue;
        }
        check_step(&c, t);
    }
    return 0;
}
