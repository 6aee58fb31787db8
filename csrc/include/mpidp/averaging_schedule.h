/* The averaging schedule of the outer-optimizer family: periodic and
 * hierarchical model averaging (torch's model averagers, LocalSGD), SlowMo's
 * slow momentum step and (Streaming) DiLoCo's fragment syncs.
 *
 * A pure function of (config, step): what to do after optimizer step t,
 * counted from 0. The only state is t, which the caller keeps (torch's
 * averagers expose it as `averager.step`, and checkpoints store it), so a
 * restored t gives exactly the actions the uninterrupted run would have
 * taken. Like the DASO schedule it never allocates, does no I/O and never
 * calls MPI: every decision is tested from C alone (tests/c/test_averaging_schedule.c,
 * tests/fuzz/fuzz_avgsched.c).
 *
 * Base averaging. With origin = warmup_steps when count_from_warmup (torch's
 * PeriodicModelAverager), else 0 (HierarchicalModelAverager, LocalSGD), and
 * k = t - origin + after_period, level l is due at step t >= warmup_steps when
 * k % periods[l] == 0. The highest level due wins (the widest group: torch's
 * hierarchical averager takes the largest period that divides the step).
 * after_period = 0 averages on the period's first step (torch: step 0 after
 * the warm-up already averages); 1 on its last (fairscale: after `period`
 * steps).
 *
 * Slow step. With slow_every > 0, due at step t >= warmup_steps when
 * k % slow_every == 0 (k as above). When slow_replaces_average, a base
 * average due at the same step is dropped (SlowMo's memory-efficient mode:
 * its sharded slow step averages the parameters as a side effect).
 *
 * Fragments (Streaming DiLoCo). With n_fragments F > 0, one fragment syncs
 * every fragment_every (= sync_every / F) steps, in turn 0, 1, .., F-1, 0, ..
 * counted from step 0: sync number j (j = 0, 1, ..) is applied after step
 * t = (j + 1) * fragment_every - 1 to fragment j % F, and its outer gradient
 * is sent fragment_delay steps earlier (after step t - fragment_delay; the
 * same step when the delay is 0, sent before it is applied). Fragments ignore
 * warmup_steps and the base periods. */
#ifndef MPIDP_AVERAGING_SCHEDULE_H
#define MPIDP_AVERAGING_SCHEDULE_H

#include <stdint.h>

/* Base averaging levels (torch's hierarchical averager nests a few groups). */
#define MPIDP_AVGSCHED_MAX_LEVELS 8

typedef struct {
    int64_t warmup_steps;      /* >= 0: no base average and no slow step before */
    int n_levels;              /* 0 .. MPIDP_AVGSCHED_MAX_LEVELS: base averaging levels */
    int64_t periods[MPIDP_AVGSCHED_MAX_LEVELS]; /* >= 1, strictly ascending */
    int count_from_warmup;     /* 0/1: periods count from warmup_steps, else from step 0 */
    int after_period;          /* 0/1: act on a period's first step (0) or its last (1) */
    int64_t slow_every;        /* >= 0; 0: no slow step */
    int slow_replaces_average; /* 0/1 */
    int64_t n_fragments;       /* >= 0; 0: no fragment syncs */
    int64_t fragment_every;    /* >= 1 when n_fragments > 0: steps between fragment syncs */
    int64_t fragment_delay;    /* 0 .. fragment_every - 1: steps between send and apply */
} mpidp_avgsched_config_t;

/* What to do after one optimizer step, in this order: send, average, slow
 * step, apply. */
typedef struct {
    int average;            /* 1: average the parameters over level `level`'s group */
    int level;              /* 0 .. n_levels - 1 when average, else -1 */
    int slow_step;          /* 1: the slow (outer momentum) step */
    int64_t send_fragment;  /* >= 0: send this fragment's outer gradient; -1: none */
    int64_t apply_fragment; /* >= 0: complete this fragment's sync and apply it; -1: none */
} mpidp_avgsched_actions_t;

/* MPIDP_OK, or MPIDP_EINVAL with a detail naming the first bad field, its
 * value and what was expected. */
int mpidp_avgsched_config_validate(const mpidp_avgsched_config_t *cfg);

/* The actions after step t (t >= 0). MPIDP_EINVAL (and *out "nothing to do")
 * for a bad config, a negative t or NULL arguments. Never overflows, for any
 * t up to INT64_MAX. */
int mpidp_avgsched_actions(const mpidp_avgsched_config_t *cfg, int64_t t,
                           mpidp_avgsched_actions_t *out);

#endif /* MPIDP_AVERAGING_SCHEDULE_H */
