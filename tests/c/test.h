/* A tiny C test runner in the libuv style, header-only.
 *
 * Each tests/c/test_<area>.c is its own executable:
 *
 *     TEST(bucket_plan_reverse_order) { ASSERT_EQ_INT(plan.n, 3); }
 *     TEST_MAIN(bucket_plan_reverse_order, ...)
 *
 * An ASSERT_* failure prints both values with file and line and ends the
 * current test (the others still run). The runner prints one line per failing
 * test and ends with "N passed, N failed"; the exit status is 1 if any failed.
 * `./test_x name` runs only the test called `name`. */
#ifndef MPIDP_TEST_H
#define MPIDP_TEST_H

#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void (*mpidp_test_fn)(int *mpidp__test_failed);

#define TEST(name) static void test_##name(int *mpidp__test_failed)

#define MPIDP__FAIL_AT(...)                                                     \
    do {                                                                        \
        fprintf(stderr, "  %s:%d: ", __FILE__, __LINE__);                       \
        fprintf(stderr, __VA_ARGS__);                                           \
        fputc('\n', stderr);                                                    \
        *mpidp__test_failed = 1;                                                \
        return;                                                                 \
    } while (0)

#define ASSERT_TRUE(cond)                                                       \
    do { if (!(cond)) MPIDP__FAIL_AT("expected true: %s", #cond); } while (0)

#define ASSERT_EQ_INT(a, b)                                                     \
    do {                                                                        \
        long long mpidp__a = (long long)(a), mpidp__b = (long long)(b);         \
        if (mpidp__a != mpidp__b)                                               \
            MPIDP__FAIL_AT("%s == %s: %lld != %lld", #a, #b, mpidp__a, mpidp__b); \
    } while (0)

#define ASSERT_EQ_U64(a, b)                                                     \
    do {                                                                        \
        uint64_t mpidp__a = (uint64_t)(a), mpidp__b = (uint64_t)(b);            \
        if (mpidp__a != mpidp__b)                                               \
            MPIDP__FAIL_AT("%s == %s: 0x%" PRIx64 " != 0x%" PRIx64, #a, #b,     \
                           mpidp__a, mpidp__b);                                 \
    } while (0)

#define ASSERT_NEAR(a, b, tol)                                                  \
    do {                                                                        \
        double mpidp__a = (double)(a), mpidp__b = (double)(b);                  \
        if (!(fabs(mpidp__a - mpidp__b) <= (double)(tol)))                      \
            MPIDP__FAIL_AT("%s ~= %s: %.9g vs %.9g (tol %g)", #a, #b, mpidp__a, \
                           mpidp__b, (double)(tol));                            \
    } while (0)

#define ASSERT_STREQ(a, b)                                                      \
    do {                                                                        \
        const char *mpidp__a = (a), *mpidp__b = (b);                            \
        if (strcmp(mpidp__a, mpidp__b) != 0)                                    \
            MPIDP__FAIL_AT("%s == %s: \"%s\" != \"%s\"", #a, #b, mpidp__a, mpidp__b); \
    } while (0)

/* Assert a core call returned MPIDP_OK, printing the status name otherwise. */
#define ASSERT_OK(call)                                                         \
    do {                                                                        \
        int mpidp__s = (call);                                                  \
        if (mpidp__s != 0)                                                      \
            MPIDP__FAIL_AT("%s returned %d (%s)", #call, mpidp__s,              \
                           mpidp_error_detail());                               \
    } while (0)

typedef struct {
    const char *name;
    mpidp_test_fn fn;
} mpidp_test_case;

static inline int mpidp__run_tests(const mpidp_test_case *cases, size_t n,
                                   int argc, char **argv)
{
    int passed = 0, failed = 0;
    for (size_t i = 0; i < n; i++) {
        if (argc > 1 && strcmp(argv[1], cases[i].name) != 0) continue;
        int f = 0;
        cases[i].fn(&f);
        if (f) {
            fprintf(stderr, "FAIL %s\n", cases[i].name);
            failed++;
        } else {
            passed++;
        }
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}

#define MPIDP__CASE(name) {#name, test_##name},
/* TEST_MAIN(a, b, c): expands one case per name via the FOREACH helper below. */
#define MPIDP__FE_1(m, x) m(x)
#define MPIDP__FE_2(m, x, ...) m(x) MPIDP__FE_1(m, __VA_ARGS__)
#define MPIDP__FE_3(m, x, ...) m(x) MPIDP__FE_2(m, __VA_ARGS__)
#define MPIDP__FE_4(m, x, ...) m(x) MPIDP__FE_3(m, __VA_ARGS__)
#define MPIDP__FE_5(m, x, ...) m(x) MPIDP__FE_4(m, __VA_ARGS__)
#define MPIDP__FE_6(m, x, ...) m(x) MPIDP__FE_5(m, __VA_ARGS__)
#define MPIDP__FE_7(m, x, ...) m(x) MPIDP__FE_6(m, __VA_ARGS__)
#define MPIDP__FE_8(m, x, ...) m(x) MPIDP__FE_7(m, __VA_ARGS__)
#define MPIDP__FE_9(m, x, ...) m(x) MPIDP__FE_8(m, __VA_ARGS__)
#define MPIDP__FE_10(m, x, ...) m(x) MPIDP__FE_9(m, __VA_ARGS__)
#define MPIDP__FE_11(m, x, ...) m(x) MPIDP__FE_10(m, __VA_ARGS__)
#define MPIDP__FE_12(m, x, ...) m(x) MPIDP__FE_11(m, __VA_ARGS__)
#define MPIDP__FE_13(m, x, ...) m(x) MPIDP__FE_12(m, __VA_ARGS__)
#define MPIDP__FE_14(m, x, ...) m(x) MPIDP__FE_13(m, __VA_ARGS__)
#define MPIDP__FE_15(m, x, ...) m(x) MPIDP__FE_14(m, __VA_ARGS__)
#define MPIDP__FE_16(m, x, ...) m(x) MPIDP__FE_15(m, __VA_ARGS__)
#define MPIDP__FE_17(m, x, ...) m(x) MPIDP__FE_16(m, __VA_ARGS__)
#define MPIDP__FE_18(m, x, ...) m(x) MPIDP__FE_17(m, __VA_ARGS__)
#define MPIDP__FE_19(m, x, ...) m(x) MPIDP__FE_18(m, __VA_ARGS__)
#define MPIDP__FE_20(m, x, ...) m(x) MPIDP__FE_19(m, __VA_ARGS__)
#define MPIDP__FE_21(m, x, ...) m(x) MPIDP__FE_20(m, __VA_ARGS__)
#define MPIDP__FE_22(m, x, ...) m(x) MPIDP__FE_21(m, __VA_ARGS__)
#define MPIDP__FE_23(m, x, ...) m(x) MPIDP__FE_22(m, __VA_ARGS__)
#define MPIDP__FE_24(m, x, ...) m(x) MPIDP__FE_23(m, __VA_ARGS__)
#define MPIDP__FE_25(m, x, ...) m(x) MPIDP__FE_24(m, __VA_ARGS__)
#define MPIDP__FE_26(m, x, ...) m(x) MPIDP__FE_25(m, __VA_ARGS__)
#define MPIDP__FE_27(m, x, ...) m(x) MPIDP__FE_26(m, __VA_ARGS__)
#define MPIDP__FE_28(m, x, ...) m(x) MPIDP__FE_27(m, __VA_ARGS__)
#define MPIDP__FE_29(m, x, ...) m(x) MPIDP__FE_28(m, __VA_ARGS__)
#define MPIDP__FE_30(m, x, ...) m(x) MPIDP__FE_29(m, __VA_ARGS__)
#define MPIDP__FE_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13,   \
                       _14, _15, _16, _17, _18, _19, _20, _21, _22, _23, _24,   \
                       _25, _26, _27, _28, _29, _30, NAME, ...) NAME
#define MPIDP__FOREACH(m, ...)                                                  \
    MPIDP__FE_PICK(__VA_ARGS__, MPIDP__FE_30, MPIDP__FE_29, MPIDP__FE_28,       \
                   MPIDP__FE_27, MPIDP__FE_26, MPIDP__FE_25, MPIDP__FE_24,      \
                   MPIDP__FE_23, MPIDP__FE_22, MPIDP__FE_21, MPIDP__FE_20,      \
                   MPIDP__FE_19, MPIDP__FE_18, MPIDP__FE_17, MPIDP__FE_16,      \
                   MPIDP__FE_15, MPIDP__FE_14, MPIDP__FE_13, MPIDP__FE_12,      \
                   MPIDP__FE_11, MPIDP__FE_10, MPIDP__FE_9, MPIDP__FE_8,        \
                   MPIDP__FE_7, MPIDP__FE_6, MPIDP__FE_5, MPIDP__FE_4,          \
                   MPIDP__FE_3, MPIDP__FE_2, MPIDP__FE_1)(m, __VA_ARGS__)

/* Up to 30 tests per file; split a file that needs more. */
#define TEST_MAIN(...)                                                          \
    int main(int argc, char **argv)                                             \
    {                                                                           \
        static const mpidp_test_case cases[] = {                                \
            MPIDP__FOREACH(MPIDP__CASE, __VA_ARGS__)};                          \
        return mpidp__run_tests(cases, sizeof cases / sizeof cases[0], argc,    \
                                argv);                                          \
    }

/* TEST_MAIN_MPI(a, b, c): the same, between MPI_Init and MPI_Finalize (the
 * file must include <mpi.h>). Without mpirun the process is an MPI singleton;
 * test_mpi_*.c files are run under mpirun -np 2 by tests/c/Makefile. */
#define TEST_MAIN_MPI(...)                                                      \
    int main(int argc, char **argv)                                             \
    {                                                                           \
        static const mpidp_test_case cases[] = {                                \
            MPIDP__FOREACH(MPIDP__CASE, __VA_ARGS__)};                          \
        MPI_Init(&argc, &argv);                                                 \
        int rc = mpidp__run_tests(cases, sizeof cases / sizeof cases[0], argc,  \
                                  argv);                                        \
        MPI_Finalize();                                                         \
        return rc;                                                              \
    }

/* TEST_MAIN_MPI_THREADS(a, b, c): as TEST_MAIN_MPI, MPI initialized with
 * MPI_THREAD_MULTIPLE (as mpi4py does), for engines that run a thread. */
#define TEST_MAIN_MPI_THREADS(...)                                              \
    int main(int argc, char **argv)                                             \
    {                                                                           \
        static const mpidp_test_case cases[] = {                                \
            MPIDP__FOREACH(MPIDP__CASE, __VA_ARGS__)};                          \
        int provided = 0;                                                       \
        MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);          \
        int rc = mpidp__run_tests(cases, sizeof cases / sizeof cases[0], argc,  \
                                  argv);                                        \
        MPI_Finalize();                                                         \
        return rc;                                                              \
    }

#endif /* MPIDP_TEST_H */
