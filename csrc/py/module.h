/* Shared declarations of the CPython glue (csrc/py): module state, the error
 * translator, DLPack borrowing and the per-type entry points. */
#ifndef MPIDP_PY_MODULE_H
#define MPIDP_PY_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>

#include "mpidp/operation.h"
#include "mpidp/reqtable.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"

/* The module state's Python objects, listed once for the GC's traverse and clear:
 * the types the glue creates objects of, the struct sequences of Schedule.batch
 * and avgsched_actions, mpidp.CommError(RuntimeError), mpidp.CommTimeout(CommError),
 * mpidp.RanksLost(CommError). */
#define MPIDP_PY_STATE_OBJECTS(X)                                               \
    X(PyTypeObject, comm_type) X(PyTypeObject, work_type) X(PyTypeObject, reducer_type) \
    X(PyTypeObject, schedule_actions_type) X(PyTypeObject, avgsched_actions_type) \
    X(PyObject, comm_error) X(PyObject, comm_timeout) X(PyObject, ranks_lost)

/* An object of one of these types keeps the module, and so this state and
 * its request table, alive through its type: every instance holds its heap
 * type, and the type its module (PyType_FromModuleAndSpec). */
typedef struct {
#define MPIDP_PY_STATE_FIELD(type, name) type *name;
    MPIDP_PY_STATE_OBJECTS(MPIDP_PY_STATE_FIELD)
#undef MPIDP_PY_STATE_FIELD
    mpidp_reqtable_t *reqs;    /* every request mpidp has in flight */
    int thread_level;          /* MPI_Query_thread at import */
} mpidp_py_state;

/* Process-wide settings (one MPI per process, so one value). */
extern double mpidp_py_timeout_s;   /* deadline of every wait; <= 0: none */
extern int mpidp_py_abort_on_timeout;
extern int mpidp_py_hook_progress;  /* gradient hooks call MPI_Test on what is in flight */
extern int mpidp_py_forked;         /* this process is a fork() of an MPI rank */
extern int mpidp_py_timed_out;      /* a wait raised CommTimeout: some rank is stuck */

/* 0, or -1 with a RuntimeError naming `what` when this process was forked
 * from an MPI rank: MPI state is not fork-safe, and a child's collective
 * would mismatch or hang its parent's job. Checked where communication
 * starts (collectives, the gradient hook, a DASO sync, a new Comm). */
int mpidp_py_check_not_forked(const char *what);

/* Warns once per process (RuntimeWarning) when the engines counted values
 * that overflowed float16 on the wire (mpidp/convert.h). 0, or -1 when the
 * warning was turned into an exception. */
int mpidp_py_warn_fp16_overflow(void);

mpidp_py_state *mpidp_py_state_of_module(PyObject *module);
mpidp_py_state *mpidp_py_state_of_type(PyTypeObject *type);
/* The module of one of its types or of a Python subclass of one (borrowed). */
PyObject *mpidp_py_module_of_type(PyTypeObject *type);

/* Sets a Python exception for core status `status` (< 0) and returns NULL.
 * `what` names the operation ("allreduce", "DataParallel backward"); the core's
 * error detail is appended. Bad arguments become ValueError/TypeError, MPI
 * failures mpidp.CommError, deadlines mpidp.CommTimeout -- which, unless
 * MPIDP_ON_TIMEOUT=raise, first prints the message and aborts the job so that
 * no other rank is left waiting. */
PyObject *mpidp_py_raise(mpidp_py_state *st, int status, const char *what);
/* 0 for MPIDP_OK, else -1 with mpidp_py_raise's exception. */
int mpidp_py_check(mpidp_py_state *st, int status, const char *what);
/* A core call with a fresh error detail: MPIDP_PY_CALL(st, "what", mpidp_x(...)) < 0 on failure. */
#define MPIDP_PY_CALL(st, what, call) (mpidp_error_clear(), mpidp_py_check((st), (call), (what)))

