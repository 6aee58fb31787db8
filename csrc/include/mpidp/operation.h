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

/* mpidp/allreduce.h's chunked allreduce and mpidp/peerx.h's peer exchange. */
extern const mpidp_operation_t mpidp_allreduce_operation, mpidp_peerx_operation;

#endif /* MPIDP_OPERATION_H */
