/* mpidp._C.GradHook: the post-accumulate-grad hook of one parameter, the
 * hot path of DataParallel's backward. A vectorcall object (no bound method,
 * no argument tuple) that hands the parameter to its Reducer's pass
 * (csrc/py/reducer_pass.c). */
#include "reducer.h"

#include <structmember.h> /* PyMemberDef, T_PYSSIZET (Python < 3.12) */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    mpidp_py_reducer_t *reducer;
    Py_ssize_t index;
} gradhook_t;

/* --- the per-parameter hook (hot path) --------------------------------- */

static PyObject *gradhook_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames)
{
    gradhook_t *h = (gradhook_t *)self;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL)
        return PyErr_Format(PyExc_TypeError, "GradHook takes exactly one argument (the parameter)");
    if (mpidp_py_reducer_on_grad(h->reducer, (size_t)h->index, args[0]) < 0) return NULL;
    Py_RETURN_NONE;
}

PyObject *mpidp_py_gradhook_new(mpidp_py_reducer_t *r, size_t i)
{
    gradhook_t *h = PyObject_GC_New(gradhook_t, r->st->gradhook_type);
    if (h == NULL) return NULL;
    h->vectorcall = gradhook_vectorcall;
    h->reducer = (mpidp_py_reducer_t *)Py_NewRef(r);
    h->index = (Py_ssize_t)i;
    PyObject_GC_Track(h);
    return (PyObject *)h;
}

static int gradhook_traverse(gradhook_t *h, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(h));
    Py_VISIT(h->reducer);
    return 0;
}

static int gradhook_clear(gradhook_t *h)
{
    Py_CLEAR(h->reducer);
    return 0;
}

static void gradhook_dealloc(gradhook_t *h)
{
    PyTypeObject *tp = Py_TYPE(h);
    PyObject_GC_UnTrack(h);
    gradhook_clear(h);
    PyObject_GC_Del(h);
    Py_DECREF(tp);
}

static PyObject *gradhook_call(PyObject *self, PyObject *args, PyObject *kwds)
{
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)
        return PyErr_Format(PyExc_TypeError, "GradHook takes no keyword arguments");
    return gradhook_vectorcall(self, &PyTuple_GET_ITEM(args, 0), (size_t)PyTuple_GET_SIZE(args),
                               NULL);
}

static PyMemberDef gradhook_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(gradhook_t, vectorcall), READONLY, NULL},
    {"index", T_PYSSIZET, offsetof(gradhook_t, index), READONLY, "The parameter's index."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot gradhook_slots[] = {
    {Py_tp_dealloc, gradhook_dealloc},
    {Py_tp_traverse, gradhook_traverse},
    {Py_tp_clear, gradhook_clear},
    {Py_tp_call, gradhook_call},
    {Py_tp_members, gradhook_members},
    {Py_tp_doc, "Post-accumulate-grad hook of one parameter (internal)."},
    {0, NULL},
};

static PyType_Spec gradhook_spec = {
    .name = "mpidp._C.GradHook",
    .basicsize = sizeof(gradhook_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = gradhook_slots,
};

int mpidp_py_gradhook_init(PyObject *module, mpidp_py_state *st)
{
    st->gradhook_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &gradhook_spec, NULL);
    if (st->gradhook_type == NULL) return -1;
    return PyModule_AddType(module, st->gradhook_type);
}
