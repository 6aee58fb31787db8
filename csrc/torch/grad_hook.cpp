/* mpidp._grad_hook: DataParallel's gradient hook in C++, built against
 * libtorch when torch is importable at build time (setup.py; MPIDP_CPP_HOOK).
 *
 * The Python-level hook (a post-accumulate-grad hook calling
 * _C.Reducer.grad_arrived) costs torch a Python call per parameter per
 * backward: taking the GIL, building the argument tuple, the call itself.
 * Like torch DDP's reducer, this module instead adds a C++ post hook to each
 * parameter's gradient accumulator node. For the common case -- `.grad` is
 * the parameter's bucket view, no backward is opening -- it marks the
 * parameter through mpidp._C's hook API without the GIL or any Python
 * object; for everything else (the first hook of a backward, a foreign
 * `.grad`, a failure) it takes the GIL and calls grad_arrived(i, param), so
 * every decision stays in one place (csrc/py/reducer_pass.c).
 *
 * The hook runs after the accumulator node (after `.grad` is written and after
 * any Python post-accumulate-grad hooks the user added), on the thread that
 * runs that node: the caller's thread on CPUs. */
#include <Python.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/headeronly/version.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../py/grad_hook_api.h"

namespace {

const mpidp_grad_hook_api_t *api = nullptr;

/* mpidp._grad_hook.Hooks: the hooks install() (or install_noop()) added;
 * remove() (or dropping the object) takes them off again. It holds the
 * reducer (none for install_noop), which holds the parameters and their
 * bucket views. */
struct Hooks {
    PyObject_HEAD
    PyObject *reducer;
    /* The accumulator nodes, kept alive as DDP does: a node only weakly
     * referenced by its parameter would otherwise be rebuilt, without the
     * hook, by the next forward. */
    std::vector<std::pair<decltype(torch::autograd::impl::grad_accumulator(at::Tensor())),
                          uintptr_t>> *nodes;
    /* The parameters and their views' impls, read without Python (empty
     * for install_noop's hooks, which read nothing). */
    std::vector<at::Tensor> *tensors;
    std::vector<const c10::TensorImpl *> *views;
};

/* What parameter i's .grad is (grad_hook_api.h), from the tensors: for the
 * hooks' fast path and as the reducer's observer, where Python's attribute
 * costs ~0.3 us a parameter. */
int observe(void *ctx, size_t i)
{
    const Hooks *self = static_cast<const Hooks *>(ctx);
    const at::Tensor &grad = (*self->tensors)[i].grad();
    if (!grad.defined()) return MPIDP_GRAD_HOOK_NONE;
    return grad.unsafeGetTensorImpl() == (*self->views)[i] ? MPIDP_GRAD_HOOK_VIEW
                                                          : MPIDP_GRAD_HOOK_OTHER;
}

/* Parameter `index`'s hook; `owner` removes it before it goes. */
struct ArrivedHook final : torch::autograd::FunctionPostHook {
    ArrivedHook(Hooks *owner, size_t index) : owner(owner), index(index) {}

    torch::autograd::variable_list operator()(const torch::autograd::variable_list &outputs,
                                              const torch::autograd::variable_list &) override
    {
        PyObject *reducer = owner->reducer;
        if (observe(owner, index) == MPIDP_GRAD_HOOK_VIEW) {
            /* No GIL: the reducer's state is this backward's, and the request
             * table serialises itself (mpidp/reqtable.h: engines run under its
             * recursive lock). Taking the GIL here per parameter costs more
             * than the Python hook it replaces. */
            int status = 0;
            int done = api->arrived(reducer, index, &status);
            if (done == 1) return outputs;
            if (done == 2) { /* a full device bucket: its sum starts from Python */
                pybind11::gil_scoped_acquire gil;
                if (api->bucket_full(reducer) < 0) throw_python_error();
                return outputs;
            }
            if (done < 0) {
                pybind11::gil_scoped_acquire gil;
                api->raise(reducer, status);
                throw_python_error();
            }
        }
        pybind11::gil_scoped_acquire gil;
        PyObject *res = PyObject_CallMethod(reducer, "grad_arrived", "nO", (Py_ssize_t)index,
                                            api->param(reducer, index));
        if (res == nullptr) throw_python_error();
        Py_DECREF(res);
        return outputs;
    }

    /* GIL held, a Python exception set: saved for the caller of backward, who
     * gets it with its type (mpidp.CommTimeout, ...). */
    [[noreturn]] static void throw_python_error()
    {
        python_error err;
        err.persist();
        throw std::move(err);
    }

