/* The reducer's state machine at one rank: ordered posting, double marks,
 * flags, resets, layout checks. (Real reductions: test_mpi_reducer.c.) */
#include <mpi.h>

#include "mpidp/bucket.h"
#include "mpidp/reducer.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"
#include "test.h"

#include "reducer_fixture.h"

TEST(buckets_are_posted_in_order)
{
    fixture_t f;
    ASSERT_OK(setup(&f));
    ASSERT_EQ_INT(f.nb, 2);
    /* Bucket 1 fills first, but must wait for bucket 0. */
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 0, 1));
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 1, 1));
    ASSERT_EQ_INT(mpidp_reducer_bucket_state(f.r, 1), MPIDP_BUCKET_COLLECTING);
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 3, 1));
    ASSERT_EQ_INT(mpidp_reducer_bucket_state(f.r, 0), MPIDP_BUCKET_COLLECTING);
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 2, 1));
    ASSERT_EQ_INT(mpidp_reducer_bucket_state(f.r, 0), MPIDP_BUCKET_DONE);
    ASSERT_EQ_INT(mpidp_reducer_bucket_state(f.r, 1), MPIDP_BUCKET_DONE);
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    ASSERT_OK(mpidp_reducer_reset(f.r));
    ASSERT_EQ_INT(mpidp_reducer_n_ready(f.r), 0);
    teardown(&f);
}

TEST(second_gradient_in_one_pass_is_refused)
{
    fixture_t f;
    ASSERT_OK(setup(&f));
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 3, 1));
    ASSERT_EQ_INT(mpidp_reducer_mark_ready(f.r, 3, 1), MPIDP_ESTATE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "second gradient") != NULL);
    ASSERT_EQ_INT(mpidp_reducer_mark_ready(f.r, 99, 1), MPIDP_EINVAL);
    teardown(&f);
}

TEST(unused_parameter_is_zeroed_and_flagged)
{
    fixture_t f;
    ASSERT_OK(setup(&f));
    size_t b = f.bucket[2], off = f.offset[2];
    for (int k = 0; k < 8; k++) f.storage[b][off + (size_t)k] = 5.0f;
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 3, 1));
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 2, 0));
    for (int k = 0; k < 8; k++) ASSERT_NEAR(f.storage[b][off + (size_t)k], 0.0, 0);
    int used = -1;
    ASSERT_OK(mpidp_reducer_used_globally(f.r, 2, &used));
    ASSERT_EQ_INT(used, 0);
    ASSERT_OK(mpidp_reducer_used_globally(f.r, 3, &used));
    ASSERT_EQ_INT(used, 1);
    /* Bucket 1 has not completed: its flags cannot be read yet. */
    ASSERT_EQ_INT(mpidp_reducer_used_globally(f.r, 0, &used), MPIDP_ESTATE);
    teardown(&f);
}

TEST(reset_and_wait_refuse_unfinished_pass)
{
    fixture_t f;
    ASSERT_OK(setup(&f));
    ASSERT_OK(mpidp_reducer_reset(f.r)); /* nothing marked: fine */
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 0, 1));
    ASSERT_EQ_INT(mpidp_reducer_reset(f.r), MPIDP_ESTATE);
    ASSERT_EQ_INT(mpidp_reducer_wait_bucket(f.r, 1, 0.1), MPIDP_ESTATE);
    ASSERT_EQ_INT(mpidp_reducer_wait_all(f.r, 0.1), MPIDP_ESTATE);
    teardown(&f);
}

