/* Background model averaging (Bagua's AsyncModelAverageAlgorithm): a thread
 * that, while training goes on, averages the model's weights over the ranks
 * every interval.
 *
 * One round, on the thread's own duplicate of the communicator:
 *   1. negotiate: an allreduce (min) of "carry on" -- a rank that asked to
 *      stop makes every rank's thread stop at the same round;
 *   2. under the weight lock, copy the weights to a snapshot s;
 *   3. S = the sum of every rank's s (an allreduce, the lock released: the
 *      training thread steps meanwhile);
 *   4. under the lock, x <- x + S/n - s: the average replaces the snapshot,
 *      and what the training thread changed since the snapshot is kept.
 * The sum of the ranks' weights is preserved by a round (up to rounding);
 * without training in between, a round gives every rank the mean.
 *
 * The training thread takes the same lock around what must not see weights
 * half-averaged (its forward to its optimizer's step); it never waits for
 * the thread otherwise. The thread posts on its own request table (the
 * process's table runs other engines' progress functions, which are not for
 * a second thread) and polls it gently (sleeping between tests: the thread
 * shares the cores with training). Every wait has a deadline; a round that
 * times out ends the thread with MPIDP_ETIMEDOUT and a detail naming the
 * round, and with `abort_on_timeout` the job (MPI_Abort, the detail on
 * stderr), since the rank that stalled cannot be waited for. Needs
 * MPI_THREAD_MULTIPLE: start refuses otherwise (MPIDP_ESTATE, saying so). */
#ifndef MPIDP_BGAVG_H
#define MPIDP_BGAVG_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

typedef struct mpidp_bgavg mpidp_bgavg_t;

typedef struct {
    float *const *segs;      /* the weights: n_segs float32 arrays, updated in place */
    const size_t *lens;      /* their lengths */
    size_t n_segs;
    double interval_s;       /* >= 0: pause between rounds */
    double timeout_s;        /* > 0: deadline of each MPI wait (<= 0: none) */
    int abort_on_timeout;    /* 1: a timed-out round aborts the job */
    const char *what;        /* for messages */
} mpidp_bgavg_opts_t;

/* Collective over `comm` (it duplicates it): checks the thread level,
 * allocates the snapshot and sum buffers and starts the thread.
 * MPIDP_ESTATE without MPI_THREAD_MULTIPLE, MPIDP_EINVAL, MPIDP_ENOMEM,
 * MPIDP_EMPI. */
int mpidp_bgavg_start(MPI_Comm comm, const mpidp_bgavg_opts_t *opts, mpidp_bgavg_t **out);
/* The weight lock (blocking; the thread holds it only to copy and update,
 * and a waiting thread goes first: training cannot starve the averaging). */
void mpidp_bgavg_lock(mpidp_bgavg_t *x);
void mpidp_bgavg_unlock(mpidp_bgavg_t *x);
/* Asks the thread to stop and joins it: every rank's thread stops at the
 * same round (the negotiation), so every rank calls this. Returns the
 * thread's status: MPIDP_OK, or the failure that ended it. */
int mpidp_bgavg_stop(mpidp_bgavg_t *x);
/* Without blocking: the rounds completed, and the thread's failure (or
 * MPIDP_OK while it runs or ended cleanly); the failure's detail is copied
 * into the calling thread's error detail. */
int64_t mpidp_bgavg_rounds(mpidp_bgavg_t *x);
int mpidp_bgavg_status(mpidp_bgavg_t *x);
/* Frees a stopped averager (MPIDP_ESTATE while its thread runs). After a
 * round that timed out, the buffers an MPI request may still write into are
 * left allocated (freeing them would let that request corrupt the heap). */
int mpidp_bgavg_free(mpidp_bgavg_t *x);

#endif /* MPIDP_BGAVG_H */
