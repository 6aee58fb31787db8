/* The bf16/fp16 MPI datatypes and sum op.
 *
 * Runs as a singleton (MPI_Init without mpirun) in `make -C tests/c`, and is
 * rank-agnostic, so the same binary checks real reductions at any size:
 *
 *     mpirun -np 2 --oversubscribe tests/c/build/test_mpiops
 *
 * Every rank gives different data and compares with a reference computed
 * locally from the union of all ranks' data. A rank never returns early
 * before a collective: each collective test agrees on a verdict first, so a
 * failure cannot leave the other ranks hanging. */
#include <mpi.h>

#include "mpidp/mpiops.h"
#include "mpidp/pack.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "pack_oracle.h"
#include "test.h"
#include "pack_internal.h"

static void finalize_mpi(void)
{
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (inited && !finalized) MPI_Finalize();
}

static void ensure_mpi(void)
{
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        MPI_Init(NULL, NULL);
        atexit(finalize_mpi);
    }
}

static int rank(void)
{
    int r;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}

static int size(void)
{
    int s;
    MPI_Comm_size(MPI_COMM_WORLD, &s);
    return s;
}

/* True on every rank iff ok on every rank. */
static int all_ok(int ok)
{
    int all = 0;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    return all;
}

/* Runs first (TEST_MAIN order), before anything initializes MPI. */
TEST(init_needs_mpi)
{
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        ASSERT_EQ_INT(mpidp_mpiops_init(), MPIDP_ESTATE);
        ASSERT_TRUE(strstr(mpidp_error_detail(), "MPI") != NULL);
        ASSERT_TRUE(mpidp_mpi_half_sum_op() == MPI_OP_NULL);
        ASSERT_TRUE(mpidp_mpi_bf16_type() == MPI_DATATYPE_NULL);
    }
}

TEST(init_is_idempotent_and_types_are_distinct)
{
    ensure_mpi();
    ASSERT_OK(mpidp_mpiops_init());
    MPI_Datatype b = mpidp_mpi_bf16_type(), h = mpidp_mpi_fp16_type();
    MPI_Op op = mpidp_mpi_half_sum_op();
    ASSERT_TRUE(b != MPI_DATATYPE_NULL && h != MPI_DATATYPE_NULL && op != MPI_OP_NULL);
    ASSERT_TRUE(b != h);
    ASSERT_OK(mpidp_mpiops_init());
    ASSERT_TRUE(mpidp_mpi_bf16_type() == b && mpidp_mpi_fp16_type() == h);
    ASSERT_TRUE(mpidp_mpi_half_sum_op() == op);
    int sz = 0, commute = 0;
    MPI_Aint lb = 0, extent = 0;
    MPI_Type_size(b, &sz);
    ASSERT_EQ_INT(sz, 2);
    MPI_Type_get_extent(h, &lb, &extent);
    ASSERT_EQ_INT(extent, 2);
    MPI_Op_commutative(op, &commute);
    ASSERT_TRUE(commute);
    char name[MPI_MAX_OBJECT_NAME];
    int len = 0;
    MPI_Type_get_name(b, name, &len);
    ASSERT_STREQ(name, "mpidp_bf16");
}

/* MPI_Reduce_local with the op gives exactly the reference sum, with every
 * kernel path the dispatch can select. */
