/* Shared declarations of the CPython glue (csrc/py): module state, the error
 * translator, DLPack borrowing and the per-type entry points. */
#ifndef MPIDP_PY_MODULE_H
#define MPIDP_PY_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>

#include "mpidp/reqtable.h"
#include "mpidp/tensor.h"

typedef struct {
    PyTypeObject *comm_type;
    PyTypeObject *work_type;
    PyTypeObject *reducer_type;
    PyTypeObject *paramsync_type;
    PyTypeObject *schedule_type;
    PyTypeObject *schedule_actions_type; /* struct sequence: Schedule.batch's result */
    PyObject *comm_error;      /* mpidp.CommError(RuntimeError) */
    PyObject *comm_timeout;    /* mpidp.CommTimeout(CommError) */
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

/* mpidp._C.Comm: a duplicate of the user's communicator with
 * MPI_ERRORS_RETURN, so MPI failures come back as status codes. */
typedef struct {
    PyObject_HEAD
    MPI_Comm comm;
    int rank;
    int size;
    PyObject *module;   /* keeps the module state (request table) alive */
} mpidp_py_comm_t;

/* The Comm behind `obj`, or NULL with a TypeError naming `argname`. */
mpidp_py_comm_t *mpidp_py_as_comm(mpidp_py_state *st, PyObject *obj, const char *argname);

/* Collective methods of Comm (csrc/py/collectives.c). */
PyObject *mpidp_py_comm_allreduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames);
PyObject *mpidp_py_comm_bcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames);
PyObject *mpidp_py_comm_allgather(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames);
PyObject *mpidp_py_comm_barrier(PyObject *self, PyObject *unused);

/* Type specs and module-init hooks, one per file. */
int mpidp_py_comm_init(PyObject *module, mpidp_py_state *st);
int mpidp_py_work_init(PyObject *module, mpidp_py_state *st);
int mpidp_py_reducer_init(PyObject *module, mpidp_py_state *st);
int mpidp_py_paramsync_init(PyObject *module, mpidp_py_state *st);
int mpidp_py_schedule_init(PyObject *module, mpidp_py_state *st);

struct mpidp_allreduce;
/* Creates a Work that owns the allreduce `x` and keeps `keepalive` (the
 * borrowed tensor, moved in) and `comm` alive until it completes. */
PyObject *mpidp_py_work_new(mpidp_py_state *st, struct mpidp_allreduce *x,
                            mpidp_py_borrowed_t *keepalive, PyObject *comm);

/* Module functions binding the conversion kernels (csrc/py/kernels.c) and
 * over the process-wide state (csrc/py/process.c). */
extern PyMethodDef mpidp_py_kernel_methods[];
extern PyMethodDef mpidp_py_process_methods[];

#endif /* MPIDP_PY_MODULE_H */
