/* mpidp._C: module definition, state and the module-level functions.
 *
 * Multi-phase initialisation; types and exceptions live in the module state.
 * MPI must already be initialised when this module executes: the Python
 * package imports mpi4py.MPI (which initialises MPI) before importing _C. */
#include "module.h"

#include <stdlib.h>

#include "mpidp/allreduce.h"
#include "mpidp/bucket.h"
#include "mpidp/checksum.h"
#include "mpidp/convert.h"
#include "mpidp/mpiops.h"
#include "mpidp/pack.h"
#include "mpidp/status.h"

/* Room for this many requests in flight at once, over all of mpidp. */
#define MPIDP_REQTABLE_CAPACITY 65536

static struct PyModuleDef mpidp_module;

mpidp_py_state *mpidp_py_state_of_module(PyObject *module)
{
    return (mpidp_py_state *)PyModule_GetState(module);
}

PyObject *mpidp_py_module_of_type(PyTypeObject *type)
{
    return PyType_GetModuleByDef(type, &mpidp_module);
}

mpidp_py_state *mpidp_py_state_of_type(PyTypeObject *type)
{
    PyObject *module = mpidp_py_module_of_type(type);
    return module ? mpidp_py_state_of_module(module) : NULL;
}

static PyObject *mod_mpi_library_version(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(version, &len);
    return PyUnicode_FromStringAndSize(version, len);
}

/* The MPI implementation whose headers this extension was compiled with. */
static PyObject *mod_mpi_header_version(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
#if defined(OMPI_MAJOR_VERSION)
    return PyUnicode_FromFormat("Open MPI v%d.%d.%d", OMPI_MAJOR_VERSION, OMPI_MINOR_VERSION,
                                OMPI_RELEASE_VERSION);
#elif defined(MPICH_VERSION)
    return PyUnicode_FromFormat("MPICH Version: %s", MPICH_VERSION);
#else
    return PyUnicode_FromFormat("MPI %d.%d", MPI_VERSION, MPI_SUBVERSION);
#endif
}

static PyObject *mod_thread_level(PyObject *m, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLong(mpidp_py_state_of_module(m)->thread_level);
}

/* plan_buckets(numel, dtype, first_cap_bytes, cap_bytes)
 *   -> (bucket_of, offset, ((numel, n_params, dtype), ...)) */
