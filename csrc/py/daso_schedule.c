/* mpidp._C.Schedule: DASO's schedule (csrc/core/daso_schedule.c) for Python.
 *
 * A thin wrapper: the state machine decides everything; this file converts
 * arguments, actions and the checkpointable state. The state travels as a
 * dict of the struct's fields, listed once by MPIDP_SCHEDULE_FIELDS. */
#include "module.h"

#include <stddef.h>
#include <structmember.h>

#include "mpidp/daso_schedule.h"
#include "mpidp/status.h"

typedef struct {
    PyObject_HEAD
    mpidp_schedule_t s;
    mpidp_py_state *st;
} schedule_t;

/* The schedule's settings by keyword, for Schedule() and reconfigure()
 * (`fmt` ends with ":name" for error messages). 0, or -1 with an exception. */
static int parse_config(PyObject *args, PyObject *kwds, const char *fmt,
                        mpidp_schedule_config_t *cfg)
{
    static char *kwlist[] = {"total_epochs", "warmup_epochs", "cooldown_epochs", "max_global_skips",
                             "skip_reduction_factor", "local_skip_factor", "n_groups",
                             "stability_level", NULL};
    long long te, we, ce, mgs, srf, lsf, ng;
    double sl;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, fmt, kwlist, &te, &we, &ce, &mgs, &srf, &lsf,
                                     &ng, &sl))
        return -1;
    *cfg = (mpidp_schedule_config_t){te, we, ce, mgs, srf, lsf, ng, sl};
    return 0;
}

static PyObject *schedule_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    mpidp_schedule_config_t cfg;
    if (parse_config(args, kwds, "LLLLLLLd:Schedule", &cfg) < 0) return NULL;
    mpidp_py_state *st = mpidp_py_state_of_type(type);
    if (st == NULL) return NULL;
    schedule_t *self = (schedule_t *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->st = st;
    mpidp_error_clear();
    int rc = mpidp_schedule_init(&self->s, &cfg);
    if (rc != MPIDP_OK) {
        Py_DECREF(self);
        return mpidp_py_raise(st, rc, "DASO");
    }
    return (PyObject *)self;
}

/* The fields of ScheduleActions, in the order of mpidp_schedule_actions_t. */
static PyStructSequence_Field actions_fields[] = {
    {"complete", "receive and merge the sync in flight"},
    {"complete_group", "the parameter group of that sync"},
    {"complete_btw", "batches it waited"},
    {"send", "start a global sync"},
    {"send_group", "the parameter group to send"},
    {"send_btw", "batches until it is received"},
    {"send_blocking", "finish the sync just sent at once"},
    {"local_sync", "node-local gradient sync on for the next batch"},
    {"epoch_done", "this was the epoch's last batch"},
    {NULL, NULL},
};

PyStructSequence_Desc mpidp_py_schedule_actions_desc = {
    .name = "mpidp._C.ScheduleActions",
    .doc = "What DASO does after one batch (Schedule.batch's result).",
    .fields = actions_fields,
    .n_in_sequence = 9,
};

/* batch(batch, last_batch) -> ScheduleActions */
static PyObject *schedule_batch(schedule_t *self, PyObject *args)
{
    long long batch, last;
    if (!PyArg_ParseTuple(args, "LL:batch", &batch, &last)) return NULL;
    mpidp_schedule_actions_t a;
    mpidp_error_clear();
    int rc = mpidp_schedule_batch(&self->s, batch, last, &a);
    if (rc != MPIDP_OK) return mpidp_py_raise(self->st, rc, "DASO.step");
#define B(x) ((x) ? Py_True : Py_False)
    PyObject *fields = Py_BuildValue("(OLLOLLOOO)", B(a.complete), (long long)a.complete_group,
                                     (long long)a.complete_btw, B(a.send), (long long)a.send_group,
                                     (long long)a.send_btw, B(a.send_blocking), B(a.local_sync),
                                     B(a.epoch_done));
#undef B
    PyObject *out = fields ? PyObject_CallOneArg((PyObject *)self->st->schedule_actions_type, fields)
                           : NULL;
    Py_XDECREF(fields);
    return out;
}

static PyObject *schedule_epoch_end(schedule_t *self, PyObject *arg)
{
    double loss = PyFloat_AsDouble(arg);
    if (loss == -1.0 && PyErr_Occurred()) return NULL;
    mpidp_error_clear();
    int rc = mpidp_schedule_epoch_end(&self->s, loss);
    if (rc != MPIDP_OK) return mpidp_py_raise(self->st, rc, "DASO.epoch_loss_logic");
    Py_RETURN_NONE;
}

static PyObject *schedule_reset(schedule_t *self, PyObject *unused)
{
    (void)unused;
    mpidp_error_clear();
    int rc = mpidp_schedule_reset(&self->s);
    if (rc != MPIDP_OK) return mpidp_py_raise(self->st, rc, "DASO.reset");
    Py_RETURN_NONE;
}

