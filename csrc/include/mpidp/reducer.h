/* The gradient reducer: bucket readiness, ordered posting, completion.
 *
 * One reducer serves one DataParallel model. Each bucket is one flat buffer
 * owned by the caller (a torch tensor) holding the bucket's gradient data
 * followed by one "had a gradient" flag per parameter, in the bucket's dtype.
 * The flags travel with the data in the same allreduce, so after completion a
 * flag > 0 means that some rank produced a gradient for that parameter; a
 * parameter no rank touched keeps `.grad = None`, as in a single process.
 *
 * A backward pass marks each parameter ready exactly once (from its gradient
 * hook, or at the end of backward for parameters that got no gradient). When
 * a bucket's last parameter is ready, the bucket is scaled by 1/size and its
 * allreduce is posted -- but strictly in bucket order: a ready bucket waits
 * until every lower-numbered bucket has been posted, so all ranks post the
 * same collectives in the same order whatever order their hooks fire in.
 *
 * Lifecycle per backward: mark_ready (each param) -> all posted -> wait
 * (per bucket or all) -> reset. Not thread-safe: calls must not overlap.
 * The glue's calls hold the GIL (waits may release it). The C++ gradient
 * hook (py/grad_hook_api.h, `arrived`) marks parameters WITHOUT the GIL, on
 * the thread running the backward, which runs its hooks one at a time;
 * every other call during a backward comes from that thread too (a Python
 * hook, or the end of backward), so marks never overlap another call.
 *
 * With `separate` set (non-blocking DataParallel), each bucket has its own
 * communication buffer: posting copies the bucket into it (scaled, or packed
 * to the wire dtype) and then zeroes the bucket, so whatever the user does to
 * the gradients while the collective is in flight cannot race with MPI. The
 * result stays in the communication buffer until the caller delivers it into
 * each parameter's slice with mpidp_reducer_deliver().
 *
 * With `staged` set (gradients that live elsewhere, e.g. GPU memory, reduced
 * through these host buffers), the reducer does not read a full bucket until
 * the caller says it has copied the gradients in: after marking parameters,
 * the caller asks mpidp_reducer_next_to_stage() for a full bucket, copies it
 * into the host buffer and calls mpidp_reducer_staged(), which posts whatever
 * the order allows. After a bucket completes (not in separate mode),
 * mpidp_reducer_needs_unstaging() says its result must be copied back;
 * mpidp_reducer_unstaged() records that it was. The core calls nothing back:
 * it says what needs doing, and the caller decides how and when (on a GPU the
 * copies run asynchronously). In staged mode the core never writes a
 * bucket's gradient elements before it is staged (a parameter without a
 * gradient is zeroed by the caller where the gradients live), so a copy back
 * from the previous pass may still be reading them. */
#ifndef MPIDP_REDUCER_H
#define MPIDP_REDUCER_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#include "mpidp/bucket.h"
#include "mpidp/reqtable.h"
#include "mpidp/tensor.h"

typedef struct mpidp_reducer mpidp_reducer_t;

typedef struct {
    MPI_Comm comm;                       /* the communicator to reduce on */
    mpidp_reqtable_t *reqs;              /* where posted requests are registered */
    size_t n_params;
    const size_t *param_numel;           /* n_params: elements of each parameter */
    const int *param_dtype;              /* n_params: mpidp_dtype_t of each */
    size_t first_cap, cap;               /* bucket caps in bytes (mpidp_bucket_plan) */
    /* The caller's buckets, laid out as mpidp_bucket_plan plans them for the
     * parameters and caps above: bucket b is a writable host tensor of the
     * bucket's dtype and numel + n_params elements (checked). */
    size_t n_buckets;
    const mpidp_tensor_t *bucket_tensors;
    int wire_dtype;                      /* -1: each bucket's own dtype */
    int separate;                        /* 1: separate communication buffers (see above) */
    const char *name;                    /* used in messages, e.g. "DataParallel" */
    int staged;                          /* 1: the caller stages buckets (see above) */
    /* 1 (implies staged; no wire compression, not hierarchical): the caller
     * reduces each bucket's gradients where they live (a device collective,
     * mpidp/devcomm.h), scaled by 1/divisor there, before it calls
     * mpidp_reducer_staged(); posting then sums only the bucket's flags
     * (host), in place. In separate mode the caller keeps the communication
     * buffers too, and deliveries are recorded for it to make
     * (mpidp_reducer_device_deliveries) instead of made here. */
    int device;
    /* Hierarchical mode (1): each bucket is summed within the node first
     * (reduce-scatter on hier_node_scatter), each local rank's slice across
     * the nodes (allreduce on hier_cross: the ranks with its local rank),
     * then gathered within the node (allgatherv on hier_node_gather, a
     * second communicator of the same node so the phases' collectives never
     * interleave): every local rank carries 1/L of the bytes between
     * nodes. `comm` stays the whole group (the mean divides by its size). */
    int hierarchical;
    MPI_Comm hier_node_scatter, hier_cross, hier_node_gather;
    double drain_timeout_s;              /* wire uint8: when a bucket's quantized allreduce
                                          * cannot start, what it posted is waited for this
                                          * long (<= 0: no limit) */
} mpidp_reducer_config_t;

