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

/* mpidp/allreduce.h's chunked allreduce, mpidp/peerx.h's peer exchange and
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

#endif /* MPIDP_OPERATION_H */
