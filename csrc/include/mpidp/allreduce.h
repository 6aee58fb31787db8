/* Chunked allreduce of one tensor, optionally compressed to bf16/fp16 on the
 * wire.
 *
 * Uncompressed, the tensor is reduced in place (float32/float64 with MPI_SUM,
 * bfloat16/float16 with mpidp's native half sum op). Compressed (a float32
 * tensor, wire bf16 or fp16), each chunk is packed into a 16-bit wire buffer
 * -- scaled by 1/size in the same pass for "avg" -- reduced with the native
 * half sum op, and, unless the caller keeps the wire result, unpacked back.
 *
 * At most `max_in_flight` chunks are posted at once, so the wire copy takes
 * max_in_flight * chunk_elems 16-bit elements however large the tensor is;
 * further chunks are posted as earlier ones complete, which happens inside
 * mpidp_allreduce_test()/wait(). max_in_flight = 0 posts every chunk at once
 * (DASO's asynchronous sync: nothing calls back until it is received).
 *
 * wire = MPIDP_U8 (a float32 sum or average) runs the 8-bit quantized engine
 * of mpidp/qallreduce.h instead, with its own segmenting: chunk_elems and
 * max_in_flight do not apply, and keep_wire is refused. */
#ifndef MPIDP_ALLREDUCE_H
#define MPIDP_ALLREDUCE_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#include "mpidp/mpiops.h"
#include "mpidp/reqtable.h"
#include "mpidp/tensor.h"

typedef struct {
    int op;               /* mpidp_op_t (mpidp/mpiops.h); min/max/prod: uncompressed only */
    int wire;             /* MPIDP_BF16 / MPIDP_F16 / MPIDP_U8 to compress a float32
                           * tensor; -1: none */
    size_t chunk_elems;   /* elements per MPI call, 1 .. INT_MAX */
    size_t max_in_flight; /* chunks posted at once; 0: all */
    int keep_wire;        /* 1: leave the summed wire buffer for the caller, do not unpack */
    double drain_timeout_s; /* when posting a chunk fails (a full request table), the
                             * chunks already posted are waited for this long before
                             * start returns the failure (<= 0: no limit) */
    const char *what;     /* for messages, e.g. "mpidp.allreduce" */
} mpidp_allreduce_opts_t;

typedef struct mpidp_allreduce mpidp_allreduce_t;

/* Elements per MPI call of a compressed allreduce, and chunks in flight: the
 * wire copy stays at 2 x 8 MiB however large the tensor. Uncompressed tensors
 * are reduced in place, in chunks of up to 2^30 elements (MPI counts are int),
 * all posted at once. */
#define MPIDP_ALLREDUCE_WIRE_CHUNK ((size_t)1 << 22)
#define MPIDP_ALLREDUCE_WIRE_IN_FLIGHT 2
#define MPIDP_ALLREDUCE_PLAIN_CHUNK ((size_t)1 << 30)

/* The options of a one-off allreduce of a tensor of dtype `dtype` (the
 * chunking above; the wire result is unpacked): returns them with `op`,
 * `wire`, `drain_timeout_s` and `what` filled in. */
mpidp_allreduce_opts_t mpidp_allreduce_default_opts(int dtype, int op, int wire,
                                                    double drain_timeout_s, const char *what);

/* Starts reducing `t` (a CPU tensor that must stay alive and untouched until
 * completion) and posts the first chunks. Fails with MPIDP_EINVAL/MPIDP_EDTYPE
 * for bad options (with a detail), MPIDP_ENOMEM, MPIDP_EMPI. */
int mpidp_allreduce_start(MPI_Comm comm, const mpidp_tensor_t *t,
                          const mpidp_allreduce_opts_t *opts, mpidp_reqtable_t *reqs,
                          mpidp_allreduce_t **out);

/* Progresses without blocking: completes finished chunks (unpacking them)
 * and posts the next ones. *done = 1 once every chunk has completed. */
int mpidp_allreduce_test(mpidp_allreduce_t *x, int *done);

/* Blocks until done; `timeout_s` bounds each wait for progress (<= 0: none). */
int mpidp_allreduce_wait(mpidp_allreduce_t *x, double timeout_s);

/* With keep_wire: the summed 16-bit wire buffer of the whole tensor (valid
 * once done, until free). NULL otherwise. */
const uint16_t *mpidp_allreduce_wire(const mpidp_allreduce_t *x);

/* Frees `x`. MPIDP_ESTATE (and nothing freed) while chunks are in flight. */
int mpidp_allreduce_free(mpidp_allreduce_t *x);

#endif /* MPIDP_ALLREDUCE_H */