typedef enum {
    MPIDP_DELIVER_COPY = 0,  /* slice = averaged gradient */
    MPIDP_DELIVER_ADD = 1,   /* slice += averaged gradient */
} mpidp_deliver_mode_t;

typedef enum {
    MPIDP_BUCKET_COLLECTING = 0,  /* waiting for parameters */
    MPIDP_BUCKET_POSTED = 1,      /* allreduce in flight */
    MPIDP_BUCKET_DONE = 2,        /* averaged result in the buffer */
} mpidp_bucket_state_t;

/* Creates a reducer: plans the bucket layout (mpidp_bucket_plan) and checks
 * the caller's bucket tensors against it; keeps their data pointers, not the
 * tensors (whose memory must outlive the reducer). Fails with MPIDP_EINVAL
 * for buckets that do not match the plan (naming the bucket and what it
 * expected) or MPIDP_EDTYPE for a dtype/wire combination the core cannot
 * reduce. */
int mpidp_reducer_create(const mpidp_reducer_config_t *cfg, mpidp_reducer_t **out);

/* Frees the reducer. Refuses (MPIDP_ESTATE) while a bucket is in flight. */
int mpidp_reducer_destroy(mpidp_reducer_t *r);

/* Ends the reducer as a dropped owner must: lands a pass whose buckets are
 * all posted (deadline `timeout_s`; no wait once MPI is finalized), then
 * frees it. MPIDP_OK: freed, and no request writes into the bucket tensors
 * any more. Otherwise (a half-posted pass: backward raised; or a bucket that
 * did not land) nothing is freed, and while MPI runs the bucket tensors must
 * stay allocated: leak them rather than let MPI write into freed memory. */
int mpidp_reducer_close(mpidp_reducer_t *r, double timeout_s);

/* Marks parameter `param` ready for this backward pass. `has_grad` = 0 means
 * this rank has no gradient for it: its slice is zeroed so that it adds
 * nothing. Posts every bucket that became postable. MPIDP_ESTATE if the
 * parameter was already marked since the last reset (its bucket may be in
 * flight: a second gradient in one pass cannot be reduced). */
int mpidp_reducer_mark_ready(mpidp_reducer_t *r, size_t param, int has_grad);

/* Staged mode: the lowest bucket numbered `from` or more that is full (every
 * parameter marked) and still waits for the caller to say it is staged.
 * Returns 1 and sets *b, or 0 when there is none (and always outside staged
 * mode). */
int mpidp_reducer_next_to_stage(const mpidp_reducer_t *r, size_t from, size_t *b);
/* Staged mode: bucket b's gradients are in its host buffer now; posts every
 * bucket the order allows. MPIDP_ESTATE if b is not full or already staged. */
int mpidp_reducer_staged(mpidp_reducer_t *r, size_t b);
/* Staged mode, not separate: 1 when bucket b has completed and its result has
 * not been copied back yet (mpidp_reducer_unstaged records that it was). */
int mpidp_reducer_needs_unstaging(const mpidp_reducer_t *r, size_t b);
int mpidp_reducer_unstaged(mpidp_reducer_t *r, size_t b);

/* Device mode: the deliveries the pass calls recorded for bucket b since the
 * last call, one per member parameter in index order: 0 none,
 * 1 + MPIDP_DELIVER_COPY or 1 + MPIDP_DELIVER_ADD (the parameter's slice of the
 * caller's communication buffer into, or onto, its slice of the bucket);
 * cleared by the call. */
int mpidp_reducer_device_deliveries(mpidp_reducer_t *r, size_t b, uint8_t *modes);

/* The number of ranks gradients are averaged over in this pass (join changes it). */
int mpidp_reducer_divisor(const mpidp_reducer_t *r);

