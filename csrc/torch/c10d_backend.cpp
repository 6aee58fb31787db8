/* mpidp._c10d: the "mpidp" torch.distributed backend as a c10d::Backend,
 * built against libtorch when torch is importable at build time (setup.py,
 * beside the gradient hook). Common host calls are posted on the caller's
 * thread through mpidp._C's core operations (csrc/py/c10d_api.h); every
 * other call goes to the Python group (mpidp/c10d/_process_group.py); every
 * call is first checked across the ranks (mpidp/callcheck.h). Why C++, the
 * data path and the costs: docs/design-notes.md, "The torch.distributed
 * backend in C++". */
#include <Python.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../py/c10d_api.h"
#include "mpidp/status.h"
#include "c10d_call.hpp"
#include "c10d_signature.hpp"
#include "c10d_python_work.hpp"
#include "c10d_tensors.hpp"

namespace {

namespace py = pybind11;
using c10::intrusive_ptr;
using c10d::OpType;
using c10d::Work;

using mpidp_c10d::api;
using mpidp_c10d::CallWork;
using mpidp_c10d::Contiguous;
using mpidp_c10d::core_tensor;
using mpidp_c10d::GroupState;
using mpidp_c10d::host_tensor;
using mpidp_c10d::Signature;
using mpidp_c10d::signature;

/* Sets a Python exception of `type` and throws it to torch's bindings. */
[[noreturn]] void raise_python(PyObject *type, const std::string &message)
{
    py::gil_scoped_acquire gil;
    PyErr_SetString(type, message.c_str());
    throw python_error();
}

/* Raises mpidp's exception for the core's failed `status` of `call`. */
[[noreturn]] void raise_status(int status, const std::string &call)
{
    py::gil_scoped_acquire gil;
    api->raise(status, ("mpidp backend: " + call).c_str());
    throw python_error();
}

/* A program's call on a group, from its start to its return: one at a time
 * (a second thread's raises), after the group's call in flight has ended
 * where `after_in_flight` (its failure is raised here: this rank cannot go
 * on), and then with the group's lock held until release().
 *
 * The call in flight ends first, and so do the callbacks of its future,
 * wherever they run: a callback may make calls on the group (torch's
 * PowerSGD hook makes two per bucket), and those must come before this
 * one on every rank, or one rank's call would pair with another's
 * callback's. So a group's calls are in the same order on every rank: the
 * program's, each followed by those of its future's callbacks. A call
 * made from a callback on this thread ends what it left in flight too,
 * and so on until none is. */
class Entered {
  public:
    Entered(GroupState &group, const char *call, bool after_in_flight, double timeout_s)
        : group_(group)
    {
        if (api->forked()) {
            py::gil_scoped_acquire gil;
            api->check_not_forked((std::string("mpidp backend: ") + call).c_str());
            throw python_error();
        }
        if (const char *closed = group.closed.load())
            raise_python(PyExc_RuntimeError,
                         std::string("mpidp backend: ") + call + " on a group that was " + closed);
        refuse_unusable(group, call);
        if (group.calling.load()) refuse_second_thread(call); /* before waiting for its lock */
        for (;;) {
            if (after_in_flight) after_earlier_calls(group, call, timeout_s);
            if (group.calling.exchange(true)) refuse_second_thread(call);
            mpidp_c10d::without_gil([&] { lock_ = std::unique_lock<std::mutex>(group.mu); });
            /* A callback's call posted on another thread since: it goes first. */
            if (!after_in_flight ||
                (!group.in_flight && group.callbacks_ran() &&
                 mpidp_c10d::CallbackThreads::get().none_elsewhere()))
                break;
            lock_.unlock();
            group.calling = false;
        }
    }
    ~Entered() { release(); }
    Entered(const Entered &) = delete;
    Entered &operator=(const Entered &) = delete;

    void release()
    {
        if (lock_.owns_lock()) lock_.unlock();
        if (!released_) group_.calling = false;
        released_ = true;
    }

