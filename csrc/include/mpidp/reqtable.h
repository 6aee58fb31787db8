/* The in-flight request table.
 *
 * Every non-blocking MPI operation mpidp posts is registered here with a short
 * description, so that (1) every wait has a deadline and a timeout can say
 * exactly what was pending, (2) one call can progress everything in flight
 * (Open MPI advances non-blocking collectives only inside MPI calls), and (3)
 * process exit can finish all pending work before MPI_Finalize, so no request
 * is ever left posted with its buffer freed.
 *
 * Handles carry a generation number: once a request completes its slot is
 * reused, and a stale handle simply reads as "completed".
 *
 * Thread safety: every function may be called from any thread; a mutex guards
 * the slots, and MPI calls made under it need MPI_THREAD_SERIALIZED or better
 * when more than one thread uses mpidp. Waits never hold the mutex while
 * backing off. */
#ifndef MPIDP_REQTABLE_H
#define MPIDP_REQTABLE_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

typedef struct mpidp_reqtable mpidp_reqtable_t;

typedef struct {
    uint32_t slot;
    uint32_t gen;   /* 0 never names a live request */
} mpidp_req_t;

#define MPIDP_REQ_NONE ((mpidp_req_t){0, 0})
#define MPIDP_REQ_WHAT_LEN 96

/* Creates a table with room for `capacity` requests in flight. */
int mpidp_reqtable_create(size_t capacity, mpidp_reqtable_t **out);
/* Frees the table. Returns MPIDP_ESTATE (and frees nothing) while requests
 * are still pending: wait for them first. */
int mpidp_reqtable_destroy(mpidp_reqtable_t *t);

/* Registering a request takes two steps around posting it (core/mpi_util.h
 * has the helper the core posts through), so that a full table is found out
 * before anything is posted:
 *   claim:   reserve a slot; MPIDP_EFULL (with a detail naming `what` and the
 *            table's size) when none is free, and the caller posts nothing;
 *   fill:    the operation was posted: the slot now tracks `req`, described
 *            by `what` (copied, truncated to MPIDP_REQ_WHAT_LEN);
 *   unclaim: posting failed: the slot is free again.
 * The handle returned by claim names the request once filled. */
int mpidp_reqtable_claim(mpidp_reqtable_t *t, const char *what, mpidp_req_t *out);
void mpidp_reqtable_fill(mpidp_reqtable_t *t, mpidp_req_t h, MPI_Request req, MPI_Comm comm,
                         const char *what);
void mpidp_reqtable_unclaim(mpidp_reqtable_t *t, mpidp_req_t h);
/* For a receive: between claim and fill, asks that completion write the
 * sender's rank (MPI_SOURCE) into *source, which must stay valid until the
 * request has completed; whichever thread's test or progress completes it
 * writes it, so a receive from any source learns whom it heard. */
void mpidp_reqtable_set_source(mpidp_reqtable_t *t, mpidp_req_t h, int *source);

/* Tests one request without blocking; *done = 1 when it has completed (now or
 * earlier). An MPI error completes the request and returns MPIDP_EMPI. */
int mpidp_reqtable_test(mpidp_reqtable_t *t, mpidp_req_t h, int *done);

/* Waits for one request for at most `timeout_s` seconds (<= 0: no limit).
 * Returns MPIDP_ETIMEDOUT, with a detail listing everything still pending,
 * when the deadline passes; the request then stays registered. Returns
 * MPIDP_EDEPARTED, naming the rank, when a rank of the request's
 * communicator has ended its program (mpidp/departures.h) and the request
 * has not completed within the departure grace since both that and the
 * start of the wait. */
int mpidp_reqtable_wait(mpidp_reqtable_t *t, mpidp_req_t h, double timeout_s);

/* Waits until poll(arg, &done) sets done (or fails: its status), with the
 * deadline, the departures' check (over every pending request) and the
 * backoff of mpidp_reqtable_wait: a wait on something besides one request --
 * an engine's operation together with a message that would interrupt it. */