/* 1 if `param` was marked since the last reset. */
int mpidp_reducer_is_ready(const mpidp_reducer_t *r, size_t param);
/* Number of parameters marked since the last reset. */
size_t mpidp_reducer_n_ready(const mpidp_reducer_t *r);
/* The state of bucket `b`; the bucket of a parameter. */
mpidp_bucket_state_t mpidp_reducer_bucket_state(const mpidp_reducer_t *r, size_t b);
size_t mpidp_reducer_bucket_of(const mpidp_reducer_t *r, size_t param);

/* Waits (deadline `timeout_s`, <= 0 none) for bucket `b` to complete and
 * leaves the averaged gradients in its buffer. A bucket already DONE returns
 * at once; one still COLLECTING is MPIDP_ESTATE. */
int mpidp_reducer_wait_bucket(mpidp_reducer_t *r, size_t b, double timeout_s);
/* Waits for every bucket; all must have been posted (else MPIDP_ESTATE). */
int mpidp_reducer_wait_all(mpidp_reducer_t *r, double timeout_s);

/* After the parameter's bucket is DONE: *used = 1 if any rank had a gradient
 * for it in this pass. */
int mpidp_reducer_used_globally(const mpidp_reducer_t *r, size_t param, int *used);

/* Separate mode, after the parameter's bucket is DONE: writes (COPY) or adds
 * (ADD) the averaged gradient into the parameter's slice of its bucket.
 * MPIDP_ESTATE if the bucket has not completed or the reducer is not in
 * separate mode. */
int mpidp_reducer_deliver(mpidp_reducer_t *r, size_t param, int mode);

/* Elements and first element of the parameter's slice in its bucket. */
void *mpidp_reducer_slice(const mpidp_reducer_t *r, size_t param, size_t *numel);

/* Gradients are averaged over `n` ranks from the next bucket posted on
 * (default: the communicator's size). Uneven inputs (DataParallel.join) use
 * the number of ranks still training: the others contribute zeros. */
int mpidp_reducer_set_divisor(mpidp_reducer_t *r, int n);

/* Starts a new pass: every bucket must be DONE, or no parameter marked at all.
 * MPIDP_ESTATE otherwise (with what is still missing in the detail). */
int mpidp_reducer_reset(mpidp_reducer_t *r);

/* The parameters of bucket b, in index order: returns how many and points
 * *params at them (owned by the reducer); 0 for an unknown bucket. */
size_t mpidp_reducer_bucket_params(const mpidp_reducer_t *r, size_t b, const size_t **params);
/* Every parameter, bucket by bucket (bucket 0's, then bucket 1's, ...): the
 * order of mpidp_reducer_end_blocking's actions. Owned by the reducer. */
const size_t *mpidp_reducer_members(const mpidp_reducer_t *r);

/* --- the pass: what each parameter's `.grad` must become ------------------
 * The caller (the glue) reads and writes `.grad`; the reducer decides. Each
 * call takes what the caller saw of the `.grad`s (mpidp_grad_seen_t) and
 * returns what to do with them (mpidp_grad_action_t), one entry per
 * parameter of the bucket in mpidp_reducer_bucket_params order (or, for
 * prepare, per parameter). The caller applies the actions in order, right
 * away. The reducer keeps everything it needs between calls: which `.grad`s
 * were None before backward, which this rank contributed, each bucket's
 * version counter at the end of backward, what must happen after a deferred
 * step. mpidp_reducer_reset forgets it.
 *
 * Blocking mode:     prepare -> grad_arrived / mark_unhooked -> finalize ->
 *                    wait_bucket + missing_grads (each bucket) -> reset;
 *                    end_blocking does the part after mark_unhooked in one call
 * Non-blocking mode: ... finalize -> either (a step is due)
 *                    deliver_for_step + after_step (each bucket; the last one
 *                    resets), or (no step due) accumulate (each bucket) -> reset */

typedef enum {
    MPIDP_SEEN_VIEW = 0,   /* `.grad` is the parameter's bucket view */
    MPIDP_SEEN_NONE = 1,   /* `.grad` is None */
    MPIDP_SEEN_OTHER = 2,  /* `.grad` is some other tensor (the user replaced it) */
} mpidp_grad_seen_t;

typedef enum {
    MPIDP_GRAD_KEEP = 0,       /* leave `.grad` alone */
    MPIDP_GRAD_SET_VIEW = 1,   /* `.grad` = the bucket view */
    MPIDP_GRAD_SET_NONE = 2,   /* `.grad` = None */
    MPIDP_GRAD_ZERO_VIEW = 3,  /* zero the view, then `.grad` = the view */
    MPIDP_GRAD_ADOPT = 4,      /* copy `.grad` (detached) into the view, `.grad` = the view */
    MPIDP_GRAD_ZERO_ONLY = 5,  /* zero the view where the gradients live (staged
                                * mode: the core does not write them), `.grad` kept */
} mpidp_grad_action_t;

