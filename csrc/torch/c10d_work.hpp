/* The C++ "mpidp" backend's pieces around the core (csrc/torch/c10d_backend.cpp):
 * torch tensors as the core's tensors, the signature's hash, and the Work of
 * a call its Python group made. */
#pragma once

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "mpidp/tensor.h"

namespace mpidp_c10d {

using c10::intrusive_ptr;
using c10d::OpType;
using c10d::Work;

/* The core's dtype codes (mpidp/tensor.h) of the torch dtypes it takes; -1: none. */
inline int core_dtype(at::ScalarType t)
{
    switch (t) {
    case at::kFloat: return MPIDP_F32;
    case at::kDouble: return MPIDP_F64;
    case at::kBFloat16: return MPIDP_BF16;
    case at::kHalf: return MPIDP_F16;
    case at::kChar: return MPIDP_I8;
    case at::kByte: return MPIDP_U8;
    case at::kShort: return MPIDP_I16;
    case at::kInt: return MPIDP_I32;
    case at::kLong: return MPIDP_I64;
    case at::kBool: return MPIDP_BOOL;
    default: return -1;
    }
}

/* A host tensor the fast path can hand the core (through a contiguous copy
 * where it is strided): decided by what the ranks' check compares (dtype,
 * shape, device, layout), so that ranks that passed the same take the
 * same path. */
inline bool host_tensor(const at::Tensor &t)
{
    return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided &&
           core_dtype(t.scalar_type()) >= 0 && t.numel() > 0;
}

/* The devices of a call's tensors, gathered from tensors, lists and lists
 * of lists: more than one is an error the backend raises. */
inline void add_devices(std::vector<c10::Device> &seen, const at::Tensor &t)
{
    if (!t.defined()) return;
    for (const auto &d : seen)
        if (d == t.device()) return;
    seen.push_back(t.device());
}
inline void add_devices(std::vector<c10::Device> &seen, const std::vector<at::Tensor> &ts)
{
    for (const auto &t : ts) add_devices(seen, t);
}
inline void add_devices(std::vector<c10::Device> &seen,
                        const std::vector<std::vector<at::Tensor>> &tss)
{
    for (const auto &ts : tss) add_devices(seen, ts);
}
template <typename T> inline void add_devices(std::vector<c10::Device> &, const T &) {}

inline mpidp_tensor_t core_tensor(const at::Tensor &t)
{
    mpidp_tensor_t c{};
    c.data = t.data_ptr();
    c.numel = static_cast<size_t>(t.numel());
    c.dtype = static_cast<mpidp_dtype_t>(core_dtype(t.scalar_type()));
    c.device = MPIDP_DEV_CPU;
    c.device_id = 0;
    c.read_only = 0;
    return c;
}

/* FNV-1a, for the signature's names and shapes (the same on every rank). */
inline int64_t fnv(const void *data, size_t n, uint64_t h = 1469598103934665603ull)
{
    const unsigned char *p = static_cast<const unsigned char *>(data);
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<int64_t>(h >> 2);     /* within (-2^63, 2^63): every negation exists */
}

/* The Work of a call the Python group ran: its Python MPIDPWork behind
 * torch's C++ Work interface, every question forwarded to it (torch's own
 * PyWorkHolder forwards only wait and the future, not a receive's source
 * rank, completion or result). */
class PythonWork : public Work {
  public:
    explicit PythonWork(pybind11::object work)
        : work_(work.cast<intrusive_ptr<Work>>()), py_(std::move(work))
    {
    }
    ~PythonWork() override
    {
        pybind11::gil_scoped_acquire gil;
        py_ = pybind11::object();
    }
    bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }
    intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }
    bool isCompleted() override { return call("is_completed").cast<bool>(); }
    int sourceRank() const override { return call("_source_rank").cast<int>(); }
    std::vector<at::Tensor> result() override
    {
        return call("result").cast<std::vector<at::Tensor>>();
    }

  private:
    pybind11::object call(const char *method) const
    {
        pybind11::gil_scoped_acquire gil;
        try {
            return py_.attr(method)();
        } catch (pybind11::error_already_set &e) {
            e.restore();
            throw python_error();
        }
    }

    intrusive_ptr<Work> work_;
    pybind11::object py_;
};

}  // namespace mpidp_c10d
