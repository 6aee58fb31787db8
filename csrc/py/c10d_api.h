/* What mpidp._C offers the C++ "mpidp" backend (csrc/torch/c10d_backend.cpp,
 * the module mpidp._c10d, built against libtorch): a table of functions in
 * the capsule MPIDP_C10D_API_CAPSULE. The backend posts each collective on
 * the caller's thread -- and, for a blocking call, waits for it there, with
 * no handoff to a worker thread -- through the same core operations as _C.Comm's methods,
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
#define MPIDP_C10D_API_VERSION 4

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
/* A row of check_rows: the signature and two flags (mpidp/callcheck.h):
 * POSTED (0, or how the rank that posted the predicted call joined the
 * exchange; MPIDP_C10D_LATE: as part of its next call), then TOLD. */
#define MPIDP_C10D_ROW (MPIDP_C10D_SIG_FIELDS + 2)
#define MPIDP_C10D_POSTED MPIDP_C10D_SIG_FIELDS
#define MPIDP_C10D_LATE 2
/* progress's *differ. */
enum { MPIDP_C10D_DIFFER = 1, MPIDP_C10D_DIFFER_WRITTEN = 2 };
enum {
    MPIDP_C10D_CALL_ALLREDUCE = 1,
    MPIDP_C10D_CALL_BCAST,
    MPIDP_C10D_CALL_ALLGATHER,      /* the tensor: the input */
    MPIDP_C10D_CALL_REDUCE_SCATTER, /* the tensor: the input */
    MPIDP_C10D_CALL_BARRIER,
    MPIDP_C10D_CALL_OTHER = 100
};

/* A fast call in flight (start, then progress until it ends). */
typedef struct mpidp_c10d_pending mpidp_c10d_pending_t;

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
    /* No GIL needed. The ranks' check of the call whose signature is `sig`
     * (MPIDP_C10D_SIG_FIELDS int64; with a `check`, else none), then, for
     * a fast call (sig's call one of MPIDP_C10D_CALL_ALLREDUCE .. _BARRIER),
     * that collective posted on `comm`: *pending is the call in flight, for
     * `progress`. *pending is NULL where nothing was posted: for the check
     * alone (a call the Python group then makes), where the ranks differ
     * (*differ = 1; check_rows says how, and nothing of this rank's call is
     * in flight), and on failure (the core's status, mpidp/status.h;
     * nothing of the caller's tensors is in flight). `send`: the input of
     * an allgather or reduce-scatter; `recv`: their output, and the other
     * calls' one tensor. Ops are mpidp/mpiops.h's; tensors as
     * mpidp/collectives.h and mpidp/allreduce.h require (equal blocks: an
     * allgather's recv holds size x send's elements, a reduce-scatter's
     * send size x recv's). Calls on a group are one at a time, and a
     * started call must have ended (progress) before the group's next start (the
     * check resolves each call before the next). */
    int (*start)(const void *comm, void *check, const int64_t *sig, const mpidp_tensor_t *send,
                 const mpidp_tensor_t *recv, int op, int root, double timeout_s,
                 mpidp_c10d_pending_t **pending, int *differ);
    /* No GIL needed; one thread at a time per group. Progress on a started
     * call: block = 1 waits for its end (deadline timeout_s), block = 0
     * tests it once; late = 1 (with block): the caller ends it as part of
     * the group's next call (every rank's row then says so, see
     * MPIDP_C10D_LATE). *done = 1 once it ended, and `pending` is then gone:
     * the status is the call's; *differ where the ranks turned out to
     * differ (check_rows says how; the call completed on the others'
     * scratch buffers): MPIDP_C10D_DIFFER with the written tensor put back
     * as it was, MPIDP_C10D_DIFFER_WRITTEN where it was too large to copy
     * and holds the reduction over the ranks that made the call; *ended = 0
     * where a failure left it in flight: MPI may still write its tensors,
     * so the caller keeps them alive for good. *done = 0 (only with
     * block = 0): still in flight. */
    int (*progress)(mpidp_c10d_pending_t *pending, int block, int late, double timeout_s,
                    int *done, int *ended, int *differ);
    /* After *differ: every rank's row, by group rank (MPIDP_C10D_ROW fields
     * each, the signature first), valid until the group's next call. */
    const int64_t *(*check_rows)(const void *check);
    /* GIL held. Sets mpidp's exception for a failed status, naming `what`
     * (and, as every wait of mpidp, aborts the job on a deadline unless
     * MPIDP_ON_TIMEOUT=raise). */
    void (*raise)(int status, const char *what);
    /* No GIL needed. Records `detail` as this thread's failure detail, for
     * a failure the backend found itself, before `raise`. */
    void (*set_detail)(const char *detail);
    /* No GIL needed. 1 in a process forked from an MPI rank: it must not communicate. */
    int (*forked)(void);
    /* GIL held: 0, or -1 with a RuntimeError naming `what`, in a fork. */
    int (*check_not_forked)(const char *what);
    /* The core's codes of the reductions (mpidp/mpiops.h, which needs mpi.h). */
    int op_sum, op_avg, op_min, op_max, op_prod;
} mpidp_c10d_api_t;

#endif /* MPIDP_PY_C10D_API_H */
