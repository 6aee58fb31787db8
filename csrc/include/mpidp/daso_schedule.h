/* The DASO schedule: a pure, deterministic state machine.
 *
 * DASO (Distributed Asynchronous and Selective Optimisation) trains with two
 * levels of synchronisation: node-local gradient averaging (torch DDP on a
 * node-local process group) and global parameter averaging between nodes over
 * MPI, done only every few batches and completed a few batches after it was
 * posted. This module decides, per epoch and per batch, what the Python layer
 * must do; the Python layer carries the actions out. The schedule itself never
 * allocates, never does I/O and never calls MPI, so every decision can be
 * tested from C alone and replayed exactly.
 *
 * Vocabulary (Heat's names, kept so Heat scripts and logs read the same):
 *   global_skip (gs)      a global sync is posted on batches with batch % gs == 0
 *                         and on the epoch's last batch; gs == 0 means on every
 *                         batch, blocking.
 *   local_skip (ls)       node-local gradient sync runs every ls batches (plus
 *                         the batches listed under "local sync" below).
 *   batches_to_wait (btw) how many batches after being posted a global sync is
 *                         completed and merged; 0 means at once (blocking).
 *   group                 global syncs take turns over n_groups MPI groups;
 *                         group i holds local rank i of every node.
 *
 * Life cycle, per process, identical on every rank:
 *
 *     mpidp_schedule_init(&s, &cfg);
 *     for each epoch:
 *         for batch in 0..last_batch:
 *             forward, backward, local optimizer step
 *             mpidp_schedule_batch(&s, batch, last_batch, &act);  carry out act
 *         mpidp_schedule_epoch_end(&s, globally_averaged_loss);
 *
 * Phases. warmup: (gs, ls, btw) = (0, 0, 0), a blocking global sync after every
 * batch. cycling: 1 <= btw <= gs <= max_global_skips and 1 <= ls <= gs, tuned by
 * a loss-plateau detector. cooldown: (0, 0, 0) again for the last
 * cooldown_epochs epochs. See mpidp_schedule_epoch_end() for the exact rules.
 *
 * The whole state is one plain struct of int64_t and double fields with no
 * pointers (mpidp_schedule_t), so a checkpoint can store it field by field
 * (MPIDP_SCHEDULE_FIELDS lists them) and restore it exactly; after restoring,
 * mpidp_schedule_validate() says whether the result is internally consistent. */
#ifndef MPIDP_DASO_SCHEDULE_H
#define MPIDP_DASO_SCHEDULE_H

#include <stdint.h>

/* The plateau detector reports a plateau when the number of consecutive
 * non-improving epochs exceeds this (that is, on the third one), as Heat does. */
#define MPIDP_SCHEDULE_PATIENCE 2
/* The global_skip the cycling phase starts with (Heat fixes it at 4, whatever
 * max_global_skips is); mpidp clamps it to max_global_skips when that is lower. */
#define MPIDP_SCHEDULE_FIRST_GLOBAL_SKIP 4

/* The phase whose parameters are in force. Stored as int64_t in the state. */
typedef enum mpidp_schedule_phase {
    MPIDP_SCHEDULE_WARMUP = 0,
    MPIDP_SCHEDULE_CYCLING = 1,
    MPIDP_SCHEDULE_COOLDOWN = 2
} mpidp_schedule_phase_t;

/* Construction parameters; Heat's defaults are set by
 * mpidp_schedule_config_default(). Every field is checked by
 * mpidp_schedule_config_validate():
 *   total_epochs          > 0. Needed to place the cooldown phase.
 *   warmup_epochs         >= 0. 0 starts directly in the cycling phase.
 *   cooldown_epochs       >= 0. warmup_epochs + cooldown_epochs may exceed
 *                         total_epochs (Heat accepts it, and short test runs
 *                         with the default 4 + 4 rely on it): the phases then
 *                         overlap, there is no cycling phase and every batch
 *                         is a blocking sync.
 *   max_global_skips      >= 1. The global_skip a plateau at gs == 1 resets to.
 *   skip_reduction_factor >= 2. gs and ls are divided by it on a plateau; 1
 *                         would make that a no-op, so gs would never reach 1,
 *                         the cycle would never restart, and the detector would
 *                         have no effect: almost surely a mistake.
 *   local_skip_factor     >= 1. A reset sets ls = btw = max_global_skips / this
 *                         (at least 1).
 *   n_groups              >= 1. Number of global-sync groups, i.e. processes
 *                         per node.
 *   stability_level       in [0, 1). A loss improves when it is below the best
 *                         loss by more than this fraction of |best|. */
