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
 * there is raised by that next call, since this rank cannot go on.
 *
 * One word per step of a call's end: `progress` drives it in MPI (under the
 * group's lock; true once MPI has ended it), `publish` hands its outcome to
 * its Work and its future (whose callbacks run there, on the publishing
 * thread), `end` is both on this thread or a wait for the thread doing
 * them. `finish` and `markCompleted` are torch's (the Work's and the
 * future's own), called by publish alone. */
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
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../py/c10d_api.h"
#include "c10d_signature.hpp"
#include "c10d_tensors.hpp"

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
    /* The last fast call, until its future's callbacks have run (they may
     * make calls on the group, which come before the program's next). */
    std::mutex last_mu;
    c10::intrusive_ptr<CallWork> last;
    void set_last(const c10::intrusive_ptr<CallWork> &work);
    c10::intrusive_ptr<CallWork> last_call();
    bool callbacks_ran(); /* those of last's future, or they run on this thread */
    std::atomic<const char *> closed{nullptr}; /* how the group ended (shutdown, abort) */
    /* Set once a later call could pair with the wrong call of another rank
     * (the ranks went out of step, see differences; a call timed out and
     * is still posted): every later call raises, saying why. */
    std::atomic<bool> unusable{false};
    std::string unusable_why; /* written once, before unusable is set */
    std::mutex unusable_mu;
    void refuse_later(const std::string &why)
    {
        std::lock_guard<std::mutex> lock(unusable_mu);
        if (unusable.load()) return;
        unusable_why = why;
        unusable.store(true);
    }
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
        refuse_later("the ranks' calls went out of step at an earlier call, which raised: " +
                     message);
        return message;
    }
};

/* Why a group is refused after its `call` failed and was left posted. */
inline std::string left_posted(const std::string &call)
{
    return "an earlier " + call + " on it failed (timed out, or a rank it needs ended) and is "
           "still posted in MPI, so a later call would pair with it on the ranks that make one; "
           "make a new group (dist.new_group, or shrink_group in fault-tolerant mode)";
}

/* A deadline in seconds as a duration (<= 0: a year, a program's lifetime). */
inline std::chrono::duration<double> seconds(double timeout_s)
{
    return std::chrono::duration<double>(timeout_s > 0 ? timeout_s : 365.0 * 86400.0);
}

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

/* The threads now running the callbacks of a fast call's future, of any
 * group: a program's next call waits until none is (its calls come after
 * theirs: see Entered), except on such a thread itself -- callbacks that
 * run side by side are ordered by the program that made them, as on gloo. */
class CallbackThreads {
  public:
    static CallbackThreads &get()
    {
        static CallbackThreads *t = new CallbackThreads; /* never destroyed */
        return *t;
    }
    void enter()
    {
        std::lock_guard<std::mutex> lock(mu_);
        running_[std::this_thread::get_id()]++;
    }
    void leave()
    {
        {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = running_.find(std::this_thread::get_id());
            if (it != running_.end() && --it->second == 0) running_.erase(it);
        }
        cv_.notify_all();
    }
    /* Until no other thread runs callbacks (at once on one that does);
     * false where the deadline passed first. */
    bool wait_for_others(double timeout_s)
    {
        std::unique_lock<std::mutex> lock(mu_);
        if (running_.count(std::this_thread::get_id())) return true;
        return cv_.wait_for(lock, seconds(timeout_s), [&] { return running_.empty(); });
    }
    bool none_elsewhere()
    {
        std::lock_guard<std::mutex> lock(mu_);
        return running_.empty() || running_.count(std::this_thread::get_id());
    }

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::map<std::thread::id, int> running_;
};

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

    void set_pending(mpidp_c10d_pending_t *pending) { pending_ = pending; }

    /* With the group's lock held: progress on the call (block: until it
     * ends). True when this ended it: publish() next, on this thread (the
     * failure's detail is this thread's), after unlocking. The caller holds
     * a reference: the group's own goes here. */
    bool progress(bool block, double timeout_s = -1, bool late = false)
    {
        if (pending_ == nullptr) return false;
        int done = 0, ended = 1, differ = 0;
        status_ = api->progress(pending_, block, late, timeout_s > 0 ? timeout_s : timeout_s_,
                              &done, &ended, &differ);
        if (!done) return false;
        pending_ = nullptr;
        if (!ended) {
            for (const auto &t : tensors_) t.leak();
            group_->refuse_later(left_posted(call()));
        }
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

    /* After progress ended it, without the group's lock: its outcome, for its
     * Work and its future, whose callbacks run here, on this thread. */
    void publish()
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
            published_ = true;
            publishing_ = std::this_thread::get_id();
            future = future_;
        }
        finish(error);
        if (future) {
            CallbackThreads::get().enter();
            fill_future(future);
            CallbackThreads::get().leave();
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            called_back_ = true;
        }
        cv_.notify_all();
        std::lock_guard<std::mutex> lock(group_->last_mu);
        if (group_->last.get() == this) group_->last.reset();
    }

    /* Whether the callbacks of its future have run, run on this thread, or
     * cannot be (nobody asked for its future). */
    bool called_back() const
    {
        std::lock_guard<std::mutex> lock(mutex_);
        return !future_ || called_back_ || publishing_ == std::this_thread::get_id();
    }

    /* Ends the call on this thread, or waits until the thread ending it
     * has published. late: as part of the group's next call, which also
     * waits for the callbacks of the call's future to have run (they may
     * make calls on the group, which come first: see Entered); false where
     * they were still running at the deadline. */
    bool end(double timeout_s = -1, bool late = false)
    {
        c10::intrusive_ptr<CallWork> self = c10::intrusive_ptr<CallWork>::reclaim_copy(this);
        if (progress_to_end(timeout_s, late)) {
            publish();
            return true;
        }
        bool ended = true;
        without_gil([&] {
            std::unique_lock<std::mutex> lock(mutex_);
            if (!late) {
                cv_.wait(lock, [&] { return completed_; }); /* published: at once */
                return;
            }
            /* The thread running the callbacks never waits for itself. */
            ended = cv_.wait_for(lock, seconds(timeout_s > 0 ? timeout_s : timeout_s_), [&] {
                return called_back_ || publishing_ == std::this_thread::get_id();
            });
        });
        return ended;
    }

    /* The part of end() that waits in MPI: true where this thread ended
     * the call and must publish() it. */
    bool progress_to_end(double timeout_s = -1, bool late = false)
    {
        if (published()) return false;
        c10::intrusive_ptr<CallWork> self = c10::intrusive_ptr<CallWork>::reclaim_copy(this);
        bool mine = false;
        without_gil([&] {
            std::lock_guard<std::mutex> lock(group_->mu);
            mine = progress(true, timeout_s, late);
        });
        return mine;
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
        if (published()) return true;
        bool mine = false;
        {
            std::unique_lock<std::mutex> lock(group_->mu, std::try_to_lock);
            if (!lock.owns_lock()) return false; /* another thread is at it */
            c10::intrusive_ptr<CallWork> self = c10::intrusive_ptr<CallWork>::reclaim_copy(this);
            mine = progress(false);
            lock.unlock();
            if (mine) publish();
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
            now = published_;
        }
        if (now)
            fill_future(future);
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
    bool published() const
    {
        std::lock_guard<std::mutex> lock(mutex_);
        return published_;
    }
    /* Its name in torch's words ("all_reduce"). */
    std::string call() const { return title_ + sizeof("mpidp:") - 1; }

  private:
    void fill_future(const c10::intrusive_ptr<c10::ivalue::Future> &future)
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
    bool published_ = false;
    bool called_back_ = false;   /* its future's callbacks have run (or it has none) */
    std::thread::id publishing_; /* the thread that published it */
    std::exception_ptr error_;
    c10::intrusive_ptr<c10::ivalue::Future> future_;
};