  private:
    /* Until the group's call in flight has ended (its failure raised here)
     * and no future's callbacks run on another thread: those of the last
     * call, which another thread may have ended without running them yet,
     * and any others (CallbackThreads). */
    static void after_earlier_calls(GroupState &group, const char *call, double timeout_s)
    {
        for (;;) {
            c10::intrusive_ptr<CallWork> previous;
            mpidp_c10d::without_gil([&] {
                std::lock_guard<std::mutex> lock(group.mu);
                previous = group.in_flight;
            });
            if (previous) {
                if (!previous->end(-1, true)) callbacks_too_long(call, timeout_s);
                if (std::exception_ptr error = previous->error()) std::rethrow_exception(error);
                refuse_unusable(group, call);
                continue;
            }
            c10::intrusive_ptr<CallWork> last = group.last_call();
            if (last && !last->called_back()) {
                if (!last->end(-1, true)) callbacks_too_long(call, timeout_s);
                continue;
            }
            bool none = true;
            mpidp_c10d::without_gil([&] {
                none = mpidp_c10d::CallbackThreads::get().wait_for_others(timeout_s);
            });
            if (!none) callbacks_too_long(call, timeout_s);
            return;
        }
    }

    [[noreturn]] static void callbacks_too_long(const char *call, double timeout_s)
    {
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, "%g", timeout_s);
        std::string detail = "the callbacks of an earlier call's future (which may make calls "
                             "on the group that must come first) were still running on another "
                             "thread after the group's timeout of " +
                             std::string(seconds) + " s";
        api->set_detail(detail.c_str());
        raise_status(MPIDP_ETIMEDOUT, call);
    }

    [[noreturn]] static void refuse_second_thread(const char *call)
    {
        raise_python(PyExc_RuntimeError,
                     std::string("mpidp backend: ") + call + " was called on a group while "
                     "another thread's call on it was running: a group's collectives must be "
                     "called in the same order on every rank, from one thread at a time");
    }

    static void refuse_unusable(const GroupState &group, const char *call)
    {
        if (group.unusable.load())
            raise_python(PyExc_RuntimeError, std::string("mpidp backend: ") + call +
                                                 " on a group that can no longer be used: " +
                                                 group.unusable_why);
    }

    GroupState &group_;
    std::unique_lock<std::mutex> lock_;
    bool released_ = false;
};

class BackendMPIDP : public c10d::Backend {
  public:
    /* comm: the group's mpidp._C.Comm; fallback: its Python group, which
     * takes every call the fast path does not; host_fast_path false hands
     * it host tensors too (MPIDP_C10D_DEVICE_COMM=standin: the device
     * path's logic on CPU tensors). */
    BackendMPIDP(py::object comm, py::object fallback, double timeout_s, bool check, int rank,
                 int size, bool host_fast_path, std::vector<int> global_ranks)
        : Backend(rank, size), comm_obj_(std::move(comm)), fallback_(std::move(fallback)),
          state_(std::make_shared<GroupState>(size, std::move(global_ranks))),
          timeout_s_(timeout_s),
          host_fast_path_(host_fast_path)
    {
        int r = 0, s = 0;
        comm_ = api->comm_of(comm_obj_.ptr(), &r, &s);
        if (comm_ == nullptr) throw python_error();
        if (r != rank || s != size)
            throw std::invalid_argument("mpidp backend: the communicator's rank and size are not "
                                        "the group's");
        if (check && size > 1) {
            int rc;
            {
                py::gil_scoped_release nogil;
                rc = api->check_new(comm_, timeout_s_, &state_->check);
            }
            if (rc != 0) {
                api->raise(rc, "mpidp backend: the ranks' check of each call");
                throw python_error();
            }
        }
    }

    /* A call still in flight ends first (its deadline holds); the check
     * goes with the group's state, once no call of it is left. */
    ~BackendMPIDP() override
    {
        end_in_flight();
        py::gil_scoped_acquire gil;
        comm_obj_ = py::object();
        fallback_ = py::object();
    }

    const std::string getBackendName() const override { return "mpidp"; }

    void setTimeout(std::chrono::milliseconds timeout) override
    {
        timeout_s_ = static_cast<double>(timeout.count()) / 1000.0;
    }