typedef struct mpidp_schedule_config {
    int64_t total_epochs;
    int64_t warmup_epochs;
    int64_t cooldown_epochs;
    int64_t max_global_skips;
    int64_t skip_reduction_factor;
    int64_t local_skip_factor;
    int64_t n_groups;
    double stability_level;
} mpidp_schedule_config_t;

/* The complete state. Fields are public so the Python layer can display and
 * checkpoint them; change them only by restoring a saved copy, then call
 * mpidp_schedule_validate(). Unused fields are kept at 0 so that equal states
 * compare equal byte for byte. */
typedef struct mpidp_schedule {
    mpidp_schedule_config_t cfg;

    /* Epoch level, changed only by init/reset and epoch_end. */
    int64_t phase;           /* an mpidp_schedule_phase_t */
    int64_t global_skip;     /* gs */
    int64_t local_skip;      /* ls */
    int64_t batches_to_wait; /* btw */
    int64_t epoch;           /* completed epochs: after 0-based epoch e it is e+1 */
    int64_t logic_epoch;     /* value of `epoch` at the last epoch_end, -1: none yet */

    /* The plateau detector (relative threshold, minimising). */
    int64_t has_best;  /* 1 once a finite loss has been seen */
    int64_t bad_epochs; /* consecutive non-improving epochs, 0..PATIENCE */
    double best_loss;  /* lowest loss that counted as improving; 0 without one */

    /* Batch level, changed only by batch (and init/reset). */
    int64_t next_batch; /* batch index expected next; 0 between epochs */
    int64_t last_batch; /* this epoch's last batch index; -1 between epochs */
    int64_t send_mod;   /* group of the next global sync, 0..n_groups-1 */
    int64_t local_sync; /* 1: node-local gradient sync on for the next backward */
    int64_t pending;    /* 1: one global sync has been posted and not completed */
    int64_t pending_group;   /* its group (0 when none) */
    int64_t pending_btw;     /* its batches_to_wait, >= 1 (0 when none) */
    int64_t pending_sent_at; /* batch it was posted on (0 when none); it is
                              * completed on batch pending_sent_at + pending_btw */
} mpidp_schedule_t;

/* Every field of mpidp_schedule_t as X(type, member), in declaration order, so
 * that the glue can save and restore the state without listing fields twice:
 *   #define F(type, member) { #member, offsetof(mpidp_schedule_t, member) },
 * The C tests check that the list covers the struct exactly. */
#define MPIDP_SCHEDULE_FIELDS(X)                                                \
    X(int64_t, cfg.total_epochs)                                                \
    X(int64_t, cfg.warmup_epochs)                                               \
    X(int64_t, cfg.cooldown_epochs)                                             \
    X(int64_t, cfg.max_global_skips)                                            \
    X(int64_t, cfg.skip_reduction_factor)                                       \
    X(int64_t, cfg.local_skip_factor)                                           \
    X(int64_t, cfg.n_groups)                                                    \
    X(double, cfg.stability_level)                                              \
    X(int64_t, phase)                                                           \
    X(int64_t, global_skip)                                                     \
    X(int64_t, local_skip)                                                      \
    X(int64_t, batches_to_wait)                                                 \
    X(int64_t, epoch)                                                           \
    X(int64_t, logic_epoch)                                                     \
    X(int64_t, has_best)                                                        \
    X(int64_t, bad_epochs)                                                      \
    X(double, best_loss)                                                        \
    X(int64_t, next_batch)                                                      \
    X(int64_t, last_batch)                                                      \
    X(int64_t, send_mod)                                                        \
    X(int64_t, local_sync)                                                      \
    X(int64_t, pending)                                                         \
    X(int64_t, pending_group)                                                   \
    X(int64_t, pending_btw)                                                     \
    X(int64_t, pending_sent_at)