TEST(reduce_local_matches_the_kernels)
{
    ensure_mpi();
    ASSERT_OK(mpidp_mpiops_init());
    enum { N = 100003 };
    static uint16_t in[N], inout[N], want[N], init[N];
    uint64_t st = 12345;
    for (size_t i = 0; i < N; i++) {
        in[i] = (uint16_t)oracle_rnd(&st);
        init[i] = (uint16_t)oracle_rnd(&st);
    }
    static const char *const paths[] = {"ref", "avx2", "avx512", "avx512_bf16"};
    static const int lengths[] = {0, 1, 7, 17, 33, N};
    for (size_t p = 0; p < 4; p++) {
        const mpidp_pack_kernels_t *k;
        if (mpidp_pack_kernels_for(paths[p], &k) != MPIDP_OK) continue;
        ASSERT_OK(mpidp_pack_init(paths[p]));
        for (int fmt = 0; fmt < 2; fmt++) {
            MPI_Datatype t = fmt ? mpidp_mpi_fp16_type() : mpidp_mpi_bf16_type();
            for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
                int n = lengths[li];
                memcpy(inout, init, sizeof inout);
                memcpy(want, init, sizeof want);
                ASSERT_EQ_INT(MPI_Reduce_local(in, inout, n, t, mpidp_mpi_half_sum_op()), MPI_SUCCESS);
                (fmt ? mpidp__pack_ref.sum_fp16 : mpidp__pack_ref.sum_bf16)(want, in, (size_t)n);
                ASSERT_TRUE(memcmp(inout, want, sizeof want) == 0);
            }
        }
    }
    ASSERT_OK(mpidp_pack_init(NULL));
}

/* Small integers are exact in bf16 and fp16, and so are their sums over a few
 * ranks: the result is the same in any reduction order, at any size. */
static uint16_t small_int_value(int r, size_t i, int fmt)
{
    float v = (float)((int)((i * 7 + (size_t)r * 13) % 33) - 16);
    return fmt ? mpidp_fp16_from_f32(v) : mpidp_bf16_from_f32(v);
}

TEST(allreduce_sums_exactly_across_ranks)
{
    ensure_mpi();
    ASSERT_OK(mpidp_mpiops_init());
    int r = rank(), s = size(), ok = 1;
    /* Large enough for Open MPI to split the reduction into segments, so the
     * op sees partial lengths. */
    size_t n = (1u << 20) + 3;
    uint16_t *buf = malloc(n * sizeof *buf);
    ASSERT_TRUE(buf != NULL);
    for (int fmt = 0; fmt < 2; fmt++) {
        for (size_t i = 0; i < n; i++) buf[i] = small_int_value(r, i, fmt);
        MPI_Datatype t = fmt ? mpidp_mpi_fp16_type() : mpidp_mpi_bf16_type();
        int rc = MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, t, mpidp_mpi_half_sum_op(), MPI_COMM_WORLD);
        ok = ok && rc == MPI_SUCCESS;
        for (size_t i = 0; i < n && ok; i++) {
            float want = 0;
            for (int q = 0; q < s; q++) {
                uint16_t v = small_int_value(q, i, fmt);
                want += fmt ? mpidp_f32_from_fp16(v) : mpidp_f32_from_bf16(v);
            }
            float got = fmt ? mpidp_f32_from_fp16(buf[i]) : mpidp_f32_from_bf16(buf[i]);
            if (got != want) {
                fprintf(stderr, "  rank %d %s element %zu: %g != %g\n", r, fmt ? "fp16" : "bf16", i,
                        (double)got, (double)want);
                ok = 0;
            }
        }
    }
    free(buf);
    ASSERT_TRUE(all_ok(ok));
}

/* Random data: with two ranks each element is one rounded addition, so the
 * result must equal the reference kernel on the two ranks' data, bit for bit,
 * on both ranks (also via MPI_Iallreduce). With one rank the buffer must come
 * back unchanged. At other sizes the order of additions is MPI's choice, so
 * only agreement between ranks is checked. */
static void fill_random(uint16_t *buf, size_t n, int r)
{
    uint64_t st = 0x1234567ull + (uint64_t)r * 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < n; i++) buf[i] = (uint16_t)oracle_rnd(&st);
}