    intrusive_ptr<Work> allreduce(std::vector<at::Tensor> &tensors,
                                  const c10d::AllreduceOptions &opts) override
    {
        one_device("all_reduce", tensors);
        int op = -1;
        if (tensors.size() == 1 && fast(tensors[0]) &&
            (op = reduce_op(opts.reduceOp, tensors[0].scalar_type())) >= 0) {
            Contiguous t(tensors[0]);
            mpidp_tensor_t c = core_tensor(t.get());
            return fast_call(OpType::ALLREDUCE, "mpidp:all_reduce", opts.asyncOp, tensors, {t},
                             signature(MPIDP_C10D_CALL_ALLREDUCE, &tensors[0], op, -1), nullptr,
                             &c, op, -1);
        }
        return fallback("allreduce", tensors, opts);
    }

    intrusive_ptr<Work> broadcast(std::vector<at::Tensor> &tensors,
                                  const c10d::BroadcastOptions &opts) override
    {
        one_device("broadcast", tensors);
        if (tensors.size() == 1 && opts.rootTensor == 0 && fast(tensors[0])) {
            Contiguous t(tensors[0]);
            int root = static_cast<int>(opts.rootRank);
            mpidp_tensor_t c = core_tensor(t.get());
            return fast_call(OpType::BROADCAST, "mpidp:broadcast", opts.asyncOp, tensors, {t},
                             signature(MPIDP_C10D_CALL_BCAST, &tensors[0], -1, root), nullptr,
                             &c, -1, root);
        }
        return fallback("broadcast", tensors, opts);
    }

    intrusive_ptr<Work> _allgather_base(at::Tensor &output, at::Tensor &input,
                                        const c10d::AllgatherOptions &opts) override
    {
        one_device("all_gather_into_tensor", input, output);
        if (fast(input) && fast(output) &&
            output.scalar_type() == input.scalar_type() &&
            output.numel() == input.numel() * size_ && !output.is_same(input)) {
            Contiguous in(input), out(output);
            mpidp_tensor_t s = core_tensor(in.get()), r = core_tensor(out.get());
            return fast_call(OpType::_ALLGATHER_BASE, "mpidp:all_gather_into_tensor",
                             opts.asyncOp, {output}, {in, out},
                             signature(MPIDP_C10D_CALL_ALLGATHER, &input, -1, -1), &s, &r, -1,
                             -1);
        }
        return fallback("_allgather_base", output, input, opts);
    }

    intrusive_ptr<Work> _reduce_scatter_base(at::Tensor &output, at::Tensor &input,
                                             const c10d::ReduceScatterOptions &opts) override
    {
        one_device("reduce_scatter_tensor", input, output);
        int op = -1;
        if (fast(input) && fast(output) &&
            output.scalar_type() == input.scalar_type() &&
            input.numel() == output.numel() * size_ &&
            (op = reduce_op(opts.reduceOp, input.scalar_type(), true)) >= 0) {
            Contiguous in(input), out(output);
            mpidp_tensor_t s = core_tensor(in.get()), r = core_tensor(out.get());
            return fast_call(OpType::_REDUCE_SCATTER_BASE, "mpidp:reduce_scatter_tensor",
                             opts.asyncOp, {output}, {in, out},
                             signature(MPIDP_C10D_CALL_REDUCE_SCATTER, &input, op, -1), &s, &r,
                             op, -1);
        }
        return fallback("_reduce_scatter_base", output, input, opts);
    }

    /* Blocking whatever asyncOp says: torch's barrier waits at once. */
    intrusive_ptr<Work> barrier(const c10d::BarrierOptions &) override
    {
        return fast_call(OpType::BARRIER, "mpidp:barrier", false, {}, {},
                         signature(MPIDP_C10D_CALL_BARRIER, nullptr, -1, -1), nullptr, nullptr,
                         -1, -1);
    }