/* What the caller must do for one optimizer step, in this order:
 *
 * 1. complete: wait for the pending global sync (posted on group
 *    complete_group, complete_btw batches ago) and merge it. Ranks in that
 *    group set p = (2*complete_btw * p + sum) / (n_nodes + 2*complete_btw);
 *    then every node broadcasts the merged parameters from its local rank
 *    complete_group. complete_btw is always >= 1 here.
 * 2. send: ranks in group send_group pack their parameters and post the global
 *    allreduce; send_btw travels with the request (it is the complete_btw of
 *    the later completion). Completing before sending means one send buffer is
 *    enough, and the new send already carries the merged parameters.
 * 3. send_blocking: the send just posted is completed at once (wait, then
 *    merge with weight 2*send_btw = 0, a plain average, then the node
 *    broadcast). Set exactly when send_btw == 0: on every epoch's last batch
 *    and on every batch of the warmup and cooldown phases.
 * 4. local_sync: set DDP's require_backward_grad_sync to this for the NEXT
 *    backward. It is always 1 before a global-sync batch and before the last
 *    batch, so the parameters sent are node-consistent.
 *
 * epoch_done is 1 on the epoch's last batch: everything is complete and the
 * epoch counter has advanced; call mpidp_schedule_epoch_end() next. */
typedef struct mpidp_schedule_actions {
    int complete;
    int64_t complete_group;
    int64_t complete_btw;
    int send;
    int64_t send_group;
    int64_t send_btw;
    int send_blocking;
    int local_sync;
    int epoch_done;
} mpidp_schedule_actions_t;

/* Fill *cfg with Heat's defaults: warmup 4, cooldown 4, stability 0.05,
 * max_global_skips 8, skip_reduction_factor 2, local_skip_factor 4, one group.
 * total_epochs is set to 0, which is invalid on purpose: the caller must choose
 * it. Does nothing when cfg is NULL. */
void mpidp_schedule_config_default(mpidp_schedule_config_t *cfg);

/* Check every field of *cfg against the ranges documented on
 * mpidp_schedule_config_t. Returns MPIDP_OK, or MPIDP_EINVAL with a detail
 * naming the first bad field, its value and what was expected. */
int mpidp_schedule_config_validate(const mpidp_schedule_config_t *cfg);

/* Start a schedule at epoch 0, batch 0, group 0, nothing pending, local sync
 * on. The phase is the one epoch 0 falls in: warmup (0, 0, 0) when
 * warmup_epochs > 0; otherwise cycling at (min(4, max_global_skips), 1, 1)
 * (Heat never leaves warmup when warmup_epochs is 0; mpidp does), or cooldown
 * when cooldown_epochs >= total_epochs. On failure (NULL arguments, invalid
 * config: MPIDP_EINVAL) *s is left unchanged. */
int mpidp_schedule_init(mpidp_schedule_t *s, const mpidp_schedule_config_t *cfg);

/* Heat's reset(): back to the state mpidp_schedule_init() gives for s->cfg
 * (epoch 0, fresh detector). A pending global sync is forgotten: its request
 * belongs to the caller, who must wait for or discard it. Returns MPIDP_EINVAL,
 * leaving *s unchanged, when s is NULL or s->cfg is invalid. */
int mpidp_schedule_reset(mpidp_schedule_t *s);

/* Adopt a new configuration between epochs (a job restarted from a
 * checkpoint with, say, more total_epochs): the phase of the next epoch is
 * recomputed for the new config (at the epoch counter of the last epoch_end,
 * as validate() judges it); a cycling phase that stays cycling keeps its
 * tuned (gs, ls, btw) and detector, clamped to the new max_global_skips; one
 * that starts cycling starts fresh at (min(4, max_global_skips), 1, 1); a
 * return to warmup clears the detector.
 * n_groups cannot change. MPIDP_ESTATE mid-epoch or with a sync pending,
 * MPIDP_EINVAL for an invalid config; *s is then unchanged. */
