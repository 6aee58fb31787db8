/* What mpidp._C offers the C++ "mpidp" backend (csrc/torch/c10d_backend.cpp,
 * the module mpidp._c10d, built against libtorch): a table of functions in
 * the capsule MPIDP_C10D_API_CAPSULE. The backend runs each collective on
 * the caller's thread -- posted and waited for inline, with no handoff to a
 * worker thread -- through the same core operations as _C.Comm's methods,
 * so the request table, the deadlines and fault-tolerant mode's
 * classification of errors are the core's, and a failure is raised as
 * mpidp's own exception (CommError, CommTimeout, RanksLost). */
#ifndef MPIDP_PY_C10D_API_H
#define MPIDP_PY_C10D_API_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "mpidp/tensor.h"

#define MPIDP_C10D_API_CAPSULE "mpidp._C._c10d_api"
/* Raised whenever the table or the meaning of an entry changes. */
#define MPIDP_C10D_API_VERSION 1

typedef struct {
    int version;
    /* GIL held. The communicator of a _C.Comm (an opaque pointer, valid while
     * the Comm lives: the caller keeps a reference), its rank and size; NULL
     * with a TypeError for anything else. */
    const void *(*comm_of)(PyObject *comm, int *rank, int *size);
    /* No GIL needed. Each runs one collective on `comm` to its end on the
     * caller's thread (deadline: timeout_s) and returns the core's status
     * (mpidp/status.h). *ended = 0 after a failure that left the operation
     * in flight: MPI may still write the tensors, so the caller must keep
     * them alive for good. Ops are mpidp/mpiops.h's; tensors as
     * mpidp/collectives.h and mpidp/allreduce.h require. */
    int (*allreduce)(const void *comm, const mpidp_tensor_t *t, int op, double timeout_s,
                     int *ended);
    int (*bcast)(const void *comm, const mpidp_tensor_t *t, int root, double timeout_s,
                 int *ended);
    /* Equal blocks: recv holds size * send->numel elements. */
    int (*allgather)(const void *comm, const mpidp_tensor_t *send, const mpidp_tensor_t *recv,
                     double timeout_s, int *ended);
    /* Equal blocks: send holds size * recv->numel elements. */
    int (*reduce_scatter)(const void *comm, const mpidp_tensor_t *send,
                          const mpidp_tensor_t *recv, int op, double timeout_s, int *ended);
    int (*barrier)(const void *comm, double timeout_s, int *ended);
    /* No GIL needed. *agreed: every rank passed the same n fields (mpidp/agree.h). */
    int (*agree)(const void *comm, const int64_t *sig, size_t n, double timeout_s, int *agreed);
    /* GIL held. Sets mpidp's exception for a failed status, naming `what`
     * (and, as every wait of mpidp, aborts the job on a deadline unless
     * MPIDP_ON_TIMEOUT=raise). */
    void (*raise)(int status, const char *what);
    /* No GIL needed. 1 in a process forked from an MPI rank: it must not communicate. */
    int (*forked)(void);
    /* GIL held: 0, or -1 with a RuntimeError naming `what`, in a fork. */
    int (*check_not_forked)(const char *what);
    /* The core's codes of the reductions (mpidp/mpiops.h, which needs mpi.h). */
    int op_sum, op_avg, op_min, op_max, op_prod;
} mpidp_c10d_api_t;

#endif /* MPIDP_PY_C10D_API_H */