    Hooks *owner;
    size_t index;
};

/* A hook that does nothing: what torch's autograd engine alone charges for a
 * C++ post hook on an accumulator node, the floor under ArrivedHook's cost
 * (benchmarks/bench_step.py measures both). */
struct NoopHook final : torch::autograd::FunctionPostHook {
    torch::autograd::variable_list operator()(const torch::autograd::variable_list &outputs,
                                              const torch::autograd::variable_list &) override
    {
        return outputs;
    }
};

void remove_all(Hooks *self)
{
    /* The hooks and the observer first: they read the vectors below. */
    if (self->reducer) api->set_observer(self->reducer, nullptr, nullptr);
    if (self->nodes) {
        for (auto &node_key : *self->nodes) node_key.first->del_post_hook(node_key.second);
        delete self->nodes;
        self->nodes = nullptr;
    }
    delete self->tensors;
    delete self->views;
    self->tensors = nullptr;
    self->views = nullptr;
    Py_CLEAR(self->reducer);
}

PyObject *hooks_remove(PyObject *self, PyObject *)
{
    remove_all(reinterpret_cast<Hooks *>(self));
    Py_RETURN_NONE;
}

void hooks_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    remove_all(reinterpret_cast<Hooks *>(self));
    tp->tp_free(self);
    Py_DECREF(tp);
}

PyMethodDef hooks_methods[] = {
    {"remove", hooks_remove, METH_NOARGS, "Take every hook off again (idempotent)."},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot hooks_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void *>(hooks_dealloc)},
    {Py_tp_methods, hooks_methods},
    {Py_tp_doc, const_cast<char *>("The C++ gradient hooks of one reducer (remove())")},
    {0, nullptr},
};

PyType_Spec hooks_spec = {
    "mpidp._grad_hook.Hooks", sizeof(Hooks), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, hooks_slots,
};

PyTypeObject *hooks_type = nullptr;

/* The leaf tensor behind `obj` (element i of `what`), or a python_error. */
const at::Tensor &leaf(PyObject *obj, const char *what, Py_ssize_t i)
{
    if (!THPVariable_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s[%zd]: expected a tensor", what, i);
        throw python_error();
    }
    const at::Tensor &tensor = THPVariable_Unpack(obj);
    if (!tensor.requires_grad() || !tensor.is_leaf()) {
        PyErr_Format(PyExc_ValueError, "%s[%zd]: expected a leaf that requires grad", what, i);
        throw python_error();
    }
    return tensor;
}

/* A Hooks holding `reducer` (or none), with a hook from `make(self, i, tensor)`
 * on the accumulator of each of the n tensors `param(i)`; NULL with a
 * Python exception naming `who` on failure. */
template <typename Param, typename Make>
Hooks *hook_all(PyObject *reducer, Py_ssize_t n, const char *who, Param param, Make make)
{
    Hooks *self = PyObject_New(Hooks, hooks_type);
    if (self == nullptr) return nullptr;
    self->reducer = Py_XNewRef(reducer);
    self->nodes = nullptr;
    self->tensors = nullptr;
    self->views = nullptr;
    try {
        self->nodes = new std::remove_pointer_t<decltype(self->nodes)>();
        self->tensors = new std::vector<at::Tensor>();
        self->views = new std::vector<const c10::TensorImpl *>();
        for (Py_ssize_t i = 0; i < n; i++) {
            const at::Tensor &tensor = param(i);
            auto node = torch::autograd::impl::grad_accumulator(tensor);
            uintptr_t key = node->add_post_hook(make(self, i, tensor));
            self->nodes->emplace_back(std::move(node), key);
        }
    } catch (const python_error &) {
        Py_DECREF(self);
        return nullptr;
    } catch (const std::exception &e) {
        Py_DECREF(self);
        PyErr_Format(PyExc_RuntimeError, "mpidp._grad_hook.%s: %s", who, e.what());
        return nullptr;
    }
    return self;
}

/* install(reducer) -> Hooks: a hook on every parameter of `reducer` (a
 * _C.Reducer), each marking parameter i. */
PyObject *install(PyObject *, PyObject *reducer)
{
    Py_ssize_t n = api->n_params(reducer);
    if (n < 0) return nullptr;
    auto param = [reducer](Py_ssize_t i) -> const at::Tensor & {
        return leaf(api->param(reducer, (size_t)i), "reducer: parameters", i);
    };
    Hooks *self = hook_all(reducer, n, "install", param,
                           [reducer](Hooks *self, Py_ssize_t i, const at::Tensor &tensor) {
        PyObject *view = api->view(reducer, (size_t)i);
        if (!THPVariable_Check(view)) {
            PyErr_Format(PyExc_TypeError, "reducer: the view of parameter %zd is not a tensor", i);
            throw python_error();
        }
        self->tensors->push_back(tensor);
        self->views->push_back(THPVariable_Unpack(view).unsafeGetTensorImpl());
        return std::make_unique<ArrivedHook>(self, (size_t)i);
    });
    if (self == nullptr) return nullptr;
    api->set_observer(reducer, observe, self);
    return reinterpret_cast<PyObject *>(self);
}

