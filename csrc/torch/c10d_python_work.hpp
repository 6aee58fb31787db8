/* The Work of a call that the C++ "mpidp" backend hands to its Python group
 * (csrc/torch/c10d_backend.cpp). */
#pragma once

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <utility>
#include <vector>

namespace mpidp_c10d {

using c10::intrusive_ptr;
using c10d::Work;

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