TEST(buckets_that_do_not_match_the_plan_are_refused)
{
    fixture_t f;
    ASSERT_OK(setup(&f));
    mpidp_reducer_t *r2 = NULL;
    mpidp_reducer_config_t cfg = {
        .comm = MPI_COMM_SELF, .reqs = f.reqs, .n_params = NP, .param_numel = f.numel,
        .param_dtype = f.dtype, .first_cap = 64, .cap = 64, .n_buckets = f.nb,
        .bucket_tensors = f.tensors, .wire_dtype = -1, .name = "bad"};
    cfg.n_buckets = f.nb - 1; /* one bucket short of the plan */
    ASSERT_EQ_INT(mpidp_reducer_create(&cfg, &r2), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "1 bucket tensors for a plan of 2") != NULL);
    cfg.n_buckets = f.nb;
    cfg.cap = 32; /* another plan: more buckets than tensors */
    ASSERT_EQ_INT(mpidp_reducer_create(&cfg, &r2), MPIDP_EINVAL);
    cfg.cap = 64;
    f.tensors[1].numel -= 1; /* one element short */
    ASSERT_EQ_INT(mpidp_reducer_create(&cfg, &r2), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "bucket 1: expected a writable host tensor of 18 "
                                             "float32 elements, got 17 float32") != NULL);
    f.tensors[1].numel += 1;
    f.tensors[0].dtype = MPIDP_F64; /* not the parameters' dtype */
    ASSERT_EQ_INT(mpidp_reducer_create(&cfg, &r2), MPIDP_EINVAL);
    f.tensors[0].dtype = MPIDP_F32;
    f.tensors[0].read_only = 1;
    ASSERT_EQ_INT(mpidp_reducer_create(&cfg, &r2), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "(read-only)") != NULL);
    f.tensors[0].read_only = 0;
    f.tensors[0].device = MPIDP_DEV_CUDA;
    ASSERT_EQ_INT(mpidp_reducer_create(&cfg, &r2), MPIDP_EINVAL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "in device memory") != NULL);
    f.tensors[0].device = MPIDP_DEV_CPU;
    f.dtype[1] = 99; /* no such dtype */
    ASSERT_EQ_INT(mpidp_reducer_create(&cfg, &r2), MPIDP_EINVAL);
    f.dtype[1] = MPIDP_F32;
    cfg.wire_dtype = MPIDP_F64; /* only bf16/fp16 can be wire dtypes */
    ASSERT_EQ_INT(mpidp_reducer_create(&cfg, &r2), MPIDP_EINVAL);
    for (int i = 0; i < NP; i++) f.dtype[i] = MPIDP_F64; /* float64 cannot be compressed */
    static double storage[NP][NP * 9];
    void *data[NP] = {storage[0], storage[1], storage[2], storage[3]};
    ASSERT_OK(mpidp_bucket_plan(f.numel, f.dtype, NP, 64, 64, f.bucket, f.offset, f.info, &f.nb));
    bucket_tensors(f.tensors, data, f.info, f.nb);
    cfg.n_buckets = f.nb;
    cfg.wire_dtype = MPIDP_BF16;
    ASSERT_EQ_INT(mpidp_reducer_create(&cfg, &r2), MPIDP_EDTYPE);
    cfg.wire_dtype = -1; /* the same float64 buckets reduce uncompressed */
    ASSERT_OK(mpidp_reducer_create(&cfg, &r2));
    ASSERT_OK(mpidp_reducer_destroy(r2));
    teardown(&f);
}

TEST(staged_buckets_wait_for_the_caller_and_say_what_to_copy)
{
    fixture_t f;
    ASSERT_OK(setup_mode(&f, 1, 0));
    size_t b = 99;
    ASSERT_EQ_INT(mpidp_reducer_next_to_stage(f.r, 0, &b), 0);          /* nothing full yet */
    ASSERT_EQ_INT(mpidp_reducer_staged(f.r, 0), MPIDP_ESTATE);
    /* Bucket 1 fills first: it may be staged at once, but not posted before 0. */
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 0, 1));
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 1, 1));
    ASSERT_EQ_INT(mpidp_reducer_next_to_stage(f.r, 0, &b), 1);
    ASSERT_EQ_INT(b, 1);
    ASSERT_OK(mpidp_reducer_staged(f.r, 1));
    ASSERT_EQ_INT(mpidp_reducer_staged(f.r, 1), MPIDP_ESTATE);       /* once */
    ASSERT_EQ_INT(mpidp_reducer_bucket_state(f.r, 1), MPIDP_BUCKET_COLLECTING);
    ASSERT_EQ_INT(mpidp_reducer_next_to_stage(f.r, 0, &b), 0);
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 3, 1));
    ASSERT_OK(mpidp_reducer_mark_ready(f.r, 2, 1));
    /* Full but not staged: the core reads nothing yet. */
    ASSERT_EQ_INT(mpidp_reducer_bucket_state(f.r, 0), MPIDP_BUCKET_COLLECTING);
    ASSERT_EQ_INT(mpidp_reducer_next_to_stage(f.r, 0, &b), 1);
    ASSERT_EQ_INT(b, 0);
    ASSERT_EQ_INT(mpidp_reducer_next_to_stage(f.r, 1, &b), 0);        /* none from 1 on */
    ASSERT_EQ_INT(mpidp_reducer_needs_unstaging(f.r, 0), 0);
    ASSERT_OK(mpidp_reducer_staged(f.r, 0));                          /* posts 0, then 1 */
    ASSERT_EQ_INT(mpidp_reducer_bucket_state(f.r, 0), MPIDP_BUCKET_DONE);
    ASSERT_EQ_INT(mpidp_reducer_bucket_state(f.r, 1), MPIDP_BUCKET_DONE);
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    for (size_t k = 0; k < 2; k++) {
        ASSERT_EQ_INT(mpidp_reducer_needs_unstaging(f.r, k), 1);
        ASSERT_OK(mpidp_reducer_unstaged(f.r, k));
        ASSERT_EQ_INT(mpidp_reducer_needs_unstaging(f.r, k), 0);
    }
    ASSERT_EQ_INT(mpidp_reducer_unstaged(f.r, 0), MPIDP_ESTATE);
    ASSERT_OK(mpidp_reducer_reset(f.r));
    ASSERT_EQ_INT(mpidp_reducer_needs_unstaging(f.r, 0), 0);          /* a new pass */
    teardown(&f);
}