TEST(allreduce_random_data_matches_the_reference)
{
    ensure_mpi();
    ASSERT_OK(mpidp_mpiops_init());
    int r = rank(), s = size(), ok = 1;
    size_t n = 300007;
    uint16_t *buf = malloc(n * sizeof *buf), *want = malloc(n * sizeof *want);
    uint16_t *other = malloc(n * sizeof *other);
    ASSERT_TRUE(buf && want && other);
    for (int fmt = 0; fmt < 2; fmt++) {
        for (int nonblocking = 0; nonblocking < 2; nonblocking++) {
            MPI_Datatype t = fmt ? mpidp_mpi_fp16_type() : mpidp_mpi_bf16_type();
            fill_random(buf, n, r);
            int rc;
            if (nonblocking) {
                MPI_Request req;
                rc = MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, t, mpidp_mpi_half_sum_op(),
                                    MPI_COMM_WORLD, &req);
                if (rc == MPI_SUCCESS) rc = MPI_Wait(&req, MPI_STATUS_IGNORE);
            } else {
                rc = MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, t, mpidp_mpi_half_sum_op(),
                                   MPI_COMM_WORLD);
            }
            ok = ok && rc == MPI_SUCCESS;
            fill_random(want, n, 0);
            if (s == 2) {
                fill_random(other, n, 1);
                (fmt ? mpidp__pack_ref.sum_fp16 : mpidp__pack_ref.sum_bf16)(want, other, n);
            }
            if (s <= 2 && memcmp(buf, want, n * sizeof *buf) != 0) {
                fprintf(stderr, "  rank %d: %s %s result differs from the reference\n", r,
                        fmt ? "fp16" : "bf16", nonblocking ? "MPI_Iallreduce" : "MPI_Allreduce");
                ok = 0;
            }
            /* Every rank holds the same bits: compare with rank 0's copy. */
            memcpy(other, buf, n * sizeof *buf);
            MPI_Bcast(other, (int)n * 2, MPI_BYTE, 0, MPI_COMM_WORLD);
            ok = ok && memcmp(other, buf, n * sizeof *buf) == 0;
        }
    }
    free(buf);
    free(want);
    free(other);
    ASSERT_TRUE(all_ok(ok));
}

/* 8- and 16-bit integer sums wrap modulo 2^bits as in torch, at every
 * length: Open MPI's AVX op component saturates MPI_SUM of these types in
 * the vectorised part of a buffer (lengths of 64 and more), so lengths on
 * both sides of its vector widths are checked, with values whose sums leave
 * the types' ranges in both directions. */
static uint16_t narrow_value(int r, size_t i, int bits)
{
    uint64_t st = 0x51ed2701ull + (uint64_t)r * 0x9e3779b97f4a7c15ull + i * 0x2545f491ull;
    uint16_t v = (uint16_t)oracle_rnd(&st);
    return bits == 8 ? (uint16_t)(v & 0xff) : v;
}

static const struct {
    int dtype, bits;
} narrow_types[] = {{MPIDP_I8, 8}, {MPIDP_U8, 8}, {MPIDP_I16, 16}};

/* A buffer of `bits`-wide elements from 16-bit values. */
static void narrow_store(void *buf, size_t i, int bits, uint16_t v)
{
    if (bits == 8)
        ((uint8_t *)buf)[i] = (uint8_t)v;
    else
        ((uint16_t *)buf)[i] = v;
}

static uint16_t narrow_load(const void *buf, size_t i, int bits)
{
    return bits == 8 ? ((const uint8_t *)buf)[i] : ((const uint16_t *)buf)[i];
}

