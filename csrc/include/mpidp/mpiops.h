/* MPI datatypes and the reduction op for 16-bit floats, and a sum of 8- and
 * 16-bit integers that wraps.
 *
 * MPI has no bf16 or fp16 datatype, so mpidp makes two of its own: committed
 * 2-byte types (MPI_Type_contiguous(2, MPI_BYTE)), distinct handles so that
 * the op can tell them apart, and one commutative user op that sums either
 * type with the dispatched sum_bf16 / sum_fp16 kernels (mpidp/pack.h): every
 * element is rounded once from the exact fp32 sum, and the result is
 * bit-identical on every rank whichever kernel path each one runs. Use the op
 * only with these two types, with MPI_Allreduce, MPI_Iallreduce,
 * MPI_Reduce and friends.
 *
 * MPI_SUM of 8- and 16-bit integers is not used at all: Open MPI 4.1's AVX op
 * component saturates them (int8 100 + 100 is 127 there, -56 in torch, numpy
 * and gloo), and only for the vectorised part of a buffer. The narrow-int
 * sum op wraps modulo 2^bits on every MPI, for MPI_INT8_T, MPI_UINT8_T,
 * MPI_INT16_T and MPI_UINT16_T only.
 *
 * Lifetime: the handles are created once per process, after MPI_Init, and are
 * never freed implicitly: freeing them after MPI_Finalize is erroneous, and
 * freeing them at interpreter exit could race with MPI_Finalize run by mpi4py's
 * atexit handler. mpidp_mpiops_free() exists for tests and tools that want to
 * release them explicitly while MPI is still initialized. */
#ifndef MPIDP_MPIOPS_H
#define MPIDP_MPIOPS_H

#include <mpi.h>

/* Creates and commits the bf16 and fp16 datatypes and both ops. Idempotent:
 * later calls return MPIDP_OK and change nothing. Thread-safe.
 *
 * Fails with MPIDP_ESTATE when MPI is not initialized or already finalized,
 * and with MPIDP_EMPI (the MPI error string in mpidp_error_detail) when an MPI
 * call fails; a failed call leaves nothing created, so it can be retried. */
int mpidp_mpiops_init(void);

/* The datatypes and the op; MPI_DATATYPE_NULL / MPI_OP_NULL before a
 * successful mpidp_mpiops_init. */
MPI_Datatype mpidp_mpi_bf16_type(void);
MPI_Datatype mpidp_mpi_fp16_type(void);
MPI_Op mpidp_mpi_half_sum_op(void);
MPI_Op mpidp_mpi_narrow_int_sum_op(void);

/* Reductions. AVG is a SUM of values scaled by 1/size first (floats only);
 * the bitwise ones take the integer dtypes and bool (and, or, xor). */
typedef enum {
    MPIDP_OP_SUM = 0,
    MPIDP_OP_AVG = 1,
    MPIDP_OP_MIN = 2,
    MPIDP_OP_MAX = 3,
    MPIDP_OP_PROD = 4,
    MPIDP_OP_BAND = 5,
    MPIDP_OP_BOR = 6,
    MPIDP_OP_BXOR = 7,
} mpidp_op_t;

/* The MPI datatype of a core dtype (MPIDP_F32 ...; see mpidp/tensor.h), and
 * the MPI op reducing it with `op`: MPI_DATATYPE_NULL / MPI_OP_NULL when
 * unknown or not defined for that dtype (avg of integers; min, max or prod
 * of bfloat16/float16; sum or avg of bool -- bool takes min = all, max = any,
 * prod = all, and the bitwise ops as logical ones; the bitwise ops of
 * floats), and for the 16-bit floats and the sum of 8- and 16-bit integers
 * before a successful mpidp_mpiops_init. The one place the core maps its dtypes and ops to MPI. */
MPI_Datatype mpidp_mpi_datatype(int dtype);
MPI_Op mpidp_mpi_op(int op, int dtype);
/* "sum", "avg", "min", "max", "prod", "band", "bor", "bxor", or "unknown". */
const char *mpidp_op_name(int op);

/* Why mpidp_mpi_op(op, dtype) is MPI_OP_NULL, as advice for a message
 * (" (bool takes min = all, ...)"), starting with a space; "" otherwise. */
const char *mpidp_op_hint(int op, int dtype);

/* Frees the handles when MPI is still initialized (after MPI_Finalize it only
 * forgets them), so that mpidp_mpiops_init can create them again. Never call it
 * while a reduction using them may still be in flight. Returns MPIDP_OK, or
 * MPIDP_EMPI when an MPI call fails. */
int mpidp_mpiops_free(void);

#endif /* MPIDP_MPIOPS_H */
