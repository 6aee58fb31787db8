/* mpidp._C: module definition, state and the module-level functions.
 *
 * Multi-phase initialisation; types and exceptions live in the module state.
 * MPI must already be initialised when this module executes: the Python
 * package imports mpi4py.MPI (which initialises MPI) before importing _C. */
#include "module.h"

#include <stdlib.h>

#include "mpidp/mpi_info.h"
#include "mpidp/allreduce.h"
#include "mpidp/checksum.h"
#include "mpidp/efcomp.h"
#include "mpidp/convert.h"
#include "mpidp/mpiops.h"
#include "mpidp/pack.h"
#include "mpidp/peer_graphs.h"
#include "mpidp/quant8.h"
#include "mpidp/reducer.h"

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

static PyObject *mod_mpi_cuda_aware(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    return PyBool_FromLong(mpidp_mpi_cuda_aware());
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

/* A wait of the Python layer's own past its deadline: raised, or the job
 * aborted, as MPIDP_ON_TIMEOUT says for every wait of the core. */
static PyObject *mod_timed_out(PyObject *m, PyObject *args)
{
    const char *what, *detail;
    if (!PyArg_ParseTuple(args, "ss:timed_out", &what, &detail)) return NULL;
    mpidp_error_set(detail);
    return mpidp_py_raise(mpidp_py_state_of_module(m), MPIDP_ETIMEDOUT, what);
}

static PyMethodDef module_methods[] = {
    {"timed_out", mod_timed_out, METH_VARARGS,
     "timed_out(what, detail): raises CommTimeout (or aborts the job, as MPIDP_ON_TIMEOUT says)\n"
     "for a wait of mpidp's Python layer that passed its deadline."},
    {"paramsync_merge_weights", mpidp_py_paramsync_merge_weights, METH_VARARGS,
     "paramsync_merge_weights(n_senders, batches_waited) -> (a, b, c): Heat's staleness weights."},
    {"mpi_cuda_aware", mod_mpi_cuda_aware, METH_NOARGS,
     "mpi_cuda_aware() -> the MPI library takes CUDA device pointers (MPIX_Query_cuda_support)."},
    {"mpi_library_version", mod_mpi_library_version, METH_NOARGS,
     "MPI_Get_library_version() of the MPI library this process runs on."},
    {"mpi_header_version", mod_mpi_header_version, METH_NOARGS,
     "The MPI implementation whose headers the extension was built with."},
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
    if (PyModule_AddFunctions(m, mpidp_py_kernel_methods) < 0 ||
        PyModule_AddFunctions(m, mpidp_py_process_methods) < 0 ||
        PyModule_AddFunctions(m, mpidp_py_bucket_plan_functions) < 0 ||
        PyModule_AddFunctions(m, mpidp_py_avgsched_functions) < 0 ||
        PyModule_AddFunctions(m, mpidp_py_peers_functions) < 0 ||
        PyModule_AddFunctions(m, mpidp_py_efcomp_functions) < 0)
        return -1;
    /* The codes Python passes to the core, exported so that Python keeps no copies. */
    static const struct { const char *name; int value; } constants[] = {
        {"DTYPE_F32", MPIDP_F32}, {"DTYPE_F64", MPIDP_F64}, {"DTYPE_BF16", MPIDP_BF16},
        {"DTYPE_F16", MPIDP_F16}, {"DTYPE_U8", MPIDP_U8}, {"DTYPE_I8", MPIDP_I8},
        {"DTYPE_I32", MPIDP_I32}, {"DTYPE_I64", MPIDP_I64}, {"EF_MAX_CHUNK", MPIDP_EF_MAX_CHUNK},
        {"EF_MAX_BINS", MPIDP_EF_MAX_BINS}, {"OP_SUM", MPIDP_OP_SUM}, {"OP_AVG", MPIDP_OP_AVG},
        {"OP_MIN", MPIDP_OP_MIN}, {"OP_MAX", MPIDP_OP_MAX}, {"OP_PROD", MPIDP_OP_PROD},
        {"OP_BAND", MPIDP_OP_BAND}, {"OP_BOR", MPIDP_OP_BOR}, {"OP_BXOR", MPIDP_OP_BXOR},
        {"NO_WIRE", -1}, {"CONVERT_PACK", MPIDP_CONVERT_PACK},
        {"CONVERT_UNPACK", MPIDP_CONVERT_UNPACK}, {"CONVERT_SUM16", MPIDP_CONVERT_SUM16},
        {"CONVERT_Q8_ENCODE", MPIDP_CONVERT_Q8_ENCODE}, {"CONVERT_Q8_DECODE", MPIDP_CONVERT_Q8_DECODE},
        {"Q8_BLOCK", MPIDP_Q8_BLOCK}, {"Q8_RECORD", MPIDP_Q8_RECORD},
        {"GRAPH_DDE", MPIDP_GRAPH_DDE}, {"GRAPH_NPDDE", MPIDP_GRAPH_NPDDE},
        {"GRAPH_DBE", MPIDP_GRAPH_DBE}, {"GRAPH_DDL", MPIDP_GRAPH_DDL},
        {"GRAPH_DBL", MPIDP_GRAPH_DBL}, {"GRAPH_RING", MPIDP_GRAPH_RING},
        {"GRAPH_SHIFT_ONE", MPIDP_GRAPH_SHIFT_ONE}, {"GRAPH_RING_LR", MPIDP_GRAPH_RING_LR}};
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) return -1;
    if (mpidp_reqtable_create(MPIDP_REQTABLE_CAPACITY, &st->reqs) != MPIDP_OK) {
        PyErr_NoMemory();
        return -1;
    }
    /* A failure of the "mpidp" torch.distributed backend is a failure of a
     * distributed backend to torch's programs too (what gloo and NCCL raise,
     * and what its docs promise): torch.distributed.DistBackendError, a
     * RuntimeError, is CommError's base wherever torch has it. */
    PyObject *base = NULL, *td = PyImport_ImportModule("torch.distributed");
    if (td != NULL) {
        base = PyObject_GetAttrString(td, "DistBackendError");
        Py_DECREF(td);
    }
    if (base == NULL) {
        PyErr_Clear();
        base = Py_NewRef(PyExc_RuntimeError);
    }
    st->comm_error = PyErr_NewExceptionWithDoc(
        "mpidp.CommError",
        "An MPI operation of mpidp failed (a torch.distributed.DistBackendError). Attributes: "
        "rank (world rank), operation.",
        base, NULL);
    Py_DECREF(base);
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
    st->ranks_lost = PyErr_NewExceptionWithDoc(
        "mpidp.RanksLost",
        "Fault-tolerant mode: a rank of the job failed during this step. Every survivor raises "
        "it within the same step, which none of them applied; mpidp.recover() continues on the "
        "survivors. Attributes: rank, operation.",
        st->comm_error, NULL);
    if (st->ranks_lost == NULL || PyModule_AddObjectRef(m, "RanksLost", st->ranks_lost) < 0)
        return -1;
    if (mpidp_py_import_mpi4py() < 0 || mpidp_py_reducer_pass_init() < 0) return -1;
    PyObject *api = mpidp_py_grad_hook_api_capsule();
    int added = api ? PyModule_AddObjectRef(m, "_grad_hook_api", api) : -1;
    Py_XDECREF(api);
    if (added < 0) return -1;
    api = mpidp_py_c10d_api_capsule(st);
    added = api ? PyModule_AddObjectRef(m, "_c10d_api", api) : -1;
    Py_XDECREF(api);
    if (added < 0) return -1;
    /* The types; the module state keeps those the glue creates objects of. */
    PyTypeObject **kept[] = {&st->comm_type, &st->work_type, &st->reducer_type, NULL, NULL, NULL,
                             NULL};
    PyType_Spec *specs[] = {&mpidp_py_comm_spec, &mpidp_py_work_spec, &mpidp_py_reducer_spec,
                            &mpidp_py_paramsync_spec, &mpidp_py_schedule_spec,
                            &mpidp_py_bgavg_spec, &mpidp_py_devcomm_spec};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        PyTypeObject *t = (PyTypeObject *)PyType_FromModuleAndSpec(m, specs[i], NULL);
        int rc = t ? PyModule_AddType(m, t) : -1;
        if (kept[i] && t) *kept[i] = t;
        else Py_XDECREF(t);
        if (rc < 0) return -1;
    }
    /* The struct sequences of the schedules' actions. */
    st->schedule_actions_type = PyStructSequence_NewType(&mpidp_py_schedule_actions_desc);
    st->avgsched_actions_type = PyStructSequence_NewType(&mpidp_py_avgsched_actions_desc);
    if (st->schedule_actions_type == NULL || st->avgsched_actions_type == NULL ||
        PyModule_AddType(m, st->schedule_actions_type) < 0)
        return -1;
    return PyModule_AddType(m, st->avgsched_actions_type);
}

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    mpidp_py_state *st = mpidp_py_state_of_module(m);
#define VISIT(type, name) Py_VISIT(st->name);
    MPIDP_PY_STATE_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int module_clear(PyObject *m)
{
    mpidp_py_state *st = mpidp_py_state_of_module(m);
#define CLEAR(type, name) Py_CLEAR(st->name);
    MPIDP_PY_STATE_OBJECTS(CLEAR)
#undef CLEAR
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
