/* The bf16 and fp16 MPI datatypes, their sum op, and the wrapping sum of
 * narrow integers (see mpidp/mpiops.h). */
#include "mpidp/mpiops.h"

#include "mpi_util.h"
#include "mpidp/ft.h"
#include "mpidp/pack.h"
#include "mpidp/tensor.h"
#include "mpidp/status.h"
#include "fail.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static MPI_Datatype bf16_type = MPI_DATATYPE_NULL;
static MPI_Datatype fp16_type = MPI_DATATYPE_NULL;
static MPI_Op sum_op = MPI_OP_NULL;
static MPI_Op int_sum_op = MPI_OP_NULL;


/* The user op: inout[i] = in[i] + inout[i] for either 16-bit type, with the
 * kernels chosen at start-up. A user op cannot report an error, and a sum done
 * with the wrong element format would silently corrupt training, so any other
 * datatype (a programming error inside mpidp, including a derived type built
 * from ours) aborts the job with a message. */
static void half_sum(void *in, void *inout, int *len, MPI_Datatype *datatype)
{
    size_t n = *len > 0 ? (size_t)*len : 0;
    const mpidp_pack_kernels_t *k = mpidp_pack_kernels();
    if (*datatype == bf16_type) {
        k->sum_bf16(inout, in, n);
    } else if (*datatype == fp16_type) {
        k->sum_fp16(inout, in, n);
    } else {
        fprintf(stderr, "mpidp: the half-precision sum op was applied to a datatype "
                        "other than mpidp's bf16 and fp16 types; aborting\n");
        mpidp_abort_job(1);
    }
}

/* The user op: inout[i] = in[i] + inout[i] for 8- and 16-bit integers,
 * wrapping modulo 2^bits as C's unsigned arithmetic, torch, numpy and gloo
 * do. MPI_SUM cannot be trusted here: Open MPI 4.1's AVX op component adds
 * these types with saturating instructions (int8 100 + 100 gives 127) while
 * the scalar tail of the same buffer wraps, a silent wrong sum. Signed types
 * are added as unsigned ones of the same width, whose overflow is defined
 * and gives the two's-complement wrapped value. Any other datatype aborts
 * the job, as for half_sum. */
static void narrow_int_sum(void *in, void *inout, int *len, MPI_Datatype *datatype)
{
    size_t n = *len > 0 ? (size_t)*len : 0;
    MPI_Datatype t = *datatype;
    if (t == MPI_INT8_T || t == MPI_UINT8_T) {
        const uint8_t *a = in;
        uint8_t *b = inout;
        for (size_t i = 0; i < n; i++) b[i] = (uint8_t)(b[i] + a[i]);
    } else if (t == MPI_INT16_T || t == MPI_UINT16_T) {
        const uint16_t *a = in;
        uint16_t *b = inout;
        for (size_t i = 0; i < n; i++) b[i] = (uint16_t)(b[i] + a[i]);
    } else {
        fprintf(stderr, "mpidp: the narrow-integer sum op was applied to a datatype other "
                        "than 8- or 16-bit integers; aborting\n");
        mpidp_abort_job(1);
    }
}

/* Creates, names and commits one 2-byte type; frees it again on failure. */
static int make_type(MPI_Datatype *out, const char *name)
{
    MPI_Datatype t;
    int rc = MPI_Type_contiguous(2, MPI_BYTE, &t);
    if (rc != MPI_SUCCESS) return mpidp__mpi_fail(rc, "MPI_Type_contiguous failed");
    /* The name shows up in MPI error messages and debuggers. */
    const char *call = "MPI_Type_set_name";
    rc = MPI_Type_set_name(t, name);
    if (rc == MPI_SUCCESS) {
        call = "MPI_Type_commit";
        rc = MPI_Type_commit(&t);
    }
    if (rc != MPI_SUCCESS) {
        int st = mpidp__mpi_fail(rc, "%s failed", call);
        MPI_Type_free(&t);
        return st;
    }
    *out = t;
    return MPIDP_OK;
}

int mpidp_mpiops_init(void)
{
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (!inited || finalized)
        return mpidp__fail(MPIDP_ESTATE, "mpidp_mpiops_init needs MPI to be initialized "
                                         "(and not yet finalized)");
    /* Choose the kernels now rather than inside the first reduction. */
    (void)mpidp_pack_kernels();

    int st = MPIDP_OK;
    MPI_Datatype b = MPI_DATATYPE_NULL, h = MPI_DATATYPE_NULL;
    MPI_Op op = MPI_OP_NULL, int_op = MPI_OP_NULL;
    pthread_mutex_lock(&lock);
    if (sum_op != MPI_OP_NULL) goto out;
    st = make_type(&b, "mpidp_bf16");
    if (st == MPIDP_OK) st = make_type(&h, "mpidp_fp16");
    if (st == MPIDP_OK) {
        int rc = MPI_Op_create(half_sum, 1 /* commutative */, &op);
        if (rc == MPI_SUCCESS) rc = MPI_Op_create(narrow_int_sum, 1, &int_op);
        if (rc != MPI_SUCCESS) st = mpidp__mpi_fail(rc, "MPI_Op_create failed");
    }
    if (st != MPIDP_OK) {
        if (b != MPI_DATATYPE_NULL) MPI_Type_free(&b);
        if (h != MPI_DATATYPE_NULL) MPI_Type_free(&h);
        if (op != MPI_OP_NULL) MPI_Op_free(&op);
        goto out;
    }
    bf16_type = b;
    fp16_type = h;
    sum_op = op;
    int_sum_op = int_op;
out:
    pthread_mutex_unlock(&lock);
    return st;
}

