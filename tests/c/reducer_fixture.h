/* A one-rank reducer for the C tests (test_reducer.c, test_reducer_pass.c):
 * four float32 parameters of 8 elements; 64-byte caps give two buckets. */
#ifndef MPIDP_TEST_REDUCER_FIXTURE_H
#define MPIDP_TEST_REDUCER_FIXTURE_H

#include <mpi.h>

#include "mpidp/bucket.h"
#include "mpidp/reducer.h"
#include "mpidp/tensor.h"
#include "bucket_tensors.h"

#define NP 4

typedef struct {
    size_t numel[NP];
    int dtype[NP];
    uint32_t bucket[NP];
    size_t offset[NP];
    mpidp_bucket_info_t info[NP];
    size_t nb;
    float storage[NP][64];
    void *data[NP];
    mpidp_tensor_t tensors[NP];
    mpidp_reqtable_t *reqs;
    mpidp_reducer_t *r;
} fixture_t;

/* Four float32 parameters of 8 elements; 64-byte caps give two buckets:
 * bucket 0 = params 3, 2 and bucket 1 = params 1, 0. */
static int setup_mode(fixture_t *f, int staged, int separate)
{
    memset(f, 0, sizeof *f);
    for (int i = 0; i < NP; i++) {
        f->numel[i] = 8;
        f->dtype[i] = MPIDP_F32;
    }
    int rc = mpidp_bucket_plan(f->numel, f->dtype, NP, 64, 64, f->bucket, f->offset, f->info, &f->nb);
    if (rc) return rc;
    for (size_t b = 0; b < f->nb; b++) f->data[b] = f->storage[b];
    bucket_tensors(f->tensors, f->data, f->info, f->nb);
    if ((rc = mpidp_reqtable_create(16, &f->reqs))) return rc;
    mpidp_reducer_config_t cfg = {
        .comm = MPI_COMM_SELF, .reqs = f->reqs, .n_params = NP, .param_numel = f->numel,
        .param_dtype = f->dtype, .first_cap = 64, .cap = 64, .n_buckets = f->nb,
        .bucket_tensors = f->tensors, .wire_dtype = -1, .name = "test",
        .staged = staged, .separate = separate};
    return mpidp_reducer_create(&cfg, &f->r);
}

static int setup(fixture_t *f) { return setup_mode(f, 0, 0); }

static void teardown(fixture_t *f)
{
    mpidp_reducer_destroy(f->r);
    mpidp_reqtable_destroy(f->reqs);
}

#endif /* MPIDP_TEST_REDUCER_FIXTURE_H */
