/* Whether the ranks of a communicator make the same calls, at no cost while
 * they repeat a sequence of calls they have agreed on before.
 *
 * mpidp/agree.h costs one small allreduce per call; a training loop makes
 * the same calls in the same order every step, so each rank predicts its
 * next call's signature from the two before it (the predictions are the
 * same on every rank: they are learnt only from calls every rank agreed
 * on). A rank whose call is the prediction posts it at once and waits for
 * it as usual; a rank whose call is not (or that must exchange: see
 * begin's `exchange`) tells every other rank so with a small message on a
 * side communicator and then exchanges signatures with all of them. Every
 * rank that posted the prediction watches for that message while it
 * waits, and joins the exchange when it comes. The call it posted cannot
 * complete without the ranks that did not post it (every collective the
 * predictions serve -- allreduce, allgather, reduce-scatter, barrier --
 * needs every rank's part; a broadcast's root does not, so broadcasts
 * always exchange); once the exchange shows who posted what, those ranks
 * post a matching call on scratch buffers (the caller's job, see
 * mpidp_callcheck_rows) so that nothing is left in flight, and every rank
 * raises the same error.
 *
 * A call of a communicator's collectives through this check is one call
 * of begin, and for a predicted call one of wait (or polls until one
 * resolves it); calls must not overlap (one thread at a time: the caller's
 * lock), and a predicted call must be resolved before the next begins: a
 * rank is then at most one call ahead of another. */
#ifndef MPIDP_CALLCHECK_H
#define MPIDP_CALLCHECK_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#include "mpidp/operation.h"
#include "mpidp/reqtable.h"

#define MPIDP_CALLCHECK_MAX_FIELDS 16

/* A row of the exchange (mpidp_callcheck_rows): the rank's n fields, then
 * whether it had posted the predicted call (0, or how it joined: below),
 * then whether it told the others that it would exchange. */
#define MPIDP_CALLCHECK_POSTED(n) (n)
#define MPIDP_CALLCHECK_TOLD(n) ((n) + 1)
#define MPIDP_CALLCHECK_ROW(n) ((n) + 2)

/* A row's POSTED field where the rank posted the prediction: it joined the
 * exchange while waiting for that call (its program learns of the
 * difference at that call), or `late`, as part of its next call (the
 * caller says so: its program learns of it only there, a call later than
 * the ranks that exchanged at once). */
enum { MPIDP_CALLCHECK_POSTED_WAITING = 1, MPIDP_CALLCHECK_POSTED_LATE = 2 };

/* What a call's check found. */
enum {
    MPIDP_CALL_PREDICTED = 0, /* the prediction: post it, then mpidp_callcheck_wait */
    MPIDP_CALL_AGREED = 1,    /* exchanged: every rank passed the same; post it as usual */
    MPIDP_CALL_DIFFER = 2     /* the ranks differ: mpidp_callcheck_rows says how */
};

typedef struct mpidp_callcheck mpidp_callcheck_t;

/* For calls of n_fields (1 .. MPIDP_CALLCHECK_MAX_FIELDS) int64 on `comm`:
 * duplicates it (MPI_Comm_idup, waited for with the deadline) for its own
 * messages. Collective over comm. */
int mpidp_callcheck_create(MPI_Comm comm, size_t n_fields, mpidp_reqtable_t *reqs,
                           double timeout_s, mpidp_callcheck_t **out);

/* Frees it (nothing of MPI's once MPI has been finalized). */
void mpidp_callcheck_destroy(mpidp_callcheck_t *c);

/* The start of a call whose signature is sig (n_fields int64). exchange:
 * exchange even if sig is the prediction. *outcome: MPIDP_CALL_PREDICTED,
 * _AGREED or _DIFFER (the same on every rank, except that a rank sees
 * PREDICTED where another differs: its wait then says DIFFER). The
 * exchange's failures as the request table reports them (MPIDP_ETIMEDOUT,
 * MPIDP_EMPI, MPIDP_EDEPARTED, ...). */
int mpidp_callcheck_begin(mpidp_callcheck_t *c, const int64_t *sig, int exchange,
                          mpidp_reqtable_t *reqs, double timeout_s, int *outcome);

/* After begin said PREDICTED and the call was posted as `op` (an engine's
 * operation, `ops`): waits (deadline timeout_s) until it completes --
 * *outcome = PREDICTED: finish it as usual -- or until another rank says
 * it exchanges -- *outcome = DIFFER, the operation still in flight: the
 * others complete it on scratch buffers, so finish it as usual, then
 * raise. late: the caller waits as part of its next call (this rank's row
 * says MPIDP_CALLCHECK_POSTED_LATE). */
int mpidp_callcheck_wait(mpidp_callcheck_t *c, const mpidp_operation_t *ops, void *op,
                         mpidp_reqtable_t *reqs, double timeout_s, int late, int *outcome);

/* The same as wait, without blocking while nothing has happened: one test
 * of the operation and of the notifications. *resolved = 0: neither
 * happened, poll again (or wait); *resolved = 1: *outcome as wait's (a
 * notification's exchange blocks, under the deadline timeout_s). */
int mpidp_callcheck_poll(mpidp_callcheck_t *c, const mpidp_operation_t *ops, void *op,
                         mpidp_reqtable_t *reqs, double timeout_s, int *resolved, int *outcome);

/* After DIFFER: every rank's row (size rows of MPIDP_CALLCHECK_ROW(n)
 * int64, by rank), valid until the next call. */
const int64_t *mpidp_callcheck_rows(const mpidp_callcheck_t *c);

#endif /* MPIDP_CALLCHECK_H */
