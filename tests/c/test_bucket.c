/* Bucket layout: order, caps, dtypes, oversized and empty parameters. */
#include "mpidp/bucket.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "test.h"

#define MAXP 64

typedef struct {
    uint32_t bucket[MAXP];
    size_t offset[MAXP];
    mpidp_bucket_info_t info[MAXP];
    size_t n;
} plan_t;

static int plan(const size_t *numel, const int *dtype, size_t n, size_t first, size_t cap, plan_t *p)
{
    return mpidp_bucket_plan(numel, dtype, n, first, cap, p->bucket, p->offset, p->info, &p->n);
}

TEST(reverse_order_and_offsets)
{
    /* Four float32 parameters of 10 elements (40 bytes); caps of 80 bytes hold two. */
    size_t numel[] = {10, 10, 10, 10};
    int dtype[] = {MPIDP_F32, MPIDP_F32, MPIDP_F32, MPIDP_F32};
    plan_t p;
    ASSERT_OK(plan(numel, dtype, 4, 80, 80, &p));
    ASSERT_EQ_INT(p.n, 2);
    /* The last parameter comes first: bucket 0 holds params 3 and 2. */
    ASSERT_EQ_INT(p.bucket[3], 0);
    ASSERT_EQ_INT(p.offset[3], 0);
    ASSERT_EQ_INT(p.bucket[2], 0);
    ASSERT_EQ_INT(p.offset[2], 10);
    ASSERT_EQ_INT(p.bucket[1], 1);
    ASSERT_EQ_INT(p.offset[1], 0);
    ASSERT_EQ_INT(p.bucket[0], 1);
    ASSERT_EQ_INT(p.offset[0], 10);
    ASSERT_EQ_INT(p.info[0].numel, 20);
    ASSERT_EQ_INT(p.info[1].n_params, 2);
}

TEST(small_first_bucket)
{
    size_t numel[] = {10, 10, 10, 10, 10};
    int dtype[] = {0, 0, 0, 0, 0};
    plan_t p;
    /* First cap 40 bytes = one parameter; later caps 400 bytes = all the rest. */
    ASSERT_OK(plan(numel, dtype, 5, 40, 400, &p));
    ASSERT_EQ_INT(p.n, 2);
    ASSERT_EQ_INT(p.info[0].n_params, 1);
    ASSERT_EQ_INT(p.bucket[4], 0);
    ASSERT_EQ_INT(p.info[1].n_params, 4);
    ASSERT_EQ_INT(p.info[1].numel, 40);
}

TEST(oversized_parameter_gets_its_own_bucket)
{
    size_t numel[] = {5, 1000, 5};
    int dtype[] = {0, 0, 0};
    plan_t p;
    ASSERT_OK(plan(numel, dtype, 3, 100, 100, &p));
    ASSERT_EQ_INT(p.n, 3);
    ASSERT_EQ_INT(p.bucket[2], 0);
    ASSERT_EQ_INT(p.bucket[1], 1);
    ASSERT_EQ_INT(p.info[1].numel, 1000);
    ASSERT_EQ_INT(p.info[1].n_params, 1);
    ASSERT_EQ_INT(p.bucket[0], 2);
}

TEST(one_dtype_per_bucket)
{
    size_t numel[] = {4, 4, 4, 4};
    int dtype[] = {MPIDP_F32, MPIDP_F64, MPIDP_F32, MPIDP_F64};
    plan_t p;
    ASSERT_OK(plan(numel, dtype, 4, 1 << 20, 1 << 20, &p));
    ASSERT_EQ_INT(p.n, 2);
    for (int i = 0; i < 4; i++) ASSERT_EQ_INT(p.info[p.bucket[i]].dtype, dtype[i]);
    ASSERT_EQ_INT(p.bucket[3], 0); /* float64 opened first (reverse order) */
    ASSERT_EQ_INT(p.bucket[2], 1);
    ASSERT_EQ_INT(p.offset[1], 4);
    ASSERT_EQ_INT(p.offset[0], 4);
}

TEST(every_parameter_is_placed_exactly_once)
{
    size_t numel[MAXP];
    int dtype[MAXP];
    for (int i = 0; i < MAXP; i++) {
        numel[i] = (size_t)(i * 37 % 11);  /* includes zero-element parameters */
        dtype[i] = i % 3 == 0 ? MPIDP_F64 : MPIDP_F32;
    }
    plan_t p;
    ASSERT_OK(plan(numel, dtype, MAXP, 16, 64, &p));
    /* Offsets tile each bucket exactly: summing sizes per bucket gives numel. */
    size_t total[MAXP] = {0};
    size_t count[MAXP] = {0};
    for (int i = 0; i < MAXP; i++) {
        ASSERT_TRUE(p.bucket[i] < p.n);
        ASSERT_TRUE(p.offset[i] + numel[i] <= p.info[p.bucket[i]].numel);
        total[p.bucket[i]] += numel[i];
        count[p.bucket[i]]++;
    }
    for (size_t b = 0; b < p.n; b++) {
        ASSERT_EQ_INT(total[b], p.info[b].numel);
        ASSERT_EQ_INT(count[b], p.info[b].n_params);
    }
}

TEST(bad_arguments)
{
    size_t numel[] = {1};
    int bad_dtype[] = {99};
    int dtype[] = {0};
    plan_t p;
    ASSERT_EQ_INT(plan(numel, bad_dtype, 1, 8, 8, &p), MPIDP_EINVAL);
    ASSERT_EQ_INT(plan(numel, dtype, 1, 0, 8, &p), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_bucket_plan(NULL, dtype, 1, 8, 8, p.bucket, p.offset, p.info, &p.n),
                  MPIDP_EINVAL);
    ASSERT_OK(plan(numel, dtype, 0, 8, 8, &p));
    ASSERT_EQ_INT(p.n, 0);
}

TEST_MAIN(reverse_order_and_offsets, small_first_bucket,
          oversized_parameter_gets_its_own_bucket, one_dtype_per_bucket,
          every_parameter_is_placed_exactly_once, bad_arguments)
