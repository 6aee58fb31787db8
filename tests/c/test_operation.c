/* mpidp_operation_finish: wait, then free, over any engine's table; what
 * happens to the operation and to the error detail for each outcome. */
#include <string.h>

#include "mpidp/operation.h"
#include "mpidp/status.h"
#include "test.h"

/* An operation whose wait and free return what the test sets, counting calls. */
typedef struct {
    int wait_rc, free_rc;
    int waits, frees;
} fake_t;

static int fake_test(void *op, int *done)
{
    (void)op;
    *done = 1;
    return MPIDP_OK;
}

static int fake_wait(void *op, double timeout_s)
{
    (void)timeout_s;
    fake_t *f = op;
    f->waits++;
    return f->wait_rc == MPIDP_OK ? MPIDP_OK : mpidp__fail(f->wait_rc, "the wait failed");
}

static int fake_free(void *op)
{
    fake_t *f = op;
    f->frees++;
    return f->free_rc == MPIDP_OK ? MPIDP_OK : mpidp__fail(f->free_rc, "the free failed");
}

static const mpidp_operation_t fake_ops = {fake_test, fake_wait, fake_free};

TEST(a_completed_operation_is_freed)
{
    fake_t f = {MPIDP_OK, MPIDP_OK, 0, 0};
    int ended = -1;
    ASSERT_OK(mpidp_operation_finish(&fake_ops, &f, 1.0, &ended));
    ASSERT_EQ_INT(ended, 1);
    ASSERT_EQ_INT(f.waits, 1);
    ASSERT_EQ_INT(f.frees, 1);
}

TEST(a_timed_out_operation_is_kept)
{
    fake_t f = {MPIDP_ETIMEDOUT, MPIDP_OK, 0, 0};
    int ended = -1;
    ASSERT_EQ_INT(mpidp_operation_finish(&fake_ops, &f, 1.0, &ended), MPIDP_ETIMEDOUT);
    ASSERT_EQ_INT(ended, 0);
    ASSERT_EQ_INT(f.frees, 0); /* MPI may still write into its buffers */
}

TEST(a_failed_wait_is_reported_and_the_operation_freed)
{
    fake_t f = {MPIDP_EMPI, MPIDP_ESTATE, 0, 0};
    int ended = -1;
    ASSERT_EQ_INT(mpidp_operation_finish(&fake_ops, &f, 1.0, &ended), MPIDP_EMPI);
    ASSERT_EQ_INT(ended, 0); /* the free refused: buffers stay */
    ASSERT_TRUE(strstr(mpidp_error_detail(), "the wait failed") != NULL);
    f = (fake_t){MPIDP_EMPI, MPIDP_OK, 0, 0};
    ASSERT_EQ_INT(mpidp_operation_finish(&fake_ops, &f, 1.0, &ended), MPIDP_EMPI);
    ASSERT_EQ_INT(ended, 1);
}

TEST(a_refused_free_keeps_the_buffers)
{
    fake_t f = {MPIDP_OK, MPIDP_ESTATE, 0, 0};
    int ended = -1;
    ASSERT_EQ_INT(mpidp_operation_finish(&fake_ops, &f, 1.0, &ended), MPIDP_ESTATE);
    ASSERT_EQ_INT(ended, 0);
    ASSERT_EQ_INT(mpidp_operation_finish(NULL, &f, 1.0, &ended), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_operation_finish(&fake_ops, NULL, 1.0, &ended), MPIDP_EINVAL);
}

TEST_MAIN(a_completed_operation_is_freed, a_timed_out_operation_is_kept,
          a_failed_wait_is_reported_and_the_operation_freed, a_refused_free_keeps_the_buffers)
