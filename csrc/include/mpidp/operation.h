/* The asynchronous operation of a core engine, seen through a table of its
 * functions, so that a handle (mpidp._C.Work) can test, wait for and free
 * any engine's operation without knowing which engine made it. An engine
 * with a non-blocking operation exports one table (below); a new engine adds
 * its own and needs no glue of its own for its handle.
 *
 * Every function takes the engine's object (mpidp_allreduce_t *, ...) as
 * `op` and behaves as the engine's own test / wait / free documents. */
#ifndef MPIDP_OPERATION_H
#define MPIDP_OPERATION_H

typedef struct {
    int (*test)(void *op, int *done);
    int (*wait)(void *op, double timeout_s);
    int (*free)(void *op);
} mpidp_operation_t;

/* mpidp/allreduce.h's chunked allreduce, mpidp/peer_exchange.h's peer exchange and
 * mpidp/collectives.h's other collectives. */
extern const mpidp_operation_t mpidp_allreduce_operation, mpidp_peerx_operation,
    mpidp_coll_operation;

/* Runs the posted operation `op` to its end: waits (deadline timeout_s, as
 * the engine's wait) and frees it. *ended = 1 when it was freed, so that the
 * caller may release the buffers it reads and writes. MPIDP_ETIMEDOUT: still
 * in flight, nothing freed (*ended = 0: keep its buffers alive). Otherwise
 * the wait's own failure, if it failed (with its detail), else the free's
 * (MPIDP_ESTATE with *ended = 0 if a part is somehow still in flight). */
int mpidp_operation_finish(const mpidp_operation_t *ops, void *op, double timeout_s, int *ended);

/* A handle's view of one posted operation (what mpidp._C.Work owns): it
 * remembers that the operation ended and the status it ended with, so that a
 * failure is reported by every later wait or test, never forgotten, and it
 * frees the operation as soon as it ended. */
typedef struct {
    const mpidp_operation_t *ops;
    void *op;       /* NULL once freed: its buffers may then go */
    int done;       /* it ended (completed or failed) */
    int status;     /* what it ended with */
} mpidp_handle_t;

void mpidp_handle_init(mpidp_handle_t *h, const mpidp_operation_t *ops, void *op);
/* Waits (deadline timeout_s). MPIDP_OK once the operation completed; the
 * status it failed with, on this and every later call; MPIDP_ETIMEDOUT:
 * still in flight, nothing changed. */
int mpidp_handle_wait(mpidp_handle_t *h, double timeout_s);
/* Progress without blocking: *done = 1 once it ended; the failure, the call
 * that finds it (later calls report *done = 1 and MPIDP_OK). */
int mpidp_handle_test(mpidp_handle_t *h, int *done);
/* The handle goes: an operation not yet freed is run to its end (deadline
 * timeout_s). Returns what that finishing returned (MPIDP_OK when nothing
 * was left); the operation is freed unless h->op stays non-NULL, in which
 * case its buffers must be leaked. */
int mpidp_handle_drop(mpidp_handle_t *h, double timeout_s);

#endif /* MPIDP_OPERATION_H */