    /* Everything else: the Python group's method of the name torch's own
     * Python-group route calls. */
    intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor> &t,
                                            const c10d::AllreduceCoalescedOptions &o) override
    {
        return fallback("allreduce_coalesced", t, o);
    }
    intrusive_ptr<Work> reduce(std::vector<at::Tensor> &t, const c10d::ReduceOptions &o) override
    {
        return fallback("reduce", t, o);
    }
    intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>> &out,
                                  std::vector<at::Tensor> &in,
                                  const c10d::AllgatherOptions &o) override
    {
        return fallback("allgather", out, in, o);
    }
    intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>> &out,
                                            std::vector<at::Tensor> &in,
                                            const c10d::AllgatherOptions &o) override
    {
        return fallback("allgather_coalesced", out, in, o);
    }
    intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor> &out,
                                                        std::vector<at::Tensor> &in,
                                                        const c10d::AllgatherOptions &o) override
    {
        return fallback("all_gather_single_coalesced", out, in, o);
    }
    intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>> &out,
                               std::vector<at::Tensor> &in, const c10d::GatherOptions &o) override
    {
        return fallback("gather", out, in, o);
    }
    intrusive_ptr<Work> scatter(std::vector<at::Tensor> &out,
                                std::vector<std::vector<at::Tensor>> &in,
                                const c10d::ScatterOptions &o) override
    {
        return fallback("scatter", out, in, o);
    }
    intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor> &out,
                                       std::vector<std::vector<at::Tensor>> &in,
                                       const c10d::ReduceScatterOptions &o) override
    {
        return fallback("reduce_scatter", out, in, o);
    }
    intrusive_ptr<Work> reduce_scatter_tensor_coalesced(
        std::vector<at::Tensor> &out, std::vector<at::Tensor> &in,
        const c10d::ReduceScatterOptions &o) override
    {
        return fallback("reduce_scatter_tensor_coalesced", out, in, o);
    }
    intrusive_ptr<Work> alltoall_base(at::Tensor &out, at::Tensor &in,
                                      std::vector<int64_t> &out_splits,
                                      std::vector<int64_t> &in_splits,
                                      const c10d::AllToAllOptions &o) override
    {
        return fallback("all_to_all_single", out, in, out_splits, in_splits, o);
    }
    intrusive_ptr<Work> alltoall(std::vector<at::Tensor> &out, std::vector<at::Tensor> &in,
                                 const c10d::AllToAllOptions &o) override
    {
        return fallback("alltoall", out, in, o);
    }
    intrusive_ptr<Work> send(std::vector<at::Tensor> &t, int dst, int tag) override
    {
        return fallback("send", t, dst, tag);
    }
    intrusive_ptr<Work> recv(std::vector<at::Tensor> &t, int src, int tag) override
    {
        return fallback("recv", t, src, tag);
    }
    intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor> &t, int tag) override
    {
        return fallback("recv_anysource", t, tag);
    }

    /* The Python group behind this backend. */
    py::object python_group() const { return fallback_; }

    /* torch.distributed.shrink_group: a backend over this group's ranks
     * less `ranks_to_exclude`, made by mpidp/c10d/_shrink.py (MPI's
     * communicator of the remaining ranks; in fault-tolerant mode ULFM's
     * shrink of the survivors, under the deadline), which registers itself
     * as this module's `shrunk_backend`: the extension is below every
     * Python layer and imports none of them. Called on the remaining ranks
     * only. */
    bool supportsShrinking() const override { return true; }
    intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t> &ranks_to_exclude,
                                        int shrink_flags,
                                        const intrusive_ptr<Options> &) override
    {
        py::gil_scoped_acquire gil;
        try {
            py::object made = py::module_::import("mpidp._c10d")
                                  .attr("shrunk_backend")(fallback_, ranks_to_exclude,
                                                          shrink_flags);
            return made.cast<intrusive_ptr<BackendMPIDP>>();
        } catch (py::error_already_set &e) {
            e.restore();
            throw python_error();
        }
    }

    /* destroy_process_group: the call in flight ends, the group's own MPI
     * state goes (the check's side communicator), and every later call
     * raises. A call running on another thread keeps the check, which then
     * lives until the group's state goes. */
    void shutdown() override
    {
        end_in_flight();
        close("shut down (destroy_process_group)");
    }
    /* The same without waiting: calls in flight end at their deadlines. */
    void abort() override { close("aborted"); }

  private:
    /* The core's op for torch's `op` on `dtype` where the core reduces it as
     * it is; -1 where the Python group stages it (16-bit min/max/product in
     * float32, bool, premul_sum, averages of other dtypes); sums_only
     * (reduce_scatter_tensor): sums and averages only. */
    static int reduce_op(const c10d::ReduceOp &op, at::ScalarType dtype, bool sums_only = false)
    {
        bool half = dtype == at::kHalf || dtype == at::kBFloat16;
        bool avg_ok = dtype == at::kFloat || dtype == at::kDouble;
        if (dtype == at::kBool) return -1;
        switch (op.op_) {
        case c10d::ReduceOp::SUM: return api->op_sum;
        case c10d::ReduceOp::AVG: return avg_ok ? api->op_avg : -1;
        case c10d::ReduceOp::MIN: return sums_only || half ? -1 : api->op_min;
        case c10d::ReduceOp::MAX: return sums_only || half ? -1 : api->op_max;
        case c10d::ReduceOp::PRODUCT: return sums_only || half ? -1 : api->op_prod;
        default: return -1;
        }
    }

    /* Raises a ValueError naming the devices where a call's tensors are on
     * more than one: a collective runs on one device's communicator. */
    template <typename... Tensors> void one_device(const char *call, const Tensors &...tensors)
    {
        std::vector<c10::Device> seen;
        (mpidp_c10d::add_devices(seen, tensors), ...);
        if (seen.size() < 2) return;
        std::string names;
        for (const auto &d : seen) names += (names.empty() ? "" : " and ") + d.str();
        raise_python(PyExc_ValueError, std::string("mpidp backend: ") + call +
                                           ": the tensors are on " + names +
                                           ": a collective's tensors must all be on one device");
    }

    /* A tensor the fast path takes: on the host, contiguous or not. */
    bool fast(const at::Tensor &t) const { return host_fast_path_ && host_tensor(t); }

    void close(const char *how)
    {
        state_->closed = how;
        std::unique_lock<std::mutex> lock(state_->mu, std::try_to_lock);
        if (lock.owns_lock() && !state_->in_flight && state_->check != nullptr &&
            !api->forked()) {
            api->check_free(state_->check);
            state_->check = nullptr;
        }
    }

    /* The group's call in flight, if any, ends here (its failure, if any,
     * goes to its Work and future). */
    void end_in_flight()
    {
        if (api->forked()) return;
        c10::intrusive_ptr<CallWork> previous;
        mpidp_c10d::without_gil([&] {
            std::lock_guard<std::mutex> lock(state_->mu);
            previous = state_->in_flight;
        });
        if (previous) previous->end();
    }

    /* The ranks' check of `sig` and, for a fast call, the call posted (its
     * pending end; none for the check alone). Where it failed, or the ranks
     * differ (every rank raises the same ValueError), raises after leaving
     * the group. */
    mpidp_c10d_pending_t *start(Entered &entered, const char *call, const Signature &sig,
                                const mpidp_tensor_t *send, const mpidp_tensor_t *recv, int op,
                                int root)
    {
        mpidp_c10d_pending_t *pending = nullptr;
        int differ = 0, rc = 0;
        mpidp_c10d::without_gil([&] {
            rc = api->start(comm_, state_->check, sig.data(), send, recv, op, root, timeout_s_,
                            &pending, &differ);
        });
        if (rc != 0) {
            /* The ranks' check (or the call) is left posted. */
            if (mpidp_left_in_flight(rc)) state_->refuse_later(mpidp_c10d::left_posted(call));
            entered.release();
            raise_status(rc, call);
        }
        if (differ) {
            std::string message = state_->differences(call);
            entered.release();
            raise_python(PyExc_ValueError, message);
        }
        return pending;
    }

    /* One fast-path call: its Work, made first so that the profiler's
     * `title` ("mpidp:<call>", a literal) spans the call; the ranks' check
     * and the call posted; then, unless `async`, its end on this thread.
     * Where the ranks differ, every rank raises the same ValueError.
     * `tensors`: what MPI reads and writes (send, recv: their core views). */
    intrusive_ptr<Work> fast_call(OpType type, const char *title, bool async,
                                  std::vector<at::Tensor> result, std::vector<Contiguous> tensors,
                                  const Signature &sig, const mpidp_tensor_t *send,
                                  const mpidp_tensor_t *recv, int op, int root)
    {
        const char *call = title + sizeof("mpidp:") - 1;
        Entered entered(*state_, call, true, timeout_s_);
        auto work = c10::make_intrusive<CallWork>(state_, rank_, type, title, std::move(result),
                                                  std::move(tensors), timeout_s_);
        work->set_pending(start(entered, call, sig, send, recv, op, root));
        state_->set_last(work);
        if (async) {
            state_->in_flight = work;
            return work;
        }
        bool mine = false;
        mpidp_c10d::without_gil([&] { mine = work->progress(true); });
        entered.release();
        if (mine) work->publish();
        if (std::exception_ptr error = work->error()) std::rethrow_exception(error);
        return work;
    }

    /* A call for the Python group: checked first (point-to-point calls,
     * which involve two ranks, are not, and do not wait for the group's
     * call in flight), then the group's method `method`. */
    template <typename... Args> intrusive_ptr<Work> fallback(const char *method, Args &&...args)
    {
        int index = mpidp_c10d::python_call_index(method);
        const char *call = index >= 0 ? mpidp_c10d::python_calls()[index].second : method;
        one_device(call, args...);
        {
            Entered entered(*state_, call, index >= 0, timeout_s_);
            if (state_->check != nullptr && index >= 0)
                start(entered, call, mpidp_c10d::python_signature(index), nullptr, nullptr, -1,
                      -1);
        }
        py::gil_scoped_acquire gil;
        try {
            py::object w = fallback_.attr(method)(std::forward<Args>(args)...);
            return c10::make_intrusive<mpidp_c10d::PythonWork>(w);
        } catch (py::error_already_set &e) {
            e.restore();
            throw python_error();
        }
    }

    py::object comm_obj_;
    py::object fallback_;
    const void *comm_ = nullptr;
    std::shared_ptr<GroupState> state_;
    double timeout_s_;
    bool host_fast_path_;
};
/* The group torch hands the program: torch's own ProcessGroup (whose
 * collectives go through the dispatcher to the backend registered for the
 * tensor's device), named "mpidp" -- a custom C++ backend in a group torch
 * makes is named "custom" (DDP's logging, pg.name()). */
