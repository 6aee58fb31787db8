/* Process-wide state of the glue (one MPI per process, so one value each):
 * the deadline of every wait and what a missed one does, whether hooks drive
 * MPI progress, whether this process is a fork of a rank or has seen a
 * timeout. Python sets them with configure() and reads them all with
 * process_state(); finish_pending() lands what is in flight at exit. */
#include "module.h"

#include "mpidp/ft.h"

#include <unistd.h>

#include "mpidp/convert.h"
#include "mpidp/departures.h"
#include "mpidp/ft.h"
#include "mpidp/mpi_info.h"
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

/* configure(*, timeout=, abort_on_timeout=, hook_progress=, forked=,
 * wait_spin=): sets the settings given. forked=True is for
 * os.register_at_fork's child: every later communication raises (there is
 * no way back). */
static PyObject *mod_configure(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout", "abort_on_timeout", "hook_progress", "forked",
                             "wait_spin", "departure_grace", NULL};
    mpidp_reqtable_t *reqs = mpidp_py_state_of_module(m)->reqs;
    double timeout = mpidp_py_timeout_s, spin = mpidp_reqtable_spin(reqs);
    double grace = mpidp_departures_grace();
    int abort_on = mpidp_py_abort_on_timeout, hook = mpidp_py_hook_progress, forked = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$dpppdd:configure", kwlist, &timeout,
                                     &abort_on, &hook, &forked, &spin, &grace))
        return NULL;
    if (!(spin >= 0))
        return PyErr_Format(PyExc_ValueError, "wait_spin: expected seconds >= 0, got %S",
                            PyDict_GetItemString(kwds, "wait_spin"));
    if (!(grace >= 0))
        return PyErr_Format(PyExc_ValueError, "departure_grace: expected seconds >= 0, got %S",
                            PyDict_GetItemString(kwds, "departure_grace"));
    mpidp_reqtable_set_spin(reqs, spin);
    mpidp_departures_set_grace(grace);
    mpidp_py_timeout_s = timeout;
    mpidp_py_abort_on_timeout = abort_on;
    mpidp_py_hook_progress = hook;
    mpidp_py_forked |= forked;
    Py_RETURN_NONE;
}

/* process_state() -> dict of the settings, and of what happened so far. */
static PyObject *mod_process_state(PyObject *m, PyObject *unused)
{
    (void)unused;
    mpidp_reqtable_t *reqs = mpidp_py_state_of_module(m)->reqs;
    char in_flight[1024];
    mpidp_reqtable_describe(reqs, in_flight, sizeof in_flight);
    return Py_BuildValue("{s:d,s:d,s:d,s:N,s:N,s:N,s:N,s:n,s:n,s:s}", "timeout", mpidp_py_timeout_s,
                         "wait_spin", mpidp_reqtable_spin(reqs),
                         "departure_grace", mpidp_departures_grace(),
                         "abort_on_timeout", PyBool_FromLong(mpidp_py_abort_on_timeout),
                         "hook_progress", PyBool_FromLong(mpidp_py_hook_progress),
                         "forked", PyBool_FromLong(mpidp_py_forked),
                         "timed_out", PyBool_FromLong(mpidp_py_timed_out),
                         "fp16_overflows", (Py_ssize_t)mpidp_fp16_overflow_total(),
                         "pending", (Py_ssize_t)mpidp_reqtable_pending(reqs),
                         "in_flight", in_flight);
}

/* finish_pending(): waits for everything in flight (called at exit, before
 * mpi4py finalizes MPI, so no request outlives MPI or its buffer). */
static PyObject *mod_finish_pending(PyObject *m, PyObject *unused)
{
    (void)unused;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    if (mpidp_mpi_finalized()) Py_RETURN_NONE;
    int rc;
    mpidp_error_clear();
    MPIDP_PY_WAIT(st, rc, mpidp_reqtable_wait_all(st->reqs, mpidp_py_timeout_s));
    if (rc != MPIDP_OK) return mpidp_py_raise(st, rc, "finishing pending communication");
    Py_RETURN_NONE;
}

/* departures_start(comm): listen for ranks of comm (the world's Comm) that
 * end their program (mpidp/departures.h); collective over it. */
static PyObject *mod_departures_start(PyObject *m, PyObject *comm)
{
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    mpidp_py_comm_t *c = mpidp_py_as_comm(st, comm, "comm");
    if (c == NULL) return NULL;
    mpidp_error_clear();
    if (mpidp_py_check(st, mpidp_departures_start(c->comm), "departures_start") < 0) return NULL;
    Py_RETURN_NONE;
}

/* departures_announce(): this rank ends its program; tell the others. */
static PyObject *mod_departures_announce(PyObject *m, PyObject *unused)
{
    (void)unused;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    if (mpidp_mpi_finalized()) Py_RETURN_NONE;
    int rc;
    mpidp_error_clear();
    Py_BEGIN_ALLOW_THREADS
    rc = mpidp_departures_announce();
    Py_END_ALLOW_THREADS
    if (mpidp_py_check(st, rc, "departures_announce") < 0) return NULL;
    Py_RETURN_NONE;
}

/* iallreduce_algorithm(prefer=0) -> Open MPI's MPI_Iallreduce algorithm in
 * force, after making a 0 (Open MPI's own choice) `prefer`; -1 where MPI
 * has no such setting (mpidp_mpi_iallreduce_algorithm). */
