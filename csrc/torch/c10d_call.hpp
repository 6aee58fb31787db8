/* A fast-path collective of the C++ "mpidp" backend (csrc/torch/c10d_backend.cpp)
 * from its post to its end: the group's state that its calls share, the
 * Work torch hands the program, and the progress thread that ends the calls
 * whose futures nobody waits for.
 *
 * A call is posted on the caller's thread. A blocking one (asyncOp false)
 * is then waited for there; a non-blocking one returns once posted (after
 * the ranks' check, an exchange with every rank for a call it does not
 * predict), and ends in
 * whichever comes first: its Work's wait, a test of it (isCompleted), the
 * group's next call, or the progress thread, once somebody asked for its
 * future (DDP and torch.futures wait on futures, never on the Work).
 *
 * Why the group's next call ends it: the ranks' check (mpidp/callcheck.h)
 * learns that a predicted call held only when it completes, and must know
 * before the next call begins; so a group has at most one call in flight,
 * and a rank is never more than one call ahead of another. A failure found
 * there is raised by that next call, since this rank cannot go on. */
#pragma once

#include <Python.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../py/c10d_api.h"
#include "c10d_signature.hpp"

namespace mpidp_c10d {

/* mpidp._C's table, set when mpidp._c10d is imported. */
inline const mpidp_c10d_api_t *api = nullptr;

/* The Python exception that `set` sets (GIL held), kept to be raised on any
 * thread, any number of times: a Work's wait, its future, the next call. */
template <typename Set> std::exception_ptr python_exception(Set &&set)
{
    pybind11::gil_scoped_acquire gil;
    set();
    python_error e;
    e.persist();
    return std::make_exception_ptr(std::move(e));
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

class CallWork;

/* A group's sequence of calls, shared by its backend and its calls in
 * flight (which may outlive the backend). */
struct GroupState {
    GroupState(int size, std::vector<int> global) : size(size), global(std::move(global)) {}
    ~GroupState()
    {
        if (check != nullptr && !api->forked()) api->check_free(check);
    }

    /* The ranks' check and MPI's part of the calls: one thread at a time. */
    std::mutex mu;
    /* A program's thread is in a call on this group (torch makes a group's
     * calls from one thread at a time; two at once is the program's error). */
    std::atomic<bool> calling{false};
    void *check = nullptr; /* none at 1 rank or unchecked */
    /* The last non-blocking call, until it ended (a cycle with its group,
     * broken when it ends). */
    c10::intrusive_ptr<CallWork> in_flight;
    std::atomic<const char *> closed{nullptr}; /* how the group ended (shutdown, abort) */
    /* Set once the ranks' sequences of calls can no longer be matched (see
     * differences); out_of_step_why is written before, never after. */
    std::atomic<bool> out_of_step{false};
    std::string out_of_step_why;
    const int size;
    const std::vector<int> global; /* the ranks in the default group; empty: it is that group */

    /* After the ranks were found to differ (mu held: the rows last until
     * the next call): the message every rank raises.
     *
     * A rank that had posted the call without waiting and learnt of the
     * difference only when its next call ended it (its row says LATE) does
     * not make that next call, while the ranks that found out at once make
     * theirs: from then on each rank's call k would pair with another's call
     * k+1 and reduce the wrong tensors without an error. So every rank, on
     * the same rows, marks the group out of step, and every later call on
     * it raises. */
    std::string differences(const std::string &call)
    {
        const int64_t *rows = api->check_rows(check);
        std::string message =
            "mpidp backend: " + call + ": the ranks' calls differ, and every rank must make the "
            "same call with tensors of the same shape, dtype and device and the same settings: " +
            describe_ranks(rows, size, global, [](const int64_t *sig) {
                return describe(sig, api->op_sum, api->op_avg, api->op_min, api->op_max,
                                api->op_prod);
            });
        std::vector<int> late;
        for (int r = 0; r < size; r++)
            if (rows[static_cast<size_t>(r) * MPIDP_C10D_ROW + MPIDP_C10D_POSTED] ==
                MPIDP_C10D_LATE)
                late.push_back(r);
        if (late.empty()) return message;
        message += ". " + name_ranks(late, global) + " had posted the call without waiting for "
                   "it and learnt of this only at their next call on the group, which they did "
                   "not make: the ranks' calls can no longer be paired, so every later call on "
                   "this group raises; make a new group (dist.new_group)";
        if (!out_of_step.load()) {
            out_of_step_why = message;
            out_of_step.store(true);
        }
        return message;
    }
};

/* Waits without the GIL, where this thread holds it: the thread that ends a
 * call may need it to raise the call's failure. */
template <typename Wait> void without_gil(Wait &&wait)
{
    if (PyGILState_Check()) {
        pybind11::gil_scoped_release nogil;
        wait();
    } else {
        wait();
    }
}

void end_in_background(c10::intrusive_ptr<CallWork> work);

/* One posted fast-path call. Made before it is posted, so that its
 * profiling title ("mpidp:<call>", a literal) spans the call in
 * torch.profiler's trace. */
class CallWork : public c10d::Work {
  public:
    CallWork(std::shared_ptr<GroupState> group, int rank, c10d::OpType type, const char *title,
             std::vector<at::Tensor> result, std::vector<Contiguous> tensors, double timeout_s)
        : Work(rank, type, title), group_(std::move(group)), title_(title),
          result_(std::move(result)), tensors_(std::move(tensors)), timeout_s_(timeout_s)
    {
    }

    void posted(mpidp_c10d_pending_t *pending) { pending_ = pending; }

    /* With the group's lock held: progress on the call (block: until it
     * ends). True when this ended it: conclude() next, on this thread (the
     * failure's detail is this thread's), after unlocking. The caller holds
     * a reference: the group's own goes here. */
    bool settle(bool block, double timeout_s = -1, bool late = false)
    {
        if (pending_ == nullptr) return false;
        int done = 0, ended = 1, differ = 0;
        status_ = api->finish(pending_, block, late, timeout_s > 0 ? timeout_s : timeout_s_,
                              &done, &ended, &differ);
        if (!done) return false;
        pending_ = nullptr;
        if (!ended)
            for (const auto &t : tensors_) t.leak();
        if (status_ == 0 && differ) {
            differences_ = group_->differences(call());
            if (differ == MPIDP_C10D_DIFFER_WRITTEN)
                differences_ += ". On this rank the call's output holds its result over the "
                                "ranks that made it: only outputs up to 16 KB are copied "
                                "before a call, to be put back";
        }
        if (group_->in_flight.get() == this) group_->in_flight.reset();
        return true;
    }

    /* After settle ended it, without the group's lock: its outcome, for its
     * Work and its future. */
    void conclude()
    {
        std::exception_ptr error;
        if (status_ != 0) {
            std::string what = "mpidp backend: " + call();
            error = python_exception([&] { api->raise(status_, what.c_str()); });
        } else if (!differences_.empty()) {
            error = python_exception([&] { PyErr_SetString(PyExc_ValueError, differences_.c_str()); });
        } else {
            for (auto &t : tensors_) t.copy_back();
        }
        c10::intrusive_ptr<c10::ivalue::Future> future;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            error_ = error;
            concluded_ = true;
            future = future_;
        }
        finish(error);
        if (future) complete(future);
    }

    /* Ends the call on this thread, or waits until the thread ending it
     * has concluded. late: as part of the group's next call. */
    void end(double timeout_s = -1, bool late = false)
    {
        if (concluded()) return;
        c10::intrusive_ptr<CallWork> self = c10::intrusive_ptr<CallWork>::reclaim_copy(this);
        bool mine = false;
        without_gil([&] {
            std::lock_guard<std::mutex> lock(group_->mu);
            mine = settle(true, timeout_s, late);
        });
        if (mine) {
            conclude();
            return;
        }
        without_gil([&] {
            std::unique_lock<std::mutex> lock(mutex_);
            cv_.wait(lock, [&] { return completed_; });
        });
    }

    bool wait(std::chrono::milliseconds timeout) override
    {
        end(timeout == ::kNoTimeout ? -1 : static_cast<double>(timeout.count()) / 1000.0);
        std::exception_ptr error = this->error();
        if (error) std::rethrow_exception(error);
        return true;
    }

    bool isCompleted() override
    {
        if (concluded()) return true;
        bool mine = false;
        {
            std::unique_lock<std::mutex> lock(group_->mu, std::try_to_lock);
            if (!lock.owns_lock()) return false; /* another thread is at it */
            c10::intrusive_ptr<CallWork> self = c10::intrusive_ptr<CallWork>::reclaim_copy(this);
            mine = settle(false);
            lock.unlock();
            if (mine) conclude();
        }
        return Work::isCompleted();
    }

    std::vector<at::Tensor> result() override { return result_; }

    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override
    {
        bool now;
        c10::intrusive_ptr<c10::ivalue::Future> future;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (future_) return future_;
            future_ = c10::make_intrusive<c10::ivalue::Future>(
                c10::ListType::create(c10::TensorType::get()));
            future = future_;
            now = concluded_;
        }
        if (now)
            complete(future);
        else
            end_in_background(c10::intrusive_ptr<CallWork>::reclaim_copy(this));
        return future;
    }

