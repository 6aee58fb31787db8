/* The one place where a core status becomes a Python exception. */
#include "module.h"

#include <stdio.h>
#include <string.h>

#include "mpidp/ft.h"
#include "mpidp/status.h"

static int world_rank(void)
{
    int initialized = 0, finalized = 0, rank = -1;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    return rank;
}

PyObject *mpidp_py_raise(mpidp_py_state *st, int status, const char *what)
{
    /* A Python callback failed inside the core: its exception says it best. */
    if (status == MPIDP_ECALLBACK && PyErr_Occurred()) return NULL;
    const char *detail = mpidp_error_detail();
    /* The core often names the operation itself ("allreduce: ..."): say it once. */
    size_t what_len = strlen(what);
    if (strncmp(detail, what, what_len) == 0 && detail[what_len] == ':' && detail[what_len + 1] == ' ')
        detail += what_len + 2;
    PyObject *type;
    switch (status) {
    case MPIDP_EINVAL: type = PyExc_ValueError; break;
    case MPIDP_EDTYPE: type = PyExc_TypeError; break;
    case MPIDP_EDEVICE: type = PyExc_ValueError; break;
    case MPIDP_ENOMEM: type = PyExc_MemoryError; break;
    case MPIDP_ENOTSUP: type = PyExc_NotImplementedError; break;
    case MPIDP_EMPI: type = st->comm_error; break;
    case MPIDP_ETIMEDOUT: type = st->comm_timeout; break;
    case MPIDP_EMISMATCH: type = st->comm_error; break;
    case MPIDP_EDEPARTED: type = st->comm_error; break;
    case MPIDP_EPEERFAILED: type = st->ranks_lost; break;
    default: type = PyExc_RuntimeError; break;
    }
    int rank = world_rank();
    PyObject *msg;
    /* Survivors waiting on this rank in any of mpidp's communicators must
     * learn of the failure too, rather than wait on a rank now in recovery. */
    if (status == MPIDP_EPEERFAILED) mpidp_ft_revoke_all();
    int comm_failure = type == st->comm_error || type == st->comm_timeout || type == st->ranks_lost;
    if (comm_failure)
        msg = PyUnicode_FromFormat("%s on rank %d: %s: %s", what, rank, mpidp_strerror(status),
                                   detail);
    else if (detail[0])
        msg = PyUnicode_FromFormat("%s: %s", what, detail);
    else
        msg = PyUnicode_FromFormat("%s: %s", what, mpidp_strerror(status));
    if (msg == NULL) return NULL;

    /* A rank that ended: the job cannot go on either, and waits as a timeout does. */
    if (status == MPIDP_EDEPARTED) mpidp_py_timed_out = 1;
    if (status == MPIDP_EDEPARTED && mpidp_py_abort_on_timeout) {
        fprintf(stderr, "mpidp: %s\nmpidp: aborting the job (set MPIDP_ON_TIMEOUT=raise to raise "
                        "mpidp.CommError instead)\n", PyUnicode_AsUTF8(msg));
        fflush(stderr);
        mpidp_abort_job(4);
    }
    if (status == MPIDP_ETIMEDOUT) mpidp_py_timed_out = 1;
    if (status == MPIDP_ETIMEDOUT && mpidp_py_abort_on_timeout) {
        /* Another rank is most likely stuck (or dead) in a collective that will
         * never complete; raising here would leave every other rank waiting
         * forever, so end the whole job now, loudly. */
        fprintf(stderr, "mpidp: %s\nmpidp: another rank is stuck, dead, or doing something "
                        "else (ranks with different numbers of batches? wrap the training loop "
                        "in `with net.join():`; ranks that loaded checkpoints of different steps "
                        "or epochs?)\nmpidp: aborting the job (set "
                        "MPIDP_ON_TIMEOUT=raise to raise mpidp.CommTimeout instead)\n",
                PyUnicode_AsUTF8(msg));
        fflush(stderr);
        mpidp_abort_job(3);
    }
    PyObject *exc = PyObject_CallOneArg(type, msg);
    if (exc != NULL && comm_failure) {
        PyObject *r = PyLong_FromLong(rank);
        PyObject *op = PyUnicode_FromString(what);
        if (r && op) {
            PyObject_SetAttrString(exc, "rank", r);
            PyObject_SetAttrString(exc, "operation", op);
        }
        Py_XDECREF(r);
        Py_XDECREF(op);
    }
    Py_DECREF(msg);
    if (exc != NULL) {
        PyErr_SetObject(type, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

int mpidp_py_check(mpidp_py_state *st, int status, const char *what)
{
    if (status == MPIDP_OK) return 0;
    mpidp_py_raise(st, status, what);
    return -1;
}
