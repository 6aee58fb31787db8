/* _C.avgsched_actions: the averaging schedule (core/averaging_schedule.c) for Python.
 * A pure function of the step and the settings, so there is no type: the
 * caller keeps the step (torch's `averager.step`). */
#include "module.h"

#include "mpidp/averaging_schedule.h"

/* avgsched_actions(step, *, warmup_steps=0, periods=(), count_from_warmup=False,
 *                  after_period=False, slow_every=0, slow_replaces_average=False,
 *                  n_fragments=0, fragment_every=1, fragment_delay=0)
 *   -> AveragingActions */
static PyObject *mod_avgsched_actions(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"step", "warmup_steps", "periods", "count_from_warmup",
                             "after_period", "slow_every", "slow_replaces_average",
                             "n_fragments", "fragment_every", "fragment_delay", NULL};
    mpidp_avgsched_config_t c = {.fragment_every = 1};
    long long step, warmup = 0, slow = 0, nf = 0, every = 1, delay = 0;
    PyObject *periods = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|$LOppLpLLL:avgsched_actions", kwlist, &step,
                                     &warmup, &periods, &c.count_from_warmup, &c.after_period,
                                     &slow, &c.slow_replaces_average, &nf, &every, &delay))
        return NULL;
    c.warmup_steps = warmup, c.slow_every = slow, c.n_fragments = nf;
    c.fragment_every = every, c.fragment_delay = delay;
    PyObject *fast = periods ? PySequence_Fast(periods, "periods: expected a sequence of ints")
                             : PyTuple_New(0);
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t l = 0; l < n && l < MPIDP_AVGSCHED_MAX_LEVELS; l++)
        c.periods[l] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, l));
    Py_DECREF(fast);
    if (PyErr_Occurred()) return NULL;
    if (n > MPIDP_AVGSCHED_MAX_LEVELS)
        return PyErr_Format(PyExc_ValueError, "periods: at most %d levels, got %zd",
                            MPIDP_AVGSCHED_MAX_LEVELS, n);
    c.n_levels = (int)n;
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    mpidp_avgsched_actions_t a;
    if (MPIDP_PY_CALL(st, "averaging schedule", mpidp_avgsched_actions(&c, step, &a)) < 0) return NULL;
    PyObject *fields = Py_BuildValue("(OiOLL)", a.average ? Py_True : Py_False, a.level,
                                     a.slow_step ? Py_True : Py_False, (long long)a.send_fragment,
                                     (long long)a.apply_fragment);
    PyObject *out = fields ? PyObject_CallOneArg((PyObject *)st->avgsched_actions_type, fields) : NULL;
    Py_XDECREF(fields);
    return out;
}

static PyStructSequence_Field actions_fields[] = {
    {"average", "average the parameters over level `level`'s group"},
    {"level", "the averaging level (index into periods), or -1"},
    {"slow_step", "take the slow (outer momentum) step"},
    {"send_fragment", "fragment whose outer gradient to send, or -1"},
    {"apply_fragment", "fragment whose sync to complete and apply, or -1"},
    {NULL, NULL},
};

PyStructSequence_Desc mpidp_py_avgsched_actions_desc = {
    .name = "mpidp._C.AveragingActions",
    .doc = "What to do after one optimizer step, in the order send, average, slow step, apply.",
    .fields = actions_fields,
    .n_in_sequence = 5,
};

PyMethodDef mpidp_py_avgsched_functions[] = {
    {"avgsched_actions", (PyCFunction)(void (*)(void))mod_avgsched_actions,
     METH_VARARGS | METH_KEYWORDS,
     "avgsched_actions(step, *, warmup_steps, periods, count_from_warmup, after_period,\n"
     "slow_every, slow_replaces_average, n_fragments, fragment_every, fragment_delay)\n"
     "-> AveragingActions after optimizer step `step` (mpidp/averaging_schedule.h)."},
    {NULL, NULL, 0, NULL},
};
