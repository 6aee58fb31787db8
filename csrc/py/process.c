/* Process-wide state of the glue (one MPI per process, so one value each):
 * the deadline of every wait and what a missed one does, whether hooks drive
 * MPI progress, whether this process is a fork of a rank or has seen a
 * timeout; and the module functions over the request table (what is in
 * flight, progress, finishing it at exit). */
#include "module.h"

#include <unistd.h>

#include "mpidp/convert.h"
#include "mpidp/status.h"

double mpidp_py_timeout_s = 1800.0;
int mpidp_py_abort_on_timeout = 1;
int mpidp_py_hook_progress = 1;
int mpidp_py_forked = 0;
int mpidp_py_timed_out = 0;

int mpidp_py_check_not_forked(const char *what)
{
    if (!mpidp_py_forked) return 0;
    PyErr_Format(PyExc_RuntimeError,
                 "%s: this process was forked from an MPI rank (pid %ld); MPI cannot be used "
                 "in a fork -- communicate from the parent process, and start helper processes "
                 "with the 'spawn' or 'forkserver' method if they need MPI",
                 what, (long)getpid());
    return -1;
}

int mpidp_py_warn_fp16_overflow(void)
{
    static int warned = 0;
    if (warned || mpidp_fp16_overflow_total() == 0) return 0;
    warned = 1;
    return PyErr_WarnEx(PyExc_RuntimeWarning,
                        "mpidp: finite values beyond float16's range (+-65504) became inf on the "
                        "wire (wire_dtype=torch.float16; values below 6e-8 become 0). Send "
                        "bfloat16 (float32's range) or float32, or scale the values down", 1);
}

static PyObject *mod_set_timeout(PyObject *m, PyObject *arg)
{
    (void)m;
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred()) return NULL;
    mpidp_py_timeout_s = t;
    Py_RETURN_NONE;
}

static PyObject *mod_get_timeout(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    return PyFloat_FromDouble(mpidp_py_timeout_s);
}

/* set_<name>(bool): one process-wide flag. */
#define FLAG_SETTER(name, flag)                                                 \
    static PyObject *mod_set_##name(PyObject *m, PyObject *arg)                 \
    {                                                                           \
        (void)m;                                                                \
        int v = PyObject_IsTrue(arg);                                           \
        if (v < 0) return NULL;                                                 \
        (flag) = v;                                                             \
        Py_RETURN_NONE;                                                         \
    }
FLAG_SETTER(abort_on_timeout, mpidp_py_abort_on_timeout)
FLAG_SETTER(hook_progress, mpidp_py_hook_progress)
#undef FLAG_SETTER

static PyObject *mod_get_hook_progress(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return PyBool_FromLong(mpidp_py_hook_progress);
}

static PyObject *mod_pending(PyObject *m, PyObject *unused)
{
    (void)unused;
    return PyLong_FromSize_t(mpidp_reqtable_pending(mpidp_py_state_of_module(m)->reqs));
}

/* progress(): one MPI_Test over everything in flight (Open MPI advances
 * non-blocking collectives only inside MPI calls); returns how many completed. */
static PyObject *mod_progress(PyObject *m, PyObject *unused)
{
    (void)unused;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    size_t done = 0;
    mpidp_error_clear();
    int rc = mpidp_reqtable_progress(st->reqs, &done);
    if (rc != MPIDP_OK) return mpidp_py_raise(st, rc, "progress");
    return PyLong_FromSize_t(done);
}

static PyObject *mod_describe_pending(PyObject *m, PyObject *unused)
{
    (void)unused;
    char buf[4096];
    mpidp_reqtable_describe(mpidp_py_state_of_module(m)->reqs, buf, sizeof buf);
    return PyUnicode_FromString(buf);
}

/* finish_pending(): waits for everything in flight (called at exit, before
 * mpi4py finalizes MPI, so no request outlives MPI or its buffer). */
static PyObject *mod_finish_pending(PyObject *m, PyObject *unused)
{
    (void)unused;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (finalized) Py_RETURN_NONE;
    int rc;
    mpidp_error_clear();
    MPIDP_PY_WAIT(st, rc, mpidp_reqtable_wait_all(st->reqs, mpidp_py_timeout_s));
    if (rc != MPIDP_OK) return mpidp_py_raise(st, rc, "finishing pending communication");
    Py_RETURN_NONE;
}

/* os.register_at_fork(after_in_child=...): communication refuses from now on. */
static PyObject *mod_mark_forked(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    mpidp_py_forked = 1;
    Py_RETURN_NONE;
}

static PyObject *mod_fp16_overflows(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    return PyLong_FromSize_t(mpidp_fp16_overflow_total());
}

/* Whether a wait in this process ran past its deadline (CommTimeout). */
static PyObject *mod_timed_out(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    return PyBool_FromLong(mpidp_py_timed_out);
}

PyMethodDef mpidp_py_process_methods[] = {
    {"set_timeout", mod_set_timeout, METH_O, "Deadline in seconds for every wait (<= 0: none)."},
    {"get_timeout", mod_get_timeout, METH_NOARGS, "The current deadline in seconds."},
    {"set_abort_on_timeout", mod_set_abort_on_timeout, METH_O,
     "True: a deadline aborts the job; False: it raises mpidp.CommTimeout."},
    {"set_hook_progress", mod_set_hook_progress, METH_O,
     "True (default): gradient hooks test what is in flight, so MPI progresses during backward."},
    {"get_hook_progress", mod_get_hook_progress, METH_NOARGS,
     "Whether hooks drive MPI progress (MPIDP_HOOK_PROGRESS)."},
    {"pending", mod_pending, METH_NOARGS, "Number of mpidp requests in flight."},
    {"describe_pending", mod_describe_pending, METH_NOARGS, "What is in flight, as text."},
    {"progress", mod_progress, METH_NOARGS,
     "Test everything in flight once so MPI advances it; returns how many completed."},
    {"finish_pending", mod_finish_pending, METH_NOARGS, "Wait for every request in flight."},
    {"fp16_overflows", mod_fp16_overflows, METH_NOARGS,
     "Finite values that became inf when packed to float16 for the wire, so far."},
    {"timed_out", mod_timed_out, METH_NOARGS,
     "True once a wait in this process has run past its deadline (CommTimeout)."},
    {"mark_forked", mod_mark_forked, METH_NOARGS,
     "Called in a child after fork(): every later communication raises."},
    {NULL, NULL, 0, NULL},
};