static PyObject *mod_plan_buckets(PyObject *m, PyObject *args)
{
    PyObject *numel_seq, *dtype_seq;
    unsigned long long first_cap, cap;
    if (!PyArg_ParseTuple(args, "OOKK:plan_buckets", &numel_seq, &dtype_seq, &first_cap, &cap))
        return NULL;
    PyObject *numel_fast = PySequence_Fast(numel_seq, "numel must be a sequence");
    PyObject *dtype_fast = numel_fast ? PySequence_Fast(dtype_seq, "dtype must be a sequence") : NULL;
    if (dtype_fast == NULL) {
        Py_XDECREF(numel_fast);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(numel_fast);
    PyObject *result = NULL;
    size_t n1 = n ? (size_t)n : 1;
    size_t *numel = malloc(n1 * sizeof *numel), *offset = malloc(n1 * sizeof *offset);
    int *dtype = malloc(n1 * sizeof *dtype);
    uint32_t *bucket = malloc(n1 * sizeof *bucket);
    mpidp_bucket_info_t *info = malloc(n1 * sizeof *info);
    if (!numel || !offset || !dtype || !bucket || !info) {
        PyErr_NoMemory();
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(dtype_fast) != n) {
        PyErr_SetString(PyExc_ValueError, "plan_buckets: numel and dtype differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        numel[i] = PyLong_AsSize_t(PySequence_Fast_GET_ITEM(numel_fast, i));
        dtype[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(dtype_fast, i));
        if (PyErr_Occurred()) goto done;
    }
    size_t nb = 0;
    mpidp_error_clear();
    int rc = mpidp_bucket_plan(numel, dtype, (size_t)n, (size_t)first_cap, (size_t)cap, bucket,
                               offset, info, &nb);
    if (rc != MPIDP_OK) {
        mpidp_py_raise(mpidp_py_state_of_module(m), rc, "plan_buckets");
        goto done;
    }
    PyObject *pb = PyTuple_New(n), *po = PyTuple_New(n), *bi = PyTuple_New((Py_ssize_t)nb);
    if (pb && po && bi) {
        int ok = 1;
        for (Py_ssize_t i = 0; i < n && ok; i++) {
            PyObject *a = PyLong_FromUnsignedLong(bucket[i]), *b = PyLong_FromSize_t(offset[i]);
            ok = a && b;
            if (a) PyTuple_SET_ITEM(pb, i, a);
            if (b) PyTuple_SET_ITEM(po, i, b);
        }
        for (size_t b = 0; b < nb && ok; b++) {
            PyObject *t = Py_BuildValue("(nni)", (Py_ssize_t)info[b].numel,
                                        (Py_ssize_t)info[b].n_params, info[b].dtype);
            ok = t != NULL;
            if (t) PyTuple_SET_ITEM(bi, (Py_ssize_t)b, t);
        }
        if (ok) result = PyTuple_Pack(3, pb, po, bi);
    }
    Py_XDECREF(pb);
    Py_XDECREF(po);
    Py_XDECREF(bi);
done:
    free(numel);
    free(offset);
    free(dtype);
    free(bucket);
    free(info);
    Py_DECREF(numel_fast);
    Py_DECREF(dtype_fast);
    return result;
}

/* checksums(tensors) -> tuple of 64-bit checksums of each CPU tensor's bytes. */
static PyObject *mod_checksums(PyObject *m, PyObject *seq)
{
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    PyObject *fast = PySequence_Fast(seq, "checksums: expected a sequence of tensors");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        mpidp_py_borrowed_t t;
        if (mpidp_py_borrow(st, PySequence_Fast_GET_ITEM(fast, i),
                            MPIDP_TENSOR_CPU_ONLY | MPIDP_TENSOR_ANY_DTYPE, "tensors", &t) < 0) {
            Py_CLEAR(out);
            break;
        }
        uint64_t h;
        size_t bytes = t.t.numel * mpidp_dtype_size(t.t.dtype);
        Py_BEGIN_ALLOW_THREADS h = mpidp_checksum64(t.t.data, bytes, (uint64_t)t.t.dtype);
        Py_END_ALLOW_THREADS
        mpidp_py_release(&t);
        PyObject *v = PyLong_FromUnsignedLongLong(h);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    Py_DECREF(fast);
    return out;
}

static PyMethodDef module_methods[] = {
    {"mpi_library_version", mod_mpi_library_version, METH_NOARGS,
     "MPI_Get_library_version() of the MPI library this process runs on."},
    {"mpi_header_version", mod_mpi_header_version, METH_NOARGS,
     "The MPI implementation whose headers the extension was built with."},
    {"thread_level", mod_thread_level, METH_NOARGS, "MPI_Query_thread() at import."},
    {"plan_buckets", mod_plan_buckets, METH_VARARGS,
     "plan_buckets(numel, dtype, first_cap_bytes, cap_bytes) -> (bucket_of, offset, infos)"},
    {"checksums", mod_checksums, METH_O,
     "checksums(tensors) -> 64-bit checksums of each CPU tensor's bytes (MPIDP_CHECK)."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m)
{
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
        PyErr_SetString(PyExc_ImportError, "mpidp._C needs MPI initialised: import mpi4py.MPI first "
                                           "(import mpidp does this)");
        return -1;
    }
    MPI_Query_thread(&st->thread_level);
    /* The kernels' SIMD path, chosen once (MPIDP_SIMD=ref|avx2|avx512 forces one). */
    const char *forced = getenv("MPIDP_SIMD");
    mpidp_error_clear();
    if (mpidp_pack_init(forced) != MPIDP_OK) {
        PyErr_Format(PyExc_ImportError, "mpidp: MPIDP_SIMD=%s: %s", forced ? forced : "",
                     mpidp_error_detail());
        return -1;
    }
    mpidp_error_clear();
    if (mpidp_mpiops_init() != MPIDP_OK) {
        PyErr_Format(PyExc_ImportError, "mpidp: creating the bf16/fp16 MPI types and sum op "
                     "failed: %s", mpidp_error_detail());
        return -1;
    }
    if (PyModule_AddFunctions(m, mpidp_py_kernel_methods) < 0) return -1;
    if (PyModule_AddFunctions(m, mpidp_py_process_methods) < 0) return -1;
    /* The codes Python passes to the core, exported so that Python keeps no copies. */
    static const struct { const char *name; int value; } constants[] = {
        {"DTYPE_F32", MPIDP_F32}, {"DTYPE_F64", MPIDP_F64}, {"DTYPE_BF16", MPIDP_BF16},
        {"DTYPE_F16", MPIDP_F16}, {"OP_SUM", MPIDP_OP_SUM}, {"OP_AVG", MPIDP_OP_AVG},
        {"OP_MIN", MPIDP_OP_MIN}, {"OP_MAX", MPIDP_OP_MAX}, {"OP_PROD", MPIDP_OP_PROD},
        {"NO_WIRE", -1}, {"CONVERT_PACK", MPIDP_CONVERT_PACK},
        {"CONVERT_UNPACK", MPIDP_CONVERT_UNPACK}, {"CONVERT_SUM16", MPIDP_CONVERT_SUM16}};
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) return -1;
    if (mpidp_reqtable_create(MPIDP_REQTABLE_CAPACITY, &st->reqs) != MPIDP_OK) {
        PyErr_NoMemory();
        return -1;
    }
    st->comm_error = PyErr_NewExceptionWithDoc(
        "mpidp.CommError",
        "An MPI operation of mpidp failed. Attributes: rank (world rank), operation.",
        PyExc_RuntimeError, NULL);
    if (st->comm_error == NULL || PyModule_AddObjectRef(m, "CommError", st->comm_error) < 0)
        return -1;
    PyObject *bases = PyTuple_Pack(2, st->comm_error, PyExc_TimeoutError);
    if (bases == NULL) return -1;
    st->comm_timeout = PyErr_NewExceptionWithDoc(
        "mpidp.CommTimeout",
        "A wait on a collective passed its deadline (MPIDP_TIMEOUT): another rank is stuck, "
        "dead, or doing something else.",
        bases, NULL);
    Py_DECREF(bases);
    if (st->comm_timeout == NULL || PyModule_AddObjectRef(m, "CommTimeout", st->comm_timeout) < 0)
        return -1;
    if (mpidp_py_comm_init(m, st) < 0 || mpidp_py_work_init(m, st) < 0 ||
        mpidp_py_reducer_init(m, st) < 0 || mpidp_py_paramsync_init(m, st) < 0 ||
        mpidp_py_schedule_init(m, st) < 0)
        return -1;
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    Py_VISIT(st->comm_type);
    Py_VISIT(st->work_type);
    Py_VISIT(st->reducer_type);
    Py_VISIT(st->paramsync_type);
    Py_VISIT(st->schedule_type);
    Py_VISIT(st->schedule_actions_type);
    Py_VISIT(st->comm_error);
    Py_VISIT(st->comm_timeout);
    return 0;
}

static int module_clear(PyObject *m)
{
    mpidp_py_state *st = mpidp_py_state_of_module(m);
    Py_CLEAR(st->comm_type);
    Py_CLEAR(st->work_type);
    Py_CLEAR(st->reducer_type);
    Py_CLEAR(st->paramsync_type);
    Py_CLEAR(st->schedule_type);
    Py_CLEAR(st->schedule_actions_type);
    Py_CLEAR(st->comm_error);
    Py_CLEAR(st->comm_timeout);
    return 0;
}

static void module_free(void *m)
{
    mpidp_py_state *st = mpidp_py_state_of_module((PyObject *)m);
    module_clear((PyObject *)m);
    /* Refuses while requests are in flight; leaking the table is then the
     * safe choice (their buffers are leaked with it). */
    if (st->reqs && mpidp_reqtable_destroy(st->reqs) == MPIDP_OK) st->reqs = NULL;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef mpidp_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mpidp._C",
    .m_doc = "mpidp's C core: MPI collectives, gradient buckets and hooks, DASO kernels.",
    .m_size = sizeof(mpidp_py_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&mpidp_module);
}