class GroupMPIDP : public c10d::ProcessGroup {
  public:
    explicit GroupMPIDP(const intrusive_ptr<BackendMPIDP> &backend)
        : ProcessGroup(backend->getRank(), backend->getSize())
    {
        for (auto device : {c10::DeviceType::CPU, c10::DeviceType::CUDA})
            setBackend(device, BackendType::CUSTOM, backend);
        setDefaultBackend(BackendType::CUSTOM);
    }
    const std::string getBackendName() const override { return "mpidp"; }
};

}  // namespace

PYBIND11_MODULE(_c10d, m)
{
    m.doc() = "The 'mpidp' torch.distributed backend as a c10d::Backend (csrc/torch/c10d_backend.cpp).";
    py::module_ core = py::module_::import("mpidp._C");
    py::object capsule = core.attr("_c10d_api");
    mpidp_c10d::api = static_cast<const mpidp_c10d_api_t *>(
        PyCapsule_GetPointer(capsule.ptr(), MPIDP_C10D_API_CAPSULE));
    if (api == nullptr) throw py::error_already_set();
    if (api->version != MPIDP_C10D_API_VERSION)
        throw std::runtime_error("mpidp._c10d was built against another mpidp._C: rebuild mpidp");
    py::module_::import("torch.distributed");
    py::class_<BackendMPIDP, c10d::Backend, intrusive_ptr<BackendMPIDP>>(m, "BackendMPIDP")
        .def(py::init<py::object, py::object, double, bool, int, int, bool, std::vector<int>>(),
             py::arg("comm"), py::arg("python_group"), py::arg("timeout_s"), py::arg("check"),
             py::arg("rank"), py::arg("size"), py::arg("host_fast_path") = true,
             py::arg("global_ranks") = std::vector<int>{})
        .def_property_readonly("python_group", &BackendMPIDP::python_group);
    /* The progress thread stops at exit, before MPI is finalized (atexit's
     * functions run in reverse order, and mpi4py's was registered first). */
    m.def("_stop_progress", [] {
        py::gil_scoped_release nogil;
        mpidp_c10d::Progress::get().stop();
    });
    py::module_::import("atexit").attr("register")(m.attr("_stop_progress"));
    py::class_<GroupMPIDP, c10d::ProcessGroup, intrusive_ptr<GroupMPIDP>>(m, "GroupMPIDP")
        .def(py::init<const intrusive_ptr<BackendMPIDP> &>(), py::arg("backend"));
}