TEST(narrow_int_sums_wrap_at_every_length)
{
    ensure_mpi();
    ASSERT_OK(mpidp_mpiops_init());
    enum { N = 100003 };
    static uint16_t a[N], b[N];
    static const int lengths[] = {0, 1, 3, 31, 32, 63, 64, 65, 127, 1000, N};
    for (size_t d = 0; d < sizeof narrow_types / sizeof narrow_types[0]; d++) {
        int bits = narrow_types[d].bits;
        MPI_Op op = mpidp_mpi_op(MPIDP_OP_SUM, narrow_types[d].dtype);
        ASSERT_TRUE(op == mpidp_mpi_narrow_int_sum_op() && op != MPI_OP_NULL);
        MPI_Datatype t = mpidp_mpi_datatype(narrow_types[d].dtype);
        for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
            size_t n = (size_t)lengths[li];
            for (size_t i = 0; i < n; i++) {
                narrow_store(a, i, bits, narrow_value(0, i, bits));
                narrow_store(b, i, bits, narrow_value(1, i, bits));
            }
            ASSERT_EQ_INT(MPI_Reduce_local(a, b, (int)n, t, op), MPI_SUCCESS);
            uint16_t mask = bits == 8 ? 0xff : 0xffff;
            for (size_t i = 0; i < n; i++)
                ASSERT_EQ_U64(narrow_load(b, i, bits),
                              (uint16_t)(narrow_value(0, i, bits) + narrow_value(1, i, bits)) & mask);
        }
    }
    /* The other ops of these types stay MPI's own, which are exact. */
    ASSERT_TRUE(mpidp_mpi_op(MPIDP_OP_MAX, MPIDP_I8) == MPI_MAX);
    ASSERT_TRUE(mpidp_mpi_op(MPIDP_OP_SUM, MPIDP_I32) == MPI_SUM);
}

TEST(narrow_int_allreduce_wraps_across_ranks)
{
    ensure_mpi();
    ASSERT_OK(mpidp_mpiops_init());
    int r = rank(), s = size(), ok = 1;
    size_t n = (1u << 19) + 5; /* segmented by MPI's algorithms */
    uint16_t *buf = malloc(n * sizeof *buf);
    ASSERT_TRUE(buf != NULL);
    for (size_t d = 0; d < sizeof narrow_types / sizeof narrow_types[0]; d++) {
        int bits = narrow_types[d].bits;
        for (size_t i = 0; i < n; i++) narrow_store(buf, i, bits, narrow_value(r, i, bits));
        int rc = MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, mpidp_mpi_datatype(narrow_types[d].dtype),
                               mpidp_mpi_op(MPIDP_OP_SUM, narrow_types[d].dtype), MPI_COMM_WORLD);
        ok = ok && rc == MPI_SUCCESS;
        uint16_t mask = bits == 8 ? 0xff : 0xffff;
        for (size_t i = 0; i < n && ok; i++) {
            uint16_t want = 0;
            for (int q = 0; q < s; q++) want = (uint16_t)(want + narrow_value(q, i, bits));
            if (narrow_load(buf, i, bits) != (want & mask)) {
                fprintf(stderr, "  rank %d dtype %d element %zu: %u != %u\n", r,
                        narrow_types[d].dtype, i, narrow_load(buf, i, bits), want & mask);
                ok = 0;
            }
        }
    }
    free(buf);
    ASSERT_TRUE(all_ok(ok));
}

/* Runs last: frees the handles and creates them again. */
TEST(free_and_init_again)
{
    ensure_mpi();
    ASSERT_OK(mpidp_mpiops_init());
    ASSERT_OK(mpidp_mpiops_free());
    ASSERT_TRUE(mpidp_mpi_half_sum_op() == MPI_OP_NULL);
    ASSERT_TRUE(mpidp_mpi_narrow_int_sum_op() == MPI_OP_NULL);
    ASSERT_TRUE(mpidp_mpi_fp16_type() == MPI_DATATYPE_NULL);
    ASSERT_OK(mpidp_mpiops_free()); /* a second free is harmless */
    ASSERT_OK(mpidp_mpiops_init());
    uint16_t a = mpidp_bf16_from_f32(1.5f), b = mpidp_bf16_from_f32(2.25f);
    ASSERT_EQ_INT(MPI_Reduce_local(&a, &b, 1, mpidp_mpi_bf16_type(), mpidp_mpi_half_sum_op()),
                  MPI_SUCCESS);
    ASSERT_EQ_U64(b, mpidp_bf16_from_f32(3.75f));
}

TEST_MAIN(init_needs_mpi, init_is_idempotent_and_types_are_distinct,
          reduce_local_matches_the_kernels, allreduce_sums_exactly_across_ranks,
          allreduce_random_data_matches_the_reference, narrow_int_sums_wrap_at_every_length,
          narrow_int_allreduce_wraps_across_ranks, free_and_init_again)
