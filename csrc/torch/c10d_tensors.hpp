/* torch tensors as the C++ "mpidp" backend hands them to the core
 * (csrc/torch/c10d_backend.cpp): the core's dtype codes and tensor views,
 * which tensors the fast path takes, the devices of a call, and a
 * contiguous stand-in for a strided tensor. */
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "mpidp/tensor.h"

namespace mpidp_c10d {

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

/* A tensor the core reads or writes: contiguous as it is, or a contiguous
 * copy whose values go back to it once the call ended (outputs). */
class Contiguous {
  public:
    explicit Contiguous(const at::Tensor &t) : t_(t), c_(t.is_contiguous() ? t : t.contiguous())
    {
    }
    const at::Tensor &get() const { return c_; }
    void copy_back()
    {
        if (!c_.is_same(t_)) t_.copy_(c_);
    }
    /* MPI may still write it (a failure left the call in flight): never freed. */
    void leak() const { new at::Tensor(c_); }

  private:
    at::Tensor t_, c_;
};

}  // namespace mpidp_c10d
