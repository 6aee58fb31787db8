/* The core's allgather, reduce-scatter and allreduce against Open MPI's
 * blocking and non-blocking calls on the same buffers, with no Python or
 * torch in the way: what the core itself costs.
 *
 *     make -C benchmarks/c ../out/bench_collectives
 *     mpirun -np 2 benchmarks/out/bench_collectives [rounds]
 *
 * Each round times every method in turn (REPS calls each, sized to about
 * 20 MB moved); the median round counts, the slowest rank's. Printed: us per
 * call and the core's bandwidth as a ratio of the blocking call's. Open MPI's
 * MPI_Iallreduce runs Rabenseifner's algorithm, as under mpidp. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpidp/allreduce.h"
#include "mpidp/collectives.h"
#include "mpidp/mpi_info.h"
#include "mpidp/mpiops.h"
#include "mpidp/operation.h"
#include "mpidp/reqtable.h"
#include "mpidp/status.h"

enum { BLOCKING, NONBLOCKING, CORE, METHODS };
static const char *const method_names[METHODS] = {"MPI blocking", "MPI non-blocking", "mpidp core"};

typedef struct {
    int rank, size;
    size_t n; /* float32 elements per rank's block */
    float *in, *out, *all;
    size_t *counts;
    mpidp_reqtable_t *reqs;
} bench_t;