inline void GroupState::set_last(const c10::intrusive_ptr<CallWork> &work)
{
    std::lock_guard<std::mutex> lock(last_mu);
    last = work;
}

inline c10::intrusive_ptr<CallWork> GroupState::last_call()
{
    std::lock_guard<std::mutex> lock(last_mu);
    return last;
}

inline bool GroupState::callbacks_ran()
{
    c10::intrusive_ptr<CallWork> work = last_call();
    return !work || work->called_back();
}

/* The threads that end the calls whose futures were asked for (DDP's
 * reducer and torch.futures wait on the future, never on the Work), each
 * with the call's own wait and deadline.
 *
 * Ending a call completes its future, which runs the future's callbacks
 * on the ending thread, and a callback may make a collective and wait for
 * its future (torch's PowerSGD hook does, twice per bucket): a thread
 * inside a callback cannot end the call it waits for. So any number of
 * threads take calls from the queue: one is started whenever a call is
 * queued and none is free, so there is always a thread to end the calls
 * that callbacks wait for, at any depth. A thread back from its call waits
 * for the next; beyond MAX_IDLE free ones it ends. They stop at the
 * interpreter's exit (before MPI is finalized), after the calls they are
 * ending. */
class Progress {
  public:
    static Progress &get()
    {
        static Progress *p = new Progress; /* never destroyed: its threads are detached */
        return *p;
    }

    void add(c10::intrusive_ptr<CallWork> work)
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) return; /* exiting: the program's own waits end it */
        queue_.push_back(std::move(work));
        if (idle_ < queue_.size()) {
            threads_++;
            idle_++;
            std::thread([this] { run(); }).detach();
        }
        cv_.notify_one();
    }

    /* At exit: stops the threads once the calls they are ending have
     * ended (each by its deadline). A thread inside a future's callback is
     * the program's and is not waited for. */
    void stop()
    {
        std::unique_lock<std::mutex> lock(mu_);
        stopping_ = true;
        queue_.clear();
        cv_.notify_all();
        cv_.wait(lock, [&] { return ending_ == 0; });
    }

  private:
    static constexpr size_t MAX_IDLE = 2;

    void run()
    {
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (stopping_) break;
            c10::intrusive_ptr<CallWork> work = std::move(queue_.front());
            queue_.pop_front();
            idle_--;
            ending_++;
            lock.unlock();
            bool mine = work->progress_to_end(); /* its failure goes to its future */
            lock.lock();
            ending_--;
            cv_.notify_all();
            lock.unlock();
            if (mine)
                work->publish(); /* the future's callbacks run here */
            else
                work->end();      /* another thread ended it: at once */
            work.reset();
            lock.lock();
            idle_++;
            if (idle_ > MAX_IDLE && queue_.empty()) break;
        }
        idle_--;
        threads_--;
        cv_.notify_all();
    }

    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<c10::intrusive_ptr<CallWork>> queue_;
    size_t threads_ = 0, idle_ = 0; /* idle_: waiting for a call (or about to) */
    size_t ending_ = 0;             /* waiting in MPI for a call's end */
    bool stopping_ = false;
};

inline void end_in_background(c10::intrusive_ptr<CallWork> work)
{
    Progress::get().add(std::move(work));
}

}  // namespace mpidp_c10d
