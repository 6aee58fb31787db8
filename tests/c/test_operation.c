/* mpidp_operation_finish: wait, then free, over any engine's table; what
 * happens to the operation and to the error detail for each outcome; and
 * mpidp_handle_t, the state a Work keeps over one operation. */
#include <string.h>

#include "mpidp/operation.h"
#include "mpidp/status.h"
#include "test.h"
#include "fail.h"

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

/* An operation whose test reports `done` and `test_rc`. */
typedef struct {
    fake_t f;
    int done, test_rc, tests;
} fake_tested_t;

static int tested_test(void *op, int *done)
{
    fake_tested_t *t = op;
    t->tests++;
    *done = t->done;
    return t->test_rc == MPIDP_OK ? MPIDP_OK : mpidp__fail(t->test_rc, "the test failed");
}

static int tested_wait(void *op, double timeout_s) { return fake_wait(&((fake_tested_t *)op)->f, timeout_s); }
static int tested_free(void *op) { return fake_free(&((fake_tested_t *)op)->f); }

static const mpidp_operation_t tested_ops = {tested_test, tested_wait, tested_free};

TEST(a_handle_frees_its_operation_once_it_completed)
{
    fake_tested_t t = {{MPIDP_OK, MPIDP_OK, 0, 0}, 0, MPIDP_OK, 0};
    mpidp_handle_t h;
    mpidp_handle_init(&h, &tested_ops, &t);
    int done = -1;
    ASSERT_OK(mpidp_handle_test(&h, &done));
    ASSERT_EQ_INT(done, 0);
    ASSERT_TRUE(h.op != NULL); /* in flight: its buffers stay */
    t.done = 1;
    ASSERT_OK(mpidp_handle_test(&h, &done));
    ASSERT_EQ_INT(done, 1);
    ASSERT_TRUE(h.op == NULL);
    ASSERT_EQ_INT(t.f.frees, 1);
    /* Ended: later calls neither test, wait nor free again. */
    ASSERT_OK(mpidp_handle_test(&h, &done));
    ASSERT_OK(mpidp_handle_wait(&h, 1.0));
    ASSERT_OK(mpidp_handle_drop(&h, 1.0));
    ASSERT_EQ_INT(t.tests, 2);
    ASSERT_EQ_INT(t.f.waits, 0);
    ASSERT_EQ_INT(t.f.frees, 1);
}

TEST(a_handle_reports_a_failure_at_every_later_wait)
{
    fake_t f = {MPIDP_EMPI, MPIDP_OK, 0, 0};
    mpidp_handle_t h;
    mpidp_handle_init(&h, &fake_ops, &f);
    ASSERT_EQ_INT(mpidp_handle_wait(&h, 1.0), MPIDP_EMPI);
    ASSERT_TRUE(h.op == NULL && h.done);
    mpidp_error_clear();
    ASSERT_EQ_INT(mpidp_handle_wait(&h, 1.0), MPIDP_EMPI); /* a caught failure is never forgotten */
    ASSERT_TRUE(strstr(mpidp_error_detail(), "failed when it was first waited for") != NULL);
    ASSERT_EQ_INT(f.waits, 1);
    /* A test that finds a failure reports it once; the handle has ended. */
    fake_tested_t t = {{MPIDP_OK, MPIDP_OK, 0, 0}, 0, MPIDP_EMPI, 0};
    mpidp_handle_init(&h, &tested_ops, &t);
    int done = -1;
    ASSERT_EQ_INT(mpidp_handle_test(&h, &done), MPIDP_EMPI);
    ASSERT_EQ_INT(done, 1);
    ASSERT_EQ_INT(mpidp_handle_wait(&h, 1.0), MPIDP_EMPI);
}

TEST(a_handle_keeps_what_is_still_in_flight)
{
    fake_t f = {MPIDP_ETIMEDOUT, MPIDP_OK, 0, 0};
    mpidp_handle_t h;
    mpidp_handle_init(&h, &fake_ops, &f);
    ASSERT_EQ_INT(mpidp_handle_wait(&h, 0.0), MPIDP_ETIMEDOUT);
    ASSERT_TRUE(h.op != NULL && !h.done); /* still in flight: may be waited for again */
    ASSERT_EQ_INT(mpidp_handle_drop(&h, 0.0), MPIDP_ETIMEDOUT);
    ASSERT_TRUE(h.op != NULL); /* a drop that cannot finish leaves the buffers to be leaked */
    f.wait_rc = MPIDP_OK;
    ASSERT_OK(mpidp_handle_drop(&h, 1.0));
    ASSERT_TRUE(h.op == NULL);
    /* A part still in flight that the free refuses keeps the buffers too. */
    fake_t g = {MPIDP_OK, MPIDP_ESTATE, 0, 0};
    mpidp_handle_init(&h, &fake_ops, &g);
    ASSERT_OK(mpidp_handle_wait(&h, 1.0));
    ASSERT_TRUE(h.done && h.op != NULL);
}

TEST_MAIN(a_completed_operation_is_freed, a_timed_out_operation_is_kept,
          a_failed_wait_is_reported_and_the_operation_freed, a_refused_free_keeps_the_buffers,
          a_handle_frees_its_operation_once_it_completed,
          a_handle_reports_a_failure_at_every_later_wait, a_handle_keeps_what_is_still_in_flight)
