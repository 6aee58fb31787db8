/* Device collectives: reductions, broadcasts and gathers over a
 * communicator of buffers that live in device memory, done where they live.
 *
 * A device communicator is made from an MPI communicator, one per process
 * group, and has one of two transports:
 *
 *   NCCL      every rank has a GPU of its own. libnccl and the CUDA runtime
 *             are those the caller's process already loaded (torch's); their
 *             paths are given and only their C entry points are used, so
 *             mpidp needs neither at build time. Rank 0's unique id goes to
 *             the others over MPI (no TCP store), and the communicator is
 *             made non-blocking so that its set-up, like every operation,
 *             runs under a deadline and is aborted (ncclCommAbort) when a
 *             peer never comes.
 *   MPI       the MPI operation (MPI_Iallreduce, ...) on the buffers where
 *             they live, for an MPI that takes device pointers
 *             (mpidp_mpi_cuda_aware) where NCCL cannot serve (ranks sharing
 *             a GPU). MPI knows no streams: the caller
 *             posts only once the buffer is written, and reads it only after
 *             the wait.
 *   stand-in  the same MPI operation on buffers in host memory, for tests:
 *             the callers' ordering logic (what is posted when, what waits
 *             for what) runs on machines without a GPU.
 *
 * A watchdog thread (NCCL) aborts the communicator when an operation
 * outlives the deadline or NCCL reports an error, also while the host is
 * blocked in a CUDA synchronisation; the next call that reads the state
 * (a start, a wait, mpidp_devcomm_status) reports why.
 *
 * A collective is enqueued on the caller's stream (NCCL) and registered in
 * the request table like any MPI operation (as a generalized request that an
 * engine completes once a CUDA event recorded after the NCCL call has
 * passed): so each has a description and a deadline, and a wait that times
 * out names it. The caller orders later device work after it with its own
 * event; the request only says, on the host, when it is over.
 *
 * Not thread-safe beyond the request table's guarantees: one thread posts. */
#ifndef MPIDP_DEVCOMM_H
#define MPIDP_DEVCOMM_H

#include <mpi.h>
#include <stddef.h>

#include "mpidp/reqtable.h"

typedef struct mpidp_devcomm mpidp_devcomm_t;

typedef enum { MPIDP_DEVCOMM_NCCL = 1, MPIDP_DEVCOMM_STANDIN = 2, MPIDP_DEVCOMM_MPI = 3 } mpidp_devcomm_kind_t;

/* NCCL over `comm` (collective: every rank calls it). nccl_path and
 * cudart_path: the shared libraries already loaded in this process;
 * `device`: this rank's CUDA device, current on the calling thread.
 * MPIDP_ETIMEDOUT after `timeout_s` (the communicator is then aborted),
 * MPIDP_ENOTSUP when a library or entry point is missing, naming it. */
int mpidp_devcomm_create_nccl(MPI_Comm comm, mpidp_reqtable_t *reqs, const char *nccl_path,
                              const char *cudart_path, int device, double timeout_s,
                              mpidp_devcomm_t **out);

/* The stand-in, or MPI on the buffers where they live, over `comm` (not
 * collective). */
int mpidp_devcomm_create_standin(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_devcomm_t **out);
int mpidp_devcomm_create_mpi(MPI_Comm comm, mpidp_reqtable_t *reqs, mpidp_devcomm_t **out);

mpidp_devcomm_kind_t mpidp_devcomm_kind(const mpidp_devcomm_t *dc);

/* The library's version as NCCL codes it (2.28.9 -> 22809); 0 for the stand-in. */
int mpidp_devcomm_version(const mpidp_devcomm_t *dc);

/* One device collective. `count` counts elements of core dtype `dtype`:
 *   ALLREDUCE       send and recv hold count (send == recv: in place); op is
 *                   MPIDP_OP_SUM, _PROD, _MIN or _MAX
 *   BCAST           recv holds count, root's is sent (send unused)
 *   ALLGATHER       send holds count, recv count x size (rank r's at r x count)
 *   REDUCE_SCATTER  send holds count x size, recv count (the sum of every
 *                   rank's block `rank`); op as ALLREDUCE
 * send is read and recv written in stream order (NCCL), or between the start
 * and the wait (MPI, the stand-in). */
typedef enum {
    MPIDP_DEVOP_ALLREDUCE = 1,
    MPIDP_DEVOP_BCAST = 2,
    MPIDP_DEVOP_ALLGATHER = 3,
    MPIDP_DEVOP_REDUCE_SCATTER = 4,
} mpidp_devop_kind_t;

typedef struct {
    mpidp_devop_kind_t kind;
    const void *send;
    void *recv;
    size_t count;
    int dtype;
    int op;
    int root;
} mpidp_devop_t;

/* Starts `op` on `stream` (a cudaStream_t; ignored by MPI and the
 * stand-in), registered in the table as `what`; *out names it for
 * mpidp_devcomm_wait. Every rank starts the same operations in the same
 * order. After an abort every start fails with MPIDP_ESTATE; an op, dtype
 * or root the transport cannot take fails with MPIDP_EINVAL or
 * MPIDP_EDTYPE, naming it, before anything is posted. */
int mpidp_devcomm_start(mpidp_devcomm_t *dc, const mpidp_devop_t *op, void *stream,
                        const char *what, mpidp_req_t *out);

/* mpidp_devcomm_start of the in-place sum of `count` elements at `buf`
 * (DataParallel's gradient buckets). */
int mpidp_devcomm_allreduce_start(mpidp_devcomm_t *dc, void *buf, size_t count, int dtype,
                                  void *stream, const char *what, mpidp_req_t *out);

/* Waits for an operation started here (deadline `timeout_s`) and reports
 * how the communicator stands: MPIDP_OK, the wait's failure (the
 * communicator is then aborted) or the error NCCL reported. */
int mpidp_devcomm_wait(mpidp_devcomm_t *dc, mpidp_req_t req, double timeout_s);

/* Ends every operation in flight (NCCL: ncclCommAbort; the requests then
 * complete with an error) and refuses new ones. For a failed or timed-out
 * wait: the device work queued behind it can then finish instead of
 * hanging. */
void mpidp_devcomm_abort(mpidp_devcomm_t *dc);

/* MPIDP_OK, or (with its detail) why the communicator was aborted: the
 * watchdog's deadline, an error NCCL reported, a failed wait, the owner. */
int mpidp_devcomm_status(mpidp_devcomm_t *dc);

/* 1 after an abort. */
int mpidp_devcomm_aborted(const mpidp_devcomm_t *dc);

/* Waits (deadline `timeout_s`) for what is in flight, then frees; aborts
 * instead when the wait fails. */
void mpidp_devcomm_destroy(mpidp_devcomm_t *dc, double timeout_s);

#endif /* MPIDP_DEVCOMM_H */