    /* The failure it ended with (null: none, or not yet ended). */
    std::exception_ptr error() const
    {
        std::lock_guard<std::mutex> lock(mutex_);
        return error_;
    }
    bool concluded() const
    {
        std::lock_guard<std::mutex> lock(mutex_);
        return concluded_;
    }
    /* Its name in torch's words ("all_reduce"). */
    std::string call() const { return title_ + sizeof("mpidp:") - 1; }

  private:
    void complete(const c10::intrusive_ptr<c10::ivalue::Future> &future)
    {
        std::exception_ptr error = this->error();
        if (error)
            future->setError(error);
        else
            future->markCompleted(c10::IValue(result_));
    }

    std::shared_ptr<GroupState> group_;
    const char *title_;
    std::vector<at::Tensor> result_;
    std::vector<Contiguous> tensors_; /* what MPI reads and writes */
    double timeout_s_;
    mpidp_c10d_pending_t *pending_ = nullptr; /* null once ended; group_->mu guards it */
    int status_ = 0;
    std::string differences_;
    /* Work::mutex_ guards these. */
    bool concluded_ = false;
    std::exception_ptr error_;
    c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/* The thread that ends, in the order they were posted, the calls whose
 * futures were asked for: started with the first of them, and stopped at
 * the interpreter's exit (before MPI is finalized), after the call it is
 * ending. Its waits are the calls' own, with their deadlines. */
class Progress {
  public:
    static Progress &get()
    {
        static Progress *p = new Progress; /* never destroyed: its thread is detached */
        return *p;
    }

    void add(c10::intrusive_ptr<CallWork> work)
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) return; /* exiting: the program's own waits end it */
        queue_.push_back(std::move(work));
        if (!running_) {
            running_ = true;
            std::thread([this] { run(); }).detach();
        }
        cv_.notify_all();
    }

    /* At exit: stops the thread once the call it is ending has ended. */
    void stop()
    {
        std::unique_lock<std::mutex> lock(mu_);
        stopping_ = true;
        cv_.notify_all();
        cv_.wait(lock, [&] { return !running_; });
    }

  private:
    void run()
    {
        for (;;) {
            c10::intrusive_ptr<CallWork> work;
            {
                std::unique_lock<std::mutex> lock(mu_);
                cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
                if (stopping_) {
                    queue_.clear();
                    running_ = false;
                    cv_.notify_all();
                    return;
                }
                work = std::move(queue_.front());
                queue_.pop_front();
            }
            work->end(); /* its failure goes to its future */
        }
    }

    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<c10::intrusive_ptr<CallWork>> queue_;
    bool running_ = false, stopping_ = false;
};

inline void end_in_background(c10::intrusive_ptr<CallWork> work)
{
    Progress::get().add(std::move(work));
}

}  // namespace mpidp_c10d