/* state() -> {field: value} of every field of the state struct. */
static PyObject *schedule_state(schedule_t *self, PyObject *unused)
{
    (void)unused;
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
#define PUT_int64_t(member) PyLong_FromLongLong((long long)self->s.member)
#define PUT_double(member) PyFloat_FromDouble(self->s.member)
#define PUT(type, member)                                                       \
    {                                                                           \
        PyObject *v = PUT_##type(member);                                       \
        if (v == NULL || PyDict_SetItemString(d, #member, v) < 0) {             \
            Py_XDECREF(v);                                                      \
            Py_DECREF(d);                                                       \
            return NULL;                                                        \
        }                                                                       \
        Py_DECREF(v);                                                           \
    }
    MPIDP_SCHEDULE_FIELDS(PUT)
#undef PUT
#undef PUT_int64_t
#undef PUT_double
    return d;
}

/* load(state): replaces the whole state, then checks it is consistent. */
static PyObject *schedule_load(schedule_t *self, PyObject *d)
{
    if (!PyDict_Check(d)) return PyErr_Format(PyExc_TypeError, "state: expected a dict");
    mpidp_schedule_t s = self->s;
#define GET_int64_t(member, v) s.member = (int64_t)PyLong_AsLongLong(v)
#define GET_double(member, v) s.member = PyFloat_AsDouble(v)
#define GET(type, member)                                                       \
    {                                                                           \
        PyObject *v = PyDict_GetItemString(d, #member);                         \
        if (v == NULL)                                                          \
            return PyErr_Format(PyExc_ValueError, "state: missing field %s", #member); \
        GET_##type(member, v);                                                  \
        if (PyErr_Occurred()) return NULL;                                      \
    }
    MPIDP_SCHEDULE_FIELDS(GET)
#undef GET
#undef GET_int64_t
#undef GET_double
    mpidp_error_clear();
    int rc = mpidp_schedule_validate(&s);
    if (rc != MPIDP_OK) return mpidp_py_raise(self->st, rc, "DASO.load_state_dict");
    self->s = s;
    Py_RETURN_NONE;
}

/* reconfigure(total_epochs, ..., stability_level): adopt a new config between
 * epochs (a restarted job's own settings over the checkpoint's). */
static PyObject *schedule_reconfigure(schedule_t *self, PyObject *args, PyObject *kwds)
{
    mpidp_schedule_config_t cfg;
    if (parse_config(args, kwds, "LLLLLLLd:reconfigure", &cfg) < 0) return NULL;
    mpidp_error_clear();
    int rc = mpidp_schedule_reconfigure(&self->s, &cfg);
    if (rc != MPIDP_OK) return mpidp_py_raise(self->st, rc, "DASO.load_state_dict");
    Py_RETURN_NONE;
}

static PyObject *get_phase(schedule_t *self, void *c) { (void)c; return PyUnicode_FromString(mpidp_schedule_phase_name(self->s.phase)); }
static PyObject *get_pending(schedule_t *self, void *c) { (void)c; return PyBool_FromLong(self->s.pending != 0); }

static PyGetSetDef schedule_getset[] = {
    {"phase", (getter)get_phase, NULL, "warmup, cycling or cooldown", NULL},
    {"pending", (getter)get_pending, NULL, "a global sync is in flight", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* The state's int64_t counters, read-only. */
#define COUNTER(name, doc) {#name, T_LONGLONG, offsetof(schedule_t, s.name), READONLY, doc}
_Static_assert(sizeof(int64_t) == sizeof(long long), "T_LONGLONG reads the int64_t counters");
static PyMemberDef schedule_members[] = {
    COUNTER(global_skip, "batches between global syncs (0: every batch, blocking)"),
    COUNTER(local_skip, "batches between node-local syncs"),
    COUNTER(batches_to_wait, "batches between sending and receiving a sync"),
    COUNTER(epoch, "completed epochs"),
    COUNTER(next_batch, "the batch index expected next"),
    {NULL, 0, 0, 0, NULL},
};
#undef COUNTER

static PyMethodDef schedule_methods[] = {
    {"batch", (PyCFunction)schedule_batch, METH_VARARGS, "The actions of one optimizer step."},
    {"epoch_end", (PyCFunction)schedule_epoch_end, METH_O, "End-of-epoch logic with the mean loss."},
    {"reset", (PyCFunction)schedule_reset, METH_NOARGS, "Back to the initial state."},
    {"state", (PyCFunction)schedule_state, METH_NOARGS, "The whole state as a dict."},
    {"load", (PyCFunction)schedule_load, METH_O, "Restore a state() dict (validated)."},
    {"reconfigure", (PyCFunction)(void (*)(void))schedule_reconfigure, METH_VARARGS | METH_KEYWORDS,
     "Adopt a new config between epochs; the next epoch's phase follows it."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot schedule_slots[] = {
    {Py_tp_new, schedule_new},
    {Py_tp_methods, schedule_methods},
    {Py_tp_getset, schedule_getset},
    {Py_tp_members, schedule_members},
    {Py_tp_doc, "DASO's schedule: a pure state machine (internal)."},
    {0, NULL},
};

PyType_Spec mpidp_py_schedule_spec = {
    .name = "mpidp._C.Schedule",
    .basicsize = sizeof(schedule_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = schedule_slots,
};