TEST(nothing_to_stage_or_unstage_outside_staged_mode)
{
    fixture_t f;
    ASSERT_OK(setup(&f));
    for (size_t i = 0; i < NP; i++) ASSERT_OK(mpidp_reducer_mark_ready(f.r, i, 1));
    size_t b;
    ASSERT_EQ_INT(mpidp_reducer_next_to_stage(f.r, 0, &b), 0);
    ASSERT_EQ_INT(mpidp_reducer_needs_unstaging(f.r, 0), 0);
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    teardown(&f);
    /* Staged and separate: results are delivered by the caller, not copied back. */
    ASSERT_OK(setup_mode(&f, 1, 1));
    for (size_t i = 0; i < NP; i++) ASSERT_OK(mpidp_reducer_mark_ready(f.r, i, 1));
    while (mpidp_reducer_next_to_stage(f.r, 0, &b)) ASSERT_OK(mpidp_reducer_staged(f.r, b));
    ASSERT_OK(mpidp_reducer_wait_all(f.r, 1.0));
    ASSERT_EQ_INT(mpidp_reducer_needs_unstaging(f.r, 0), 0);
    teardown(&f);
}

TEST(bucket_parameter_lists_follow_the_layout)
{
    fixture_t f;
    ASSERT_OK(setup(&f));
    const size_t *members;
    ASSERT_EQ_INT(mpidp_reducer_bucket_params(f.r, 0, &members), 2);   /* params 3, 2: */
    ASSERT_EQ_INT(members[0], 2);                                       /* index order */
    ASSERT_EQ_INT(members[1], 3);
    ASSERT_EQ_INT(mpidp_reducer_bucket_params(f.r, 1, &members), 2);
    ASSERT_EQ_INT(members[0], 0);
    ASSERT_EQ_INT(members[1], 1);
    ASSERT_EQ_INT(mpidp_reducer_bucket_params(f.r, 2, &members), 0);
    for (size_t b = 0; b < f.nb; b++) {
        size_t n = mpidp_reducer_bucket_params(f.r, b, &members);
        for (size_t k = 0; k < n; k++) ASSERT_EQ_INT(mpidp_reducer_bucket_of(f.r, members[k]), b);
    }
    teardown(&f);
}

/* Every combination of what the user did, against the rule written out. */
TEST(nonblocking_decisions_cover_every_case)
{
    for (int is_view = 0; is_view < 2; is_view++)
        for (int cleared = 0; cleared < 2; cleared++)
            for (int used = 0; used < 2; used++)
                for (int was_none = 0; was_none < 2; was_none++)
                    for (int arrived = 0; arrived < 2; arrived++) {
                        int want = !is_view || cleared ? MPIDP_ACCUM_DROP
                                   : (!used && was_none && !arrived) ? MPIDP_ACCUM_ADD_THEN_NONE
                                   : MPIDP_ACCUM_ADD;
                        ASSERT_EQ_INT(mpidp_reducer_accumulate_action(is_view, cleared, used,
                                                                      was_none, arrived), want);
                    }
    for (int none = 0; none < 2; none++)
        for (int cleared = 0; cleared < 2; cleared++)
            for (int used = 0; used < 2; used++)
                for (int was_none = 0; was_none < 2; was_none++) {
                    int want = none ? MPIDP_AFTER_NONE : cleared ? MPIDP_AFTER_ZEROED
                               : (!used && was_none) ? MPIDP_AFTER_NONE : MPIDP_AFTER_VIEW;
                    ASSERT_EQ_INT(mpidp_reducer_after_step_action(none, cleared, used, was_none), want);
                }
    /* The cases users hit, by name. */
    ASSERT_EQ_INT(mpidp_reducer_after_step_action(1, 0, 1, 0), MPIDP_AFTER_NONE);   /* zero_grad(set_to_none) */
    ASSERT_EQ_INT(mpidp_reducer_after_step_action(0, 1, 1, 0), MPIDP_AFTER_ZEROED); /* zero_grad(False) */
    ASSERT_EQ_INT(mpidp_reducer_after_step_action(0, 0, 1, 1), MPIDP_AFTER_VIEW);   /* no zero_grad: mean */
    ASSERT_EQ_INT(mpidp_reducer_after_step_action(0, 0, 0, 1), MPIDP_AFTER_NONE);   /* unused everywhere */
}

TEST_MAIN_MPI(buckets_are_posted_in_order, second_gradient_in_one_pass_is_refused,
              unused_parameter_is_zeroed_and_flagged, reset_and_wait_refuse_unfinished_pass,
              buckets_that_do_not_match_the_plan_are_refused,
              staged_buckets_wait_for_the_caller_and_say_what_to_copy,
              nothing_to_stage_or_unstage_outside_staged_mode,
              bucket_parameter_lists_follow_the_layout, nonblocking_decisions_cover_every_case)
