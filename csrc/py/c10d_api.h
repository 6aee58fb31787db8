/* What mpidp._C offers the C++ "mpidp" backend (csrc/torch/c10d_backend.cpp,
 * the module mpidp._c10d, built against libtorch): a table of functions in
 * the capsule MPIDP_C10D_API_CAPSULE. The backend runs each collective on
 * the caller's thread -- posted and waited for inline, with no handoff to a
 * worker thread -- through the same core operations as _C.Comm's methods,
 * so the request table, the deadlines and fault-tolerant mode's
 * classification of errors are the core's, and a failure is raised as
 * mpidp's own exception (CommError, CommTimeout, RanksLost). The ranks'
 * check of each call is mpidp/callcheck.h's: free while the ranks repeat
 * calls they agreed on, an exchange otherwise. */
#ifndef MPIDP_PY_C10D_API_H
#define MPIDP_PY_C10D_API_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "mpidp/tensor.h"

#define MPIDP_C10D_API_CAPSULE "mpidp._C._c10d_api"
/* Raised whenever the table or the meaning of an entry changes. */
#define MPIDP_C10D_API_VERSION 2

/* A call's signature, which the ranks' check compares (mpidp/callcheck.h):
 * int64 fields at these places. The fast calls' codes are below; a call the
 * backend hands to its Python group is MPIDP_C10D_CALL_OTHER + its number,
 * with the other fields 0 (the Python group checks its tensors itself). */
enum {
    MPIDP_C10D_SIG_CALL,
    MPIDP_C10D_SIG_DTYPE,       /* the core's (mpidp/tensor.h), -1 for none */
    MPIDP_C10D_SIG_TORCH_DTYPE, /* torch's ScalarType, for the message */
    MPIDP_C10D_SIG_NDIM,
    MPIDP_C10D_SIG_DIMS,        /* the first MPIDP_C10D_SIG_NDIMS dimensions, -2 past the last */
    MPIDP_C10D_SIG_SHAPE = MPIDP_C10D_SIG_DIMS + 6, /* a hash of the whole shape */
    MPIDP_C10D_SIG_NUMEL,
    MPIDP_C10D_SIG_OP,          /* the core's op, -1 for none */
    MPIDP_C10D_SIG_ROOT,        /* -1 for none */
    MPIDP_C10D_SIG_PLACE,       /* torch's device type x 16 + layout */
    MPIDP_C10D_SIG_FIELDS
};
#define MPIDP_C10D_SIG_NDIMS 6
/* A row of check_rows: the signature and two flags (mpidp/callcheck.h). */
#define MPIDP_C10D_ROW (MPIDP_C10D_SIG_FIELDS + 2)
enum {
    MPIDP_C10D_CALL_ALLREDUCE = 1,
    MPIDP_C10D_CALL_BCAST,
    MPIDP_C10D_CALL_ALLGATHER,      /* the tensor: the input */
    MPIDP_C10D_CALL_REDUCE_SCATTER, /* the tensor: the input */
    MPIDP_C10D_CALL_BARRIER,
    MPIDP_C10D_CALL_OTHER = 100
};

typedef struct {
    int version;
    /* GIL held. The communicator of a _C.Comm (an opaque pointer, valid while
     * the Comm lives: the caller keeps a reference), its rank and size; NULL
     * with a TypeError for anything else. */
    const void *(*comm_of)(PyObject *comm, int *rank, int *size);
    /* No GIL needed. The ranks' check of a group's calls (mpidp/callcheck.h),
     * made collectively over `comm`, and its end (any thread, MPI alive or
     * finalized). */
    int (*check_new)(const void *comm, double timeout_s, void **check);
    void (*check_free)(void *check);
    /* No GIL needed. Each runs one collective on `comm` to its end on the
     * caller's thread (deadline: timeout_s) and returns the core's status
     * (mpidp/status.h). With a `check`, the ranks first check that they all
     * passed signature `sig` (MPIDP_C10D_SIG_FIELDS int64): where they did
     * not, *differ = 1, nothing of this rank's call is left in flight, and
     * check_rows says what each rank passed. *ended = 0 after a failure that
     * left the operation in flight: MPI may still write the tensors, so the
     * caller must keep them alive for good. Ops are mpidp/mpiops.h's;
     * tensors as mpidp/collectives.h and mpidp/allreduce.h require. */
    int (*allreduce)(const void *comm, void *check, const int64_t *sig, const mpidp_tensor_t *t,
                     int op, double timeout_s, int *ended, int *differ);
    int (*bcast)(const void *comm, void *check, const int64_t *sig, const mpidp_tensor_t *t,
                 int root, double timeout_s, int *ended, int *differ);
    /* Equal blocks: recv holds size * send->numel elements. */
    int (*allgather)(const void *comm, void *check, const int64_t *sig,
                     const mpidp_tensor_t *send, const mpidp_tensor_t *recv, double timeout_s,
                     int *ended, int *differ);
    /* Equal blocks: send holds size * recv->numel elements. */
    int (*reduce_scatter)(const void *comm, void *check, const int64_t *sig,
                          const mpidp_tensor_t *send, const mpidp_tensor_t *recv, int op,
                          double timeout_s, int *ended, int *differ);
    int (*barrier)(const void *comm, void *check, const int64_t *sig, double timeout_s,
                   int *ended, int *differ);
    /* No GIL needed. The check alone, for a call the Python group then makes. */
    int (*check_call)(const void *comm, void *check, const int64_t *sig, double timeout_s,
                      int *differ);
    /* After *differ: every rank's row, by group rank (MPIDP_C10D_ROW fields
     * each, the signature first), valid until the group's next call. */
    const int64_t *(*check_rows)(const void *check);
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