/* None for a glue status >= 0, NULL (the exception is set) for -1. */
static inline PyObject *mpidp_py_none_or_null(int rc)
{
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* Runs `call` (an expression of type int) with the GIL released when MPI
 * allows other threads to call it concurrently, so that waiting on a peer does
 * not block the process's other Python threads. */
#define MPIDP_PY_WAIT(st, rc, call)                                             \
    do {                                                                        \
        if ((st)->thread_level == MPI_THREAD_MULTIPLE) {                        \
            Py_BEGIN_ALLOW_THREADS (rc) = (call);                               \
            Py_END_ALLOW_THREADS                                                \
        } else {                                                                \
            (rc) = (call);                                                      \
        }                                                                       \
    } while (0)

/* A tensor borrowed through DLPack: the capsule keeps the producer's memory
 * alive for as long as we hold it; releasing it lets the producer free it. */
typedef struct {
    PyObject *capsule;
    mpidp_tensor_t t;
} mpidp_py_borrowed_t;

/* Borrows `obj` via obj.__dlpack__(); `requirements` as in mpidp/tensor.h.
 * Returns 0, or -1 with a Python exception naming `argname`. */
int mpidp_py_borrow(mpidp_py_state *st, PyObject *obj, unsigned requirements,
                    const char *argname, mpidp_py_borrowed_t *out);
void mpidp_py_release(mpidp_py_borrowed_t *b);
/* Borrows every tensor of the tuple `tuple` into out[0..len) (errors name
 * `what[i]`); dtype >= 0: each must have that mpidp_dtype_t. 0, or -1 with
 * an exception and nothing left borrowed. */
int mpidp_py_borrow_all(mpidp_py_state *st, PyObject *tuple, unsigned requirements, int dtype,
                        const char *what, mpidp_py_borrowed_t *out);
void mpidp_py_release_all(mpidp_py_borrowed_t *b, size_t n);

/* A tuple of float32 CPU tensors (an engine's parameters, or gradients)
 * borrowed writable, with the pointer and length arrays the core takes. */
typedef struct {
    PyObject *tuple;             /* kept alive */
    mpidp_py_borrowed_t *b;
    float **data;
    size_t *numel;
    size_t n;
} mpidp_py_f32s_t;
/* 0, or -1 with an exception naming `what[i]` and nothing held. */
int mpidp_py_f32s_borrow(mpidp_py_state *st, PyObject *tuple, const char *what, mpidp_py_f32s_t *out);
void mpidp_py_f32s_release(mpidp_py_f32s_t *f);

/* mpidp._C.Comm: a duplicate of the user's communicator with
 * MPI_ERRORS_RETURN, so MPI failures come back as status codes. */
typedef struct {
    PyObject_HEAD
    MPI_Comm comm;
    int rank;
    int size;
} mpidp_py_comm_t;

/* The Comm behind `obj`, or NULL with a TypeError naming `argname`. */
mpidp_py_comm_t *mpidp_py_as_comm(mpidp_py_state *st, PyObject *obj, const char *argname);

/* Collective methods of Comm (csrc/py/collectives.c). */
/* Shared by the Comm methods' files (collectives.c, rooted_alltoall_p2p.c): the
 * module state for a Comm method called with `nargs` positional arguments
 * (min..max, no keywords) in a process that may communicate; the trailing
 * async_op argument at `at` (0, 1, or -1 with an exception); what a started
 * operation becomes (a Work with async_op, else run to its end here, GIL
 * released); a counts tuple of one int >= 0 per rank (PyMem; NULL with an
 * exception). */
mpidp_py_state *mpidp_py_coll_begin(PyObject *self, const char *usage, Py_ssize_t nargs,
                                    Py_ssize_t min, Py_ssize_t max, PyObject *kwnames,
                                    const char *what);
int mpidp_py_async_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t at);
PyObject *mpidp_py_started(mpidp_py_state *st, int rc, const mpidp_operation_t *ops, void *x,
                           mpidp_py_borrowed_t *t, size_t n, int async_op, PyObject *comm,
                           PyObject *result, const char *what);
size_t *mpidp_py_counts_arg(PyObject *obj, int size);

PyObject *mpidp_py_comm_allreduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames);
PyObject *mpidp_py_comm_bcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames);
PyObject *mpidp_py_comm_allgather(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames);
PyObject *mpidp_py_comm_barrier(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames);
PyObject *mpidp_py_comm_reduce_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwnames);
PyObject *mpidp_py_comm_allgatherv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames);
PyObject *mpidp_py_comm_peer_exchange(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                      PyObject *kwnames);
PyObject *mpidp_py_comm_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames);
PyObject *mpidp_py_comm_gatherv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames);
PyObject *mpidp_py_comm_scatterv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames);
PyObject *mpidp_py_comm_alltoallv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames);
PyObject *mpidp_py_comm_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames);
PyObject *mpidp_py_comm_recv(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames);
PyObject *mpidp_py_comm_agree(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames);

/* paramsync.c's module function: Heat's staleness weights as the core computes them. */
PyObject *mpidp_py_paramsync_merge_weights(PyObject *m, PyObject *args);

/* The types, one per file; module.c creates them. */
extern PyType_Spec mpidp_py_comm_spec, mpidp_py_work_spec, mpidp_py_reducer_spec,
    mpidp_py_paramsync_spec, mpidp_py_schedule_spec, mpidp_py_bgavg_spec, mpidp_py_devcomm_spec;
extern PyStructSequence_Desc mpidp_py_schedule_actions_desc, mpidp_py_avgsched_actions_desc;
/* Module-init hooks: mpi4py's C API (comm.c), the gradient path's interned
 * names (reducer_pass.c). 0, or -1 with an exception. */
int mpidp_py_import_mpi4py(void);
int mpidp_py_reducer_pass_init(void);
/* The capsule of the C++ gradient hook's API (grad_hook_api.h; reducer_pass.c). */
PyObject *mpidp_py_grad_hook_api_capsule(void);
/* The capsule of the C++ "mpidp" backend's API (c10d_api.h; c10d_api.c). */
PyObject *mpidp_py_c10d_api_capsule(mpidp_py_state *st);

/* Creates a Work that owns the operation `x` (driven by `ops`, one of the
 * core's tables in mpidp/operation.h) and keeps the `n` borrowed tensors
 * (moved in: their capsules are taken) and `comm` alive until it completes;
 * its result() is `result`. NULL with an exception (the operation then
 * finished here) on failure. */
PyObject *mpidp_py_work_new(mpidp_py_state *st, const mpidp_operation_t *ops, void *x,
                            mpidp_py_borrowed_t *keepalive, size_t n, PyObject *comm,
                            PyObject *result);

/* Module functions binding the conversion kernels (csrc/py/kernels.c), over
 * the process-wide state (process.c), planning buckets (bucket_plan.c), the
 * averaging schedule (averaging_schedule.c) and the peer graphs (peer_graphs.c). */
extern PyMethodDef mpidp_py_kernel_methods[];
extern PyMethodDef mpidp_py_process_methods[];
extern PyMethodDef mpidp_py_bucket_plan_functions[];
extern PyMethodDef mpidp_py_avgsched_functions[];
extern PyMethodDef mpidp_py_peers_functions[];
extern PyMethodDef mpidp_py_efcomp_functions[];

#endif /* MPIDP_PY_MODULE_H */