/* install_noop(params) -> Hooks: a NoopHook on every tensor of the tuple
 * `params` (leaves that require grad), for measuring the hooks' floor. */
PyObject *install_noop(PyObject *, PyObject *params)
{
    if (!PyTuple_Check(params)) return PyErr_Format(PyExc_TypeError, "params: expected a tuple");
    auto param = [params](Py_ssize_t i) -> const at::Tensor & {
        return leaf(PyTuple_GET_ITEM(params, i), "params", i);
    };
    return reinterpret_cast<PyObject *>(hook_all(
        nullptr, PyTuple_GET_SIZE(params), "install_noop", param,
        [](Hooks *, Py_ssize_t, const at::Tensor &) { return std::make_unique<NoopHook>(); }));
}

/* count(param) -> the post hooks on param's gradient accumulator: this
 * module's and Python ones (tests: a re-wrapped model must carry one). */
PyObject *count(PyObject *, PyObject *param)
{
    if (!THPVariable_Check(param)) return PyErr_Format(PyExc_TypeError, "param: expected a tensor");
    auto node = torch::autograd::impl::try_get_grad_accumulator(THPVariable_Unpack(param));
    return PyLong_FromSize_t(node ? node->post_hooks().size() : 0);
}

PyMethodDef module_methods[] = {
    {"count", count, METH_O, "count(param) -> the post hooks on param's gradient accumulator."},
    {"install", install, METH_O,
     "install(reducer) -> Hooks: a C++ gradient hook on every parameter of the reducer."},
    {"install_noop", install_noop, METH_O,
     "install_noop(params) -> Hooks: a C++ hook that does nothing on every tensor of the tuple\n"
     "(benchmarks: torch's own cost of an accumulator hook)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "mpidp._grad_hook",
    "DataParallel's gradient hook in C++ (internal; see csrc/torch/grad_hook.cpp).", -1,
    module_methods, nullptr, nullptr, nullptr, nullptr,
};

/* The torch this module was compiled against must be the one running: the
 * C++ ABI of libtorch changes between releases, and a mismatch could fail
 * anywhere, not just at import. */
bool torch_matches()
{
    PyObject *torch = PyImport_ImportModule("torch");
    PyObject *ver = torch ? PyObject_GetAttrString(torch, "__version__") : nullptr;
    PyObject *str = ver ? PyObject_Str(ver) : nullptr;   /* torch's is a str subclass */
    Py_XDECREF(torch);
    Py_XDECREF(ver);
    const char *running = str ? PyUnicode_AsUTF8(str) : nullptr;
    if (running == nullptr) {
        Py_XDECREF(str);
        return false;
    }
    std::string built = std::to_string(TORCH_VERSION_MAJOR) + "." +
                        std::to_string(TORCH_VERSION_MINOR) + "." +
                        std::to_string(TORCH_VERSION_PATCH);
    std::string run(running);
    Py_DECREF(str);
    if (run == built || run.rfind(built + "+", 0) == 0 || run.rfind(built + "a", 0) == 0) return true;
    PyErr_Format(PyExc_ImportError, "mpidp._grad_hook was built for torch %s, this is torch %s: "
                 "rebuild mpidp (pip install --no-build-isolation .)", built.c_str(), run.c_str());
    return false;
}

} // namespace

PyMODINIT_FUNC PyInit__grad_hook(void)
{
    if (!torch_matches()) return nullptr;
    api = static_cast<const mpidp_grad_hook_api_t *>(
        PyCapsule_Import(MPIDP_GRAD_HOOK_API_CAPSULE, 0));
    if (api == nullptr) return nullptr;
    if (api->version != MPIDP_GRAD_HOOK_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "mpidp._grad_hook: mpidp._C offers hook API version %d, "
                     "this module needs %d (a partial rebuild?)", api->version,
                     MPIDP_GRAD_HOOK_API_VERSION);
        return nullptr;
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m == nullptr) return nullptr;
    hooks_type = reinterpret_cast<PyTypeObject *>(PyType_FromSpec(&hooks_spec));
    if (hooks_type == nullptr) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
