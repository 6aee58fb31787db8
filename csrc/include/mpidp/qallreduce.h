/* The 8-bit quantized allreduce: a float32 tensor summed (or averaged) over a
 * communicator with about a quarter of the bytes of a float32 allreduce.
 *
 * Scatter-gather over the 8-bit block format of mpidp/quant8.h, per segment
 * of the tensor (at most MPIDP_QALLREDUCE_SEGMENT elements, so the buffers
 * stay bounded however large the tensor):
 *
 *   1. quantize the segment as P chunks (P = the communicator's size; chunk r
 *      is what rank r reduces; chunks are whole blocks, the last ones padded
 *      with zero blocks) and MPI_Ialltoall them;
 *   2. decode the P versions of the own chunk and sum them in rank order
 *      0..P-1 (so the sum does not depend on which message came first),
 *      scale by 1/P for an average, requantize, and MPI_Iallgather;
 *   3. decode every chunk, the own one included, into the tensor.
 *
 * Every rank therefore ends with the same bits. Each element is quantized
 * twice, so its error is at most half a step of its block on each rank's
 * input plus half a step of the summed block. A block in which some rank had
 * a NaN or an infinity decodes to NaN on every rank.
 *
 * Non-blocking like mpidp_allreduce_*: start posts the first segments' first
 * phase; test progresses (decoding, requantizing and posting the next phase
 * or segment as messages arrive); wait blocks with a deadline per step. Every
 * request goes through the request table. mpidp_allreduce_start with
 * wire = MPIDP_U8 runs this engine, so callers normally use that API. */
#ifndef MPIDP_QALLREDUCE_H
#define MPIDP_QALLREDUCE_H

#include <mpi.h>
#include <stddef.h>

#include "mpidp/reqtable.h"
#include "mpidp/tensor.h"

/* Elements per segment and segments in flight: buffers of about 3 bytes per
 * element of 2 segments, whatever the tensor's size. */
#define MPIDP_QALLREDUCE_SEGMENT ((size_t)1 << 22)
#define MPIDP_QALLREDUCE_IN_FLIGHT 2

typedef struct mpidp_qallreduce mpidp_qallreduce_t;

typedef struct {
    int average;            /* 1: divide the sum by the communicator's size */
    size_t segment_elems;   /* 0: MPIDP_QALLREDUCE_SEGMENT */
    size_t max_in_flight;   /* segments at once; 0: MPIDP_QALLREDUCE_IN_FLIGHT */
    double drain_timeout_s; /* as in mpidp_allreduce_opts_t */
    const char *what;       /* for messages */
} mpidp_qallreduce_opts_t;

/* Starts reducing `t` (a writable float32 host tensor that must stay alive
 * and untouched until completion). MPIDP_EINVAL / MPIDP_EDTYPE /
 * MPIDP_EDEVICE for a bad tensor or options, MPIDP_ENOMEM, MPIDP_EMPI,
 * MPIDP_EFULL (request table full; nothing left in flight). */
int mpidp_qallreduce_start(MPI_Comm comm, const mpidp_tensor_t *t,
                           const mpidp_qallreduce_opts_t *opts, mpidp_reqtable_t *reqs,
                           mpidp_qallreduce_t **out);
/* Progresses without blocking; *done = 1 once the tensor holds the result. */
int mpidp_qallreduce_test(mpidp_qallreduce_t *x, int *done);
/* Blocks until done; `timeout_s` bounds each wait for progress (<= 0: none). */
int mpidp_qallreduce_wait(mpidp_qallreduce_t *x, double timeout_s);
/* One request of x still in flight, or MPIDP_REQ_NONE: for a caller that
 * drives several engines and waits on whichever holds it up (the reducer's
 * hierarchical mode), without holding x across the wait. */
mpidp_req_t mpidp_qallreduce_pending(const mpidp_qallreduce_t *x);
/* Frees `x`. MPIDP_ESTATE (and nothing freed) while a message is in flight. */
int mpidp_qallreduce_free(mpidp_qallreduce_t *x);
/* Bytes this rank sends per element reduced (for benchmarks and logs):
 * 2 * (P - 1) / P * MPIDP_Q8_RECORD / MPIDP_Q8_BLOCK, padding aside. */
double mpidp_qallreduce_bytes_per_elem(int size);

#endif /* MPIDP_QALLREDUCE_H */