int mpidp_schedule_reconfigure(mpidp_schedule_t *s, const mpidp_schedule_config_t *cfg);

/* Check that *s is a state the schedule can be in: a valid config; phase,
 * (gs, ls, btw) and detector consistent with each other and with the epoch
 * counters; the batch position, send group, pending sync and local sync
 * consistent with the per-batch rules. Use it after restoring a checkpoint.
 * Returns MPIDP_OK, or MPIDP_EINVAL with a detail naming the inconsistency.
 * batch() and epoch_end() run the same check first and refuse a corrupted
 * state the same way. */
int mpidp_schedule_validate(const mpidp_schedule_t *s);

/* The end-of-epoch logic (Heat's epoch_loss_logic), called once after each
 * epoch's last batch with the loss averaged over all ranks. With c = s->epoch:
 *   c < warmup_epochs:                    warmup,   (0, 0, 0).
 *   c >= total_epochs - cooldown_epochs:  cooldown, (0, 0, 0).
 *   otherwise, first time in this range:  cycling at (min(4, max_global_skips),
 *                                         1, 1); the detector starts fresh and
 *                                         takes this loss as its first value.
 *   otherwise: feed the detector; on a plateau with gs > 1:
 *       gs = max(gs / skip_reduction_factor, 1), ls = max(ls / factor, 1),
 *       btw = min(max(btw - 1, 1), gs);
 *     on a plateau with gs == 1: gs = max_global_skips,
 *       ls = btw = max(max_global_skips / local_skip_factor, 1).
 * The detector counts a loss as improving when it is finite and below
 * best - |best| * stability_level (any finite loss improves on no best yet);
 * NaN and +-inf never improve and never become the best, so one bad epoch
 * cannot poison the detector. It reports a plateau on the third consecutive
 * non-improving loss, then counts again from zero, keeping the best.
 * Fails with MPIDP_ESTATE when called in the middle of an epoch (some batch of
 * it done, the last not yet) or twice for the same epoch counter, and with
 * MPIDP_EINVAL for a NULL or inconsistent state; *s is unchanged on failure. */
int mpidp_schedule_epoch_end(mpidp_schedule_t *s, double loss);

/* The per-batch logic (Heat's step()), called once per optimizer step, after
 * the local optimizer has stepped, with the 0-based batch index inside the
 * epoch and the epoch's last batch index (len(loader) - 1). Fills *out (see
 * mpidp_schedule_actions_t). With gmod = batch % gs (0 when gs == 0):
 *   - a global sync is posted when gmod == 0 or batch == last_batch, on group
 *     send_mod, which then advances (send_mod + 1) % n_groups; it carries
 *     btw' = min(btw, last_batch - batch), and is blocking when btw' == 0;
 *   - a pending sync is completed on exactly batch sent_at + btw' (<= the next
 *     global-sync batch and <= last_batch, so at most one is ever pending and
 *     the epoch's last batch leaves none);
 *   - local sync for the next batch n is on when n is a global-sync batch or
 *     the last one, when ls == 1, or while a sync is pending (Heat leaves it
 *     on through the wait); otherwise on exactly when n % ls == 0.
 * On the last batch the epoch counter advances and the batch position resets.
 * Errors, with *s unchanged and *out set to "no action, keep local sync":
 * MPIDP_EINVAL for NULL pointers, a negative batch or last_batch, or an
 * inconsistent state; MPIDP_ESTATE for a batch other than the expected one
 * (skipped or repeated; the first of an epoch must be 0), batch > last_batch,
 * a last_batch different from the one this epoch started with, or an epoch's
 * last batch when the epoch counter is INT64_MAX - 1 and cannot advance. */
int mpidp_schedule_batch(mpidp_schedule_t *s, int64_t batch, int64_t last_batch,
                         mpidp_schedule_actions_t *out);

/* "warmup", "cycling" or "cooldown" for the progress display; "unknown" for any
 * other value. */
const char *mpidp_schedule_phase_name(int64_t phase);

#endif /* MPIDP_DASO_SCHEDULE_H */