/* Before backward: where `.grad` is None, zero the view and point `.grad`
 * at it so autograd accumulates into the bucket (remembered: that zero is no
 * gradient). seen/act have n_params entries. While a pass is open, nothing
 * changes (all KEEP). */
int mpidp_reducer_prepare(mpidp_reducer_t *r, const uint8_t *seen, uint8_t *act);

/* Whether the next gradient hook opens a backward: not paused and none open
 * yet. The caller then completes a pass still open and arranges to be told
 * when this backward ends (mark_unhooked, finalize) before grad_arrived. */
int mpidp_reducer_opens_backward(const mpidp_reducer_t *r);

/* From a gradient hook, after the caller adopted a foreign `.grad` (seen
 * OTHER: ADOPT): parameter i's gradient arrived; has = `.grad` is not None.
 * Marks it ready (and may post buckets), opening the backward (which the
 * next finalize closes). While paused (no_sync, DDP's gradient accumulation)
 * nothing is marked or posted: the view now holds a gradient, so the next
 * pass counts it even if no hook of that pass fires for i. */
int mpidp_reducer_grad_arrived(mpidp_reducer_t *r, size_t i, int has);
/* What a gradient hook does: grad_arrived, then, unless paused, one
 * mpidp_reqtable_progress of the reducer's table when at least
 * `progress_every_s` seconds passed since the last one a hook drove (Open
 * MPI advances non-blocking collectives only inside MPI calls, so buckets
 * posted earlier progress during backward); progress_every_s < 0: never.
 * The glue's Python-level and C++ hooks both call this, with
 * MPIDP_HOOK_PROGRESS_EVERY_S. */
int mpidp_reducer_grad_hooked(mpidp_reducer_t *r, size_t i, int has, double progress_every_s);
/* How often hooks drive MPI progress: a transfer moves on the scale of
 * microseconds, while a progress call (a lock and an MPI_Test per request
 * in flight, ~0.1 us) on every hook cost more than the rest of the hook
 * when many small parameters' gradients arrive a few hundred nanoseconds
 * apart. */
#define MPIDP_HOOK_PROGRESS_EVERY_S 10e-6

/* no_sync: pause (on = 1) or resume the communication of gradients.
 * Pausing while a pass is open (some parameter marked) is MPIDP_ESTATE. */
int mpidp_reducer_set_paused(mpidp_reducer_t *r, int on);
int mpidp_reducer_paused(const mpidp_reducer_t *r);
/* A paused backward held gradients that no pass has reduced yet (cleared
 * when the next communicating backward opens). */
int mpidp_reducer_held(const mpidp_reducer_t *r);

/* End of backward, for each parameter not marked yet: the action to apply
 * first (KEEP, ADOPT or ZERO_ONLY), then mark_unhooked marks it with the
 * contribution that follows from `seen` (its view holds a real gradient
 * unless prepare put the zeros there; None contributes nothing). */
mpidp_grad_action_t mpidp_reducer_unhooked_action(const mpidp_reducer_t *r, size_t i, int seen);
int mpidp_reducer_mark_unhooked(mpidp_reducer_t *r, size_t i, int seen);

/* Every parameter is marked: the pass is finalized. versions: separate mode,
 * the version counter of each bucket's gradient tensor now (NULL otherwise),
 * so that later changes tell the user cleared gradients in place. */
int mpidp_reducer_finalize(mpidp_reducer_t *r, const long long *versions);
int mpidp_reducer_finalized(const mpidp_reducer_t *r);

/* Blocking mode, bucket b DONE: parameters this rank had no gradient for get
 * what a single process would see: the mean if some rank had a gradient
 * (SET_VIEW), else None (SET_NONE); others KEEP. Each is fixed once. */
int mpidp_reducer_missing_grads(mpidp_reducer_t *r, size_t b, uint8_t *act);

/* Blocking mode, every parameter marked: the rest of the pass in one call --
 * finalize, then each bucket's wait (deadline timeout_s each) and
 * missing_grads, then reset. act gets every parameter's action in
 * mpidp_reducer_members order (n_params entries), to apply after the call:
 * these decisions read no `.grad`, so the caller needs nothing in between
 * and can wait without its interpreter's lock. On failure the pass stays
 * as the failing step left it. */
int mpidp_reducer_end_blocking(mpidp_reducer_t *r, double timeout_s, uint8_t *act);