static void check(int rc, const char *what)
{
    if (rc == MPIDP_OK) return;
    fprintf(stderr, "%s: %s (%s)\n", what, mpidp_status_name(rc), mpidp_error_detail());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static void allgather(bench_t *b, int method)
{
    int bytes = (int)(b->n * sizeof(float));
    MPI_Request r;
    switch (method) {
    case BLOCKING:
        MPI_Allgather(b->in, bytes, MPI_BYTE, b->all, bytes, MPI_BYTE, MPI_COMM_WORLD);
        return;
    case NONBLOCKING:
        MPI_Iallgather(b->in, bytes, MPI_BYTE, b->all, bytes, MPI_BYTE, MPI_COMM_WORLD, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
        return;
    default: {
        mpidp_tensor_t s = {b->in, b->n, MPIDP_F32, MPIDP_DEV_CPU, 0, 0};
        mpidp_tensor_t o = {b->all, b->n * (size_t)b->size, MPIDP_F32, MPIDP_DEV_CPU, 0, 0};
        mpidp_coll_t *x = NULL;
        check(mpidp_allgather_start(MPI_COMM_WORLD, &s, &o, b->reqs, &x), "allgather");
        check(mpidp_coll_wait(x, 60.0), "allgather wait");
        check(mpidp_coll_free(x), "allgather free");
    }
    }
}

static void reduce_scatter(bench_t *b, int method)
{
    MPI_Request r;
    switch (method) {
    case BLOCKING:
        MPI_Reduce_scatter_block(b->all, b->out, (int)b->n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        return;
    case NONBLOCKING:
        MPI_Ireduce_scatter_block(b->all, b->out, (int)b->n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD,
                                  &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
        return;
    default: {
        mpidp_tensor_t s = {b->all, b->n * (size_t)b->size, MPIDP_F32, MPIDP_DEV_CPU, 0, 0};
        mpidp_tensor_t o = {b->out, b->n, MPIDP_F32, MPIDP_DEV_CPU, 0, 0};
        mpidp_coll_t *x = NULL;
        check(mpidp_reduce_scatter_start(MPI_COMM_WORLD, &s, &o, b->counts, MPIDP_OP_SUM, b->reqs,
                                         &x),
              "reduce_scatter");
        check(mpidp_coll_wait(x, 60.0), "reduce_scatter wait");
        check(mpidp_coll_free(x), "reduce_scatter free");
    }
    }
}

static void allreduce(bench_t *b, int method)
{
    MPI_Request r;
    switch (method) {
    case BLOCKING:
        MPI_Allreduce(MPI_IN_PLACE, b->in, (int)b->n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        return;
    case NONBLOCKING:
        MPI_Iallreduce(MPI_IN_PLACE, b->in, (int)b->n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
        return;
    default: {
        mpidp_tensor_t t = {b->in, b->n, MPIDP_F32, MPIDP_DEV_CPU, 0, 0};
        mpidp_allreduce_opts_t o =
            mpidp_allreduce_default_opts(MPIDP_F32, MPIDP_OP_SUM, -1, 60.0, "bench allreduce");
        mpidp_allreduce_t *x = NULL;
        check(mpidp_allreduce_start(MPI_COMM_WORLD, &t, &o, b->reqs, &x), "allreduce");
        check(mpidp_allreduce_wait(x, 60.0), "allreduce wait");
        check(mpidp_allreduce_free(x), "allreduce free");
    }
    }
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Seconds per call of each method: the median of `rounds`, the slowest rank's. */
static void time_op(bench_t *b, void (*op)(bench_t *, int), int reps, int rounds, double *out)
{
    double *samples = malloc((size_t)rounds * METHODS * sizeof *samples);
    for (int m = 0; m < METHODS; m++) op(b, m); /* warm-up: connections, pages */
    for (int r = 0; r < rounds; r++)
        for (int m = 0; m < METHODS; m++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            for (int i = 0; i < reps; i++) op(b, m);
            samples[m * rounds + r] = (MPI_Wtime() - t0) / reps;
        }
    for (int m = 0; m < METHODS; m++) {
        qsort(samples + m * rounds, (size_t)rounds, sizeof *samples, by_value);
        double median = samples[m * rounds + rounds / 2];
        MPI_Allreduce(&median, &out[m], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    }
    free(samples);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    /* What importing mpidp does (Rabenseifner's allreduce for MPI_Iallreduce):
     * without it Open MPI 4.1's in-place Iallreduce took 2-3x the blocking
     * call here, for mpidp and mpi4py alike. */
    mpidp_mpi_iallreduce_algorithm(3);
    int rounds = argc > 1 ? atoi(argv[1]) : 7;
    if (rounds < 1) rounds = 1;
    bench_t b = {0};
    MPI_Comm_rank(MPI_COMM_WORLD, &b.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &b.size);
    mpidp_mpiops_init();
    check(mpidp_reqtable_create(256, &b.reqs), "request table");
    b.counts = malloc((size_t)b.size * sizeof *b.counts);
    static const size_t sizes[] = {1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 22, 1 << 26};
    static const struct {
        const char *name;
        void (*op)(bench_t *, int);
    } ops[] = {{"allgather", allgather}, {"reduce_scatter", reduce_scatter},
               {"allreduce", allreduce}};
    if (b.rank == 0)
        printf("%d ranks; us per call (median of %d rounds, the slowest rank's); bytes per "
               "rank's block\n", b.size, rounds);
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        b.n = sizes[si] / sizeof(float);
        for (int r = 0; r < b.size; r++) b.counts[r] = b.n;
        b.in = malloc(b.n * sizeof(float));
        b.out = malloc(b.n * sizeof(float));
        b.all = malloc(b.n * (size_t)b.size * sizeof(float));
        for (size_t i = 0; i < b.n; i++) b.in[i] = b.out[i] = 1.0f;
        for (size_t i = 0; i < b.n * (size_t)b.size; i++) b.all[i] = 1.0f;
        int reps = (int)((20u << 20) / sizes[si]);
        if (reps > 4000) reps = 4000; /* 1 KB: per-call cost, not bandwidth */
        if (reps < 3) reps = 3;
        for (size_t k = 0; k < sizeof ops / sizeof *ops; k++) {
            double t[METHODS];
            time_op(&b, ops[k].op, reps, rounds, t);
            if (b.rank != 0) continue;
            printf("%-15s %9zu B", ops[k].name, sizes[si]);
            for (int m = 0; m < METHODS; m++) printf("  %s %9.1f", method_names[m], t[m] * 1e6);
            printf("  -> core %.2fx the blocking call's bandwidth\n", t[BLOCKING] / t[CORE]);
        }
        free(b.in), free(b.out), free(b.all);
    }
    free(b.counts);
    mpidp_reqtable_destroy(b.reqs);
    MPI_Finalize();
    return 0;
}