static PyObject *mod_iallreduce_algorithm(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    long prefer = nargs > 0 ? PyLong_AsLong(args[0]) : 0;
    if (nargs > 1) return PyErr_Format(PyExc_TypeError, "iallreduce_algorithm(prefer=0)");
    if (prefer == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(mpidp_mpi_iallreduce_algorithm((int)prefer));
}

/* ft_support() -> (compiled, running): ULFM in the MPI mpidp was built
 * against, and fault tolerance on in this job (mpidp/ft.h). */
static PyObject *mod_ft_support(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return Py_BuildValue("(ii)", mpidp_ft_compiled(), mpidp_ft_running());
}

/* ft_revoke_all() -> how many of the core's communicators it revoked now. */
static PyObject *mod_ft_revoke_all(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return PyLong_FromLong(mpidp_ft_revoke_all());
}

/* ft_exit_watchdog(seconds): end the process with status 0 that much later. */
static PyObject *mod_ft_exit_watchdog(PyObject *m, PyObject *arg)
{
    (void)m;
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    if (mpidp_ft_exit_watchdog(seconds) != 0)
        return PyErr_Format(PyExc_RuntimeError, "ft_exit_watchdog: no thread could start");
    Py_RETURN_NONE;
}

/* ft_end_with_launcher() -> 0, 1 (unsupported here) or -1 (already gone). */
static PyObject *mod_ft_end_with_launcher(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return PyLong_FromLong(mpidp_ft_end_with_launcher());
}

/* ft_set_job_comm(handle): the communicator abort_job ends, by its Fortran
 * handle (mpi4py's py2f(): no mpi4py C API outside comm.c). */
static PyObject *mod_ft_set_job_comm(PyObject *m, PyObject *arg)
{
    (void)m;
    long handle = PyLong_AsLong(arg);
    if (handle == -1 && PyErr_Occurred()) return NULL;
    mpidp_ft_set_job_comm(MPI_Comm_f2c((MPI_Fint)handle));
    Py_RETURN_NONE;
}

/* abort_job(code): end the job (MPI_Abort; staggered in fault-tolerant mode). */
static PyObject *mod_abort_job(PyObject *m, PyObject *arg)
{
    (void)m;
    long code = PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    mpidp_abort_job((int)code);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyMethodDef mpidp_py_process_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))mod_configure, METH_VARARGS | METH_KEYWORDS,
     "configure(*, timeout, abort_on_timeout, hook_progress, forked, wait_spin): process-wide\n"
     "settings (timeout: seconds of every wait, <= 0 none; abort_on_timeout: a deadline aborts\n"
     "the job instead of raising mpidp.CommTimeout; hook_progress: gradient hooks test what is\n"
     "in flight; forked: this is a fork of a rank, every later communication raises;\n"
     "wait_spin: seconds a wait spins before it sleeps between tests; departure_grace: seconds\n"
     "a wait goes on after a rank of its communicator ended its program)."},
    {"process_state", mod_process_state, METH_NOARGS,
     "The settings, and timed_out / fp16_overflows / pending (requests in flight) / in_flight\n"
     "(what they are and how long ago each was posted), as a dict."},
    {"finish_pending", mod_finish_pending, METH_NOARGS, "Wait for every request in flight."},
    {"departures_start", mod_departures_start, METH_O,
     "departures_start(comm): listen for ranks of comm (the world) that end their program."},
    {"departures_announce", mod_departures_announce, METH_NOARGS,
     "This rank ends its program: tell the other ranks (at exit, after finish_pending)."},
    {"iallreduce_algorithm", (PyCFunction)(void (*)(void))mod_iallreduce_algorithm,
     METH_FASTCALL, "iallreduce_algorithm(prefer=0) -> Open MPI's MPI_Iallreduce algorithm in\n"
     "force (coll_libnbc_iallreduce_algorithm), a 0 made `prefer` first; -1: no such setting."},
    {"ft_support", mod_ft_support, METH_NOARGS,
     "ft_support() -> (compiled, running): the MPI has ULFM; the job runs with it on."},
    {"ft_set_job_comm", mod_ft_set_job_comm, METH_O,
     "ft_set_job_comm(handle): the job's communicator (its py2f()), which abort_job aborts"},
    {"ft_end_with_launcher", mod_ft_end_with_launcher, METH_NOARGS,
     "ft_end_with_launcher(): the kernel kills this process when its launcher ends (Linux)"},
    {"ft_exit_watchdog", mod_ft_exit_watchdog, METH_O,
     "ft_exit_watchdog(seconds): end the process with status 0 that much later (at exit, after "
     "ranks were lost: MPI_Finalize may wait for them forever)."},
    {"abort_job", mod_abort_job, METH_O,
     "abort_job(code): end the whole job with MPI_Abort(MPI_COMM_WORLD, code); in fault-tolerant\n"
     "mode ranks other than 0 call it a second behind rank 0 (mpidp/ft.h: mpidp_abort_job)."},
    {"ft_revoke_all", mod_ft_revoke_all, METH_NOARGS,
     "Revoke every communicator mpidp made (ULFM); returns how many were revoked now."},
    {NULL, NULL, 0, NULL},
};