typedef int (*mpidp_reqtable_poll_fn)(void *arg, int *done);
int mpidp_reqtable_wait_until(mpidp_reqtable_t *t, mpidp_reqtable_poll_fn poll, void *arg,
                              double timeout_s);

/* Waits for every pending request, as mpidp_reqtable_wait does for one. */
int mpidp_reqtable_wait_all(mpidp_reqtable_t *t, double timeout_s);

/* How long a wait spins, testing and yielding the core, before it sleeps
 * 100 us between tests. Spinning keeps a transfer that both sides drive at
 * full speed (MPI progresses only inside MPI calls: sleeping from the start
 * made a 45 MB allreduce crawl); but where a node's ranks share its cores, a
 * spinning rank takes the core from the peer it waits for -- the scheduler
 * counts spinners as load, so two can share one core while the ranks they
 * wait for share the other -- and sched_yield does not reliably hand the
 * core over (a 2 s spin stalled DDP's gloo threads for exactly 2 s). So:
 * MPIDP_SPIN_SECONDS by default; MPIDP_SPIN_SHARED_CORES_SECONDS where the
 * cores are shared (on the emulated 2-node cluster, 4 ranks on 2 cores:
 * DASO's ranks spent ~4,500 profile samples in the kernel instead of
 * ~17,000, and its blocking warm-up and cool-down epochs took 5-10% less
 * time; on 2 ranks with a core each, 64 MB allreduces were 5-10% slower
 * with the short spin, hence two values). A new table takes the value from
 * MPI's own word on sharing (its mpi_yield_when_idle setting) when MPI is
 * initialized; the glue sets MPIDP_WAIT_SPIN_MS over it. Values < 0 read
 * as 0. */
#define MPIDP_SPIN_SECONDS 0.02
#define MPIDP_SPIN_SHARED_CORES_SECONDS 0.003
void mpidp_reqtable_set_spin(mpidp_reqtable_t *t, double seconds);
double mpidp_reqtable_spin(mpidp_reqtable_t *t);

/* Calls MPI_Test on every pending request once so that MPI progresses them;
 * *n_done (may be NULL) counts the requests that completed. */
int mpidp_reqtable_progress(mpidp_reqtable_t *t, size_t *n_done);

/* Number of requests in flight. */
size_t mpidp_reqtable_pending(mpidp_reqtable_t *t);

/* Writes a one-line-per-request description of what is pending (op and age in
 * seconds) into buf, always NUL-terminated. */
void mpidp_reqtable_describe(mpidp_reqtable_t *t, char *buf, size_t len);

/* Monotonic seconds, for deadlines. */
double mpidp_now(void);

/* Engines with stages that start only when earlier messages have arrived
 * (the quantized allreduce's gather) register a progress function here. Every
 * wait of the table (mpidp_reqtable_wait, _wait_all) and every
 * mpidp_reqtable_progress call runs them, so a rank blocked on one
 * operation still advances the others that its peers may be waiting on: no
 * two ranks can wait on each other's unstarted stages, whatever order they
 * wait in. Each runs under the table's lock, which is recursive: it may test
 * and post requests (not wait) and remove engines, and a removal on another
 * thread waits until it has returned, so an engine is never run after its
 * owner removed it (the C++ gradient hook progresses without the GIL). Its
 * errors are its own operation's to report.
 * At most MPIDP_REQTABLE_ENGINES at once: add fails with MPIDP_EFULL. */
#define MPIDP_REQTABLE_ENGINES 256
typedef void (*mpidp_reqtable_engine_fn)(void *ctx);
int mpidp_reqtable_engine_add(mpidp_reqtable_t *t, mpidp_reqtable_engine_fn fn, void *ctx);
void mpidp_reqtable_engine_remove(mpidp_reqtable_t *t, void *ctx);

#endif /* MPIDP_REQTABLE_H */