MPI_Datatype mpidp_mpi_bf16_type(void) { return bf16_type; }
MPI_Datatype mpidp_mpi_fp16_type(void) { return fp16_type; }
MPI_Op mpidp_mpi_half_sum_op(void) { return sum_op; }
MPI_Op mpidp_mpi_narrow_int_sum_op(void) { return int_sum_op; }

int mpidp_mpiops_free(void)
{
    int st = MPIDP_OK, finalized = 0;
    MPI_Finalized(&finalized);
    pthread_mutex_lock(&lock);
    if (!finalized && sum_op != MPI_OP_NULL) {
        int rc = MPI_Op_free(&sum_op);
        if (rc == MPI_SUCCESS) rc = MPI_Op_free(&int_sum_op);
        if (rc == MPI_SUCCESS) rc = MPI_Type_free(&bf16_type);
        if (rc == MPI_SUCCESS) rc = MPI_Type_free(&fp16_type);
        if (rc != MPI_SUCCESS) st = mpidp__mpi_fail(rc, "freeing mpidp's MPI datatypes and op failed");
    }
    bf16_type = MPI_DATATYPE_NULL;
    fp16_type = MPI_DATATYPE_NULL;
    sum_op = MPI_OP_NULL;
    int_sum_op = MPI_OP_NULL;
    pthread_mutex_unlock(&lock);
    return st;
}

MPI_Datatype mpidp_mpi_datatype(int dtype)
{
    switch (dtype) {
    case MPIDP_F32: return MPI_FLOAT;
    case MPIDP_F64: return MPI_DOUBLE;
    case MPIDP_BF16: return mpidp_mpi_bf16_type();
    case MPIDP_F16: return mpidp_mpi_fp16_type();
    case MPIDP_I8: return MPI_INT8_T;
    case MPIDP_U8: return MPI_UINT8_T;
    case MPIDP_I16: return MPI_INT16_T;
    case MPIDP_I32: return MPI_INT32_T;
    case MPIDP_I64: return MPI_INT64_T;
    case MPIDP_BOOL: return MPI_C_BOOL;
    }
    return MPI_DATATYPE_NULL;
}

MPI_Op mpidp_mpi_op(int op, int dtype)
{
    if (mpidp_mpi_datatype(dtype) == MPI_DATATYPE_NULL) return MPI_OP_NULL;
    int half = dtype == MPIDP_BF16 || dtype == MPIDP_F16;
    int narrow = dtype == MPIDP_I8 || dtype == MPIDP_U8 || dtype == MPIDP_I16;
    if (dtype == MPIDP_BOOL) {
        switch (op) {
        case MPIDP_OP_MIN:
        case MPIDP_OP_PROD: return MPI_LAND;
        case MPIDP_OP_MAX: return MPI_LOR;
        case MPIDP_OP_BAND: return MPI_LAND;
        case MPIDP_OP_BOR: return MPI_LOR;
        case MPIDP_OP_BXOR: return MPI_LXOR;
        }
        return MPI_OP_NULL;
    }
    /* An average is a sum of values scaled by 1/size first. */
    if (op == MPIDP_OP_AVG && !mpidp_dtype_is_float(dtype)) return MPI_OP_NULL;
    switch (op) {
    case MPIDP_OP_AVG:
    case MPIDP_OP_SUM:
        return half ? mpidp_mpi_half_sum_op() : narrow ? mpidp_mpi_narrow_int_sum_op() : MPI_SUM;
    case MPIDP_OP_MIN: return half ? MPI_OP_NULL : MPI_MIN;
    case MPIDP_OP_MAX: return half ? MPI_OP_NULL : MPI_MAX;
    case MPIDP_OP_PROD: return half ? MPI_OP_NULL : MPI_PROD;
    }
    if (mpidp_dtype_is_float(dtype)) return MPI_OP_NULL;
    switch (op) {
    case MPIDP_OP_BAND: return MPI_BAND;
    case MPIDP_OP_BOR: return MPI_BOR;
    case MPIDP_OP_BXOR: return MPI_BXOR;
    }
    return MPI_OP_NULL;
}

const char *mpidp_op_name(int op)
{
    static const char *const names[] = {"sum", "avg", "min", "max", "prod",
                                         "band", "bor", "bxor"};
    return op >= 0 && op < (int)(sizeof names / sizeof names[0]) ? names[op] : "unknown";
}

const char *mpidp_op_hint(int op, int dtype)
{
    if (mpidp_mpi_op(op, dtype) != MPI_OP_NULL) return "";
    if (dtype == MPIDP_BOOL) return " (bool takes min = all, max = any, prod, band, bor, bxor)";
    if (op >= MPIDP_OP_BAND && op <= MPIDP_OP_BXOR)
        return " (bitwise ops take integer and bool tensors)";
    if (mpidp_dtype_is_float(dtype)) return " (use float32 for min, max, prod)";
    return " (avg needs a floating-point tensor)";
}