/* Separate mode, no step due (a second backward, or a forward without a
 * step), bucket b DONE: adds the mean into the bucket where the user kept the
 * gradients (delivered here), act KEEP or SET_NONE. version: the bucket's
 * version counter now; accumulated: a parameter whose new gradient autograd
 * already added to its view (a second backward began), else -1. MPIDP_ESTATE
 * once a step has begun delivering. */
int mpidp_reducer_accumulate(mpidp_reducer_t *r, size_t b, long long version, long accumulated,
                             const uint8_t *seen, uint8_t *act);

/* Separate mode, a step is due: delivers bucket b's mean into its
 * parameters' slices for the optimizer (act SET_VIEW, or SET_NONE where no
 * rank had a gradient) and decides what each `.grad` becomes after the step.
 * A `.grad` replaced since backward (seen OTHER) is MPIDP_ESTATE, with the
 * parameter in the detail. A bucket already delivered: all KEEP. */
int mpidp_reducer_deliver_for_step(mpidp_reducer_t *r, size_t b, long long version,
                                   const uint8_t *seen, uint8_t *act);
int mpidp_reducer_delivered(const mpidp_reducer_t *r, size_t b);

/* Separate mode, between backward and the step, when the caller wants the
 * averaged gradients in `.grad` now (clipping, AMP's unscale_: Horovod's
 * optimizer.synchronize()): delivers bucket b's mean into its slices, act
 * SET_VIEW, or SET_NONE where no rank had a gradient and `.grad` was None
 * before backward (KEEP where it is None now). The step that follows is then
 * an ordinary one: once every bucket is delivered this way the caller resets
 * the pass. `.grad` edited in place since backward (version moved: it held
 * zeros then, so the edit is lost) or replaced is MPIDP_ESTATE naming the
 * parameter. */
int mpidp_reducer_deliver_now(mpidp_reducer_t *r, size_t b, long long version, const uint8_t *seen,
                              uint8_t *act);
/* Separate mode, after finalize: 1 when bucket b's version counter is no
 * longer the one recorded at finalize (something changed the gradients in
 * place since backward). */
int mpidp_reducer_version_moved(const mpidp_reducer_t *r, size_t b, long long version);

/* Separate mode, after the optimizer stepped bucket b: `.grad` back as the
 * user left it (SET_NONE, ZERO_VIEW or SET_VIEW; KEEP when already done).
 * MPIDP_ESTATE if b was not delivered. *pass_over = 1 when this was the last
 * bucket: the caller then resets. */
int mpidp_reducer_after_step(mpidp_reducer_t *r, size_t b, uint8_t *act, int *pass_over);
/* 1 when after_step has handed out bucket b's actions in the open pass. */
int mpidp_reducer_stepped(const mpidp_reducer_t *r, size_t b);

/* join: this rank has run out of data but the others have not: marks every
 * parameter with no contribution, so that this rank posts every bucket (in
 * order, zeros with "no gradient" flags) like the others. MPIDP_ESTATE while
 * a pass is open. The caller then waits and resets; `.grad` is not touched. */
int mpidp_reducer_contribute_nothing(mpidp_reducer_t *r);

/* The pure decisions behind accumulate and after_step, exposed for tests. */
typedef enum {
    MPIDP_ACCUM_DROP = 0,           /* leave `.grad` as the user made it */
    MPIDP_ACCUM_ADD = 1,            /* add the mean into the bucket view */
    MPIDP_ACCUM_ADD_THEN_NONE = 2,  /* add (zeros), then `.grad = None` */
} mpidp_accum_action_t;
/* A second backward (or a forward with no step due) completes the pass
 * before the step: the averaged gradient is added into the bucket, or
 * dropped when the user cleared or replaced the gradients since backward; a
 * parameter no rank had a gradient for, whose `.grad` was None before
 * backward, goes back to None (unless a new gradient has already arrived). */
mpidp_accum_action_t mpidp_reducer_accumulate_action(int grad_is_view, int cleared, int used,
                                                     int was_none, int new_grad_arrived);

typedef enum {
    MPIDP_AFTER_VIEW = 0,       /* `.grad` = the bucket view (mean, or kept zeros) */
    MPIDP_AFTER_ZEROED = 1,     /* zero the view, `.grad` = the view */
    MPIDP_AFTER_NONE = 2,       /* `.grad` = None */
} mpidp_after_step_t;
/* After the deferred step, `.grad` is given back as the user left it before
 * the step: None if it was None then; zeros if they zeroed it in place since
 * backward; else the averaged gradient (the bucket view) -- or None where no
 * rank had a gradient and `.grad` was None before backward. */
mpidp_after_step_t mpidp_reducer_after_step_action(int none_at_step, int cleared, int used,
                                                   int was_none);

#endif /* MPIDP_REDUCER_H */
