/* The request table: claiming and registration, completion, deadlines,
 * descriptions; and the core's posting helper (core/mpi_util.h). */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "mpi_util.h"
#include "post.h"
#include "mpidp/reqtable.h"
#include "mpidp/status.h"
#include "test.h"
#include "reqtable_internal.h"

/* Registers an already posted request (claim + fill), as tests need. */
static int track(mpidp_reqtable_t *t, MPI_Request req, const char *what, mpidp_req_t *h)
{
    int rc = mpidp_reqtable_claim(t, what, h);
    if (rc == MPIDP_OK) mpidp_reqtable_fill(t, *h, req, MPI_COMM_SELF, what);
    return rc;
}

/* Posts a receive from ourselves that nobody sends (pending until
 * cancelled) into buf and registers it as `what`; *req is our copy of its
 * MPI handle, for cancel(). */
static int track_never_completing(mpidp_reqtable_t *t, int *buf, const char *what,
                                  MPI_Request *req, mpidp_req_t *h)
{
    MPI_Irecv(buf, 1, MPI_INT, 0, 4242, MPI_COMM_SELF, req);
    return track(t, *req, what, h);
}

/* Cancel through a copy of the handle: the table still owns the original and
 * must be the one to see it complete (completing it twice is an error). */
static void cancel(MPI_Request req) { MPI_Cancel(&req); }

TEST(completed_request_frees_its_slot)
{
    mpidp_reqtable_t *t;
    ASSERT_OK(mpidp_reqtable_create(2, &t));
    MPI_Request req;
    MPI_Ibarrier(MPI_COMM_SELF, &req);
    mpidp_req_t h;
    ASSERT_OK(track(t, req, "barrier", &h));
    ASSERT_EQ_INT(mpidp_reqtable_pending(t), 1);
    ASSERT_OK(mpidp_reqtable_wait(t, h, 5.0));
    ASSERT_EQ_INT(mpidp_reqtable_pending(t), 0);
    /* A stale handle reads as completed. */
    int done = 0;
    ASSERT_OK(mpidp_reqtable_test(t, h, &done));
    ASSERT_EQ_INT(done, 1);
    ASSERT_OK(mpidp_reqtable_destroy(t));
}

TEST(full_table_is_refused_and_slots_are_reused)
{
    mpidp_reqtable_t *t;
    ASSERT_OK(mpidp_reqtable_create(1, &t));
    int buf;
    MPI_Request pending;
    mpidp_req_t h1, h2;
    ASSERT_OK(track_never_completing(t, &buf, "recv", &pending, &h1));
    /* Full: refused before anything is posted, naming what was not posted. */
    ASSERT_EQ_INT(mpidp_reqtable_claim(t, "the barrier", &h2), MPIDP_EFULL);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "the barrier was not posted") != NULL);
    MPI_Request other;
    /* Destroying with a request in flight is refused. */
    ASSERT_EQ_INT(mpidp_reqtable_destroy(t), MPIDP_ESTATE);
    /* Cancel through our own copy of the handle, then let the table see it complete. */
    cancel(pending);
    ASSERT_OK(mpidp_reqtable_wait(t, h1, 5.0));
    MPI_Ibarrier(MPI_COMM_SELF, &other);
    ASSERT_OK(track(t, other, "barrier", &h2));
    ASSERT_EQ_INT(h2.slot, h1.slot);
    ASSERT_TRUE(h2.gen != h1.gen);
    ASSERT_OK(mpidp_reqtable_wait_all(t, 5.0));
    ASSERT_OK(mpidp_reqtable_destroy(t));
}

TEST(deadline_names_what_is_pending)
{
    mpidp_reqtable_t *t;
    ASSERT_OK(mpidp_reqtable_create(4, &t));
    int buf;
    MPI_Request req;
    mpidp_req_t h;
    ASSERT_OK(track_never_completing(t, &buf, "MPI_Iallreduce of bucket 3", &req, &h));
    double t0 = mpidp_now();
    ASSERT_EQ_INT(mpidp_reqtable_wait(t, h, 0.05), MPIDP_ETIMEDOUT);
    ASSERT_TRUE(mpidp_now() - t0 >= 0.05);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "MPI_Iallreduce of bucket 3") != NULL);
    ASSERT_EQ_INT(mpidp_reqtable_wait_all(t, 0.02), MPIDP_ETIMEDOUT);
    ASSERT_EQ_INT(mpidp_reqtable_pending(t), 1);
    char text[256];
    mpidp_reqtable_describe(t, text, sizeof text);
    ASSERT_TRUE(strstr(text, "bucket 3") != NULL);
    cancel(req);
    size_t n_done = 0;
    ASSERT_OK(mpidp_reqtable_progress(t, &n_done));
    ASSERT_EQ_INT(n_done, 1);
    mpidp_reqtable_describe(t, text, sizeof text);
    ASSERT_STREQ(text, "nothing");
    ASSERT_OK(mpidp_reqtable_destroy(t));
}

/* Progress tests exactly the live requests, wherever they sit and in
 * whatever order they complete: a subset is cancelled in each round (slots
 * spread over the table by reuse), and the table must complete those and
 * keep every other one, by count and by description. */
TEST(progress_completes_exactly_the_finished_requests)
{
    enum { CAP = 64, N = 40 };
    mpidp_reqtable_t *t;
    ASSERT_OK(mpidp_reqtable_create(CAP, &t));
    int buf[N];
    MPI_Request reqs[N];
    mpidp_req_t h[N];
    int live[N] = {0};
    size_t n_live = 0;
    for (int round = 0; round < 6; round++) {
        for (int i = 0; i < N; i++) {
            if (live[i]) continue;
            char what[32];
            snprintf(what, sizeof what, "recv %d", i);
            ASSERT_OK(track_never_completing(t, &buf[i], what, &reqs[i], &h[i]));
            live[i] = 1;
            n_live++;
        }
        size_t cancelled = 0;
        for (int i = 0; i < N; i++)
            if ((i * 7 + round * 3) % 5 < 2) {   /* a different subset each round */
                cancel(reqs[i]);
                live[i] = 0;
                cancelled++;
            }
        size_t n_done = 0;
        ASSERT_OK(mpidp_reqtable_progress(t, &n_done));
        ASSERT_EQ_INT(n_done, cancelled);
        n_live -= cancelled;
        ASSERT_EQ_INT(mpidp_reqtable_pending(t), n_live);
        char text[2048];
        mpidp_reqtable_describe(t, text, sizeof text);
        for (int i = 0; i < N; i++) {
            int done = 0;
            ASSERT_OK(mpidp_reqtable_test(t, h[i], &done));
            ASSERT_EQ_INT(done, !live[i]);
            char what[32];
            snprintf(what, sizeof what, "recv %d (", i);
            ASSERT_EQ_INT(strstr(text, what) != NULL, live[i]);
        }
    }
    for (int i = 0; i < N; i++)
        if (live[i]) cancel(reqs[i]);
    ASSERT_OK(mpidp_reqtable_wait_all(t, 5.0));
    ASSERT_OK(mpidp_reqtable_destroy(t));
}

TEST(bad_arguments)
{
    mpidp_reqtable_t *t = NULL;
    ASSERT_EQ_INT(mpidp_reqtable_create(0, &t), MPIDP_EINVAL);
    ASSERT_OK(mpidp_reqtable_create(1, &t));
    int done = 0;
    ASSERT_OK(mpidp_reqtable_test(t, MPIDP_REQ_NONE, &done));
    ASSERT_EQ_INT(done, 1);
    ASSERT_EQ_INT(mpidp_reqtable_claim(t, "x", NULL), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_reqtable_claim(NULL, "x", &(mpidp_req_t){0, 0}), MPIDP_EINVAL);
    /* Filling or releasing a handle that was never claimed changes nothing. */
    mpidp_reqtable_fill(t, (mpidp_req_t){0, 77}, MPI_REQUEST_NULL, MPI_COMM_SELF, "x");
    mpidp_reqtable_unclaim(t, (mpidp_req_t){0, 77});
    ASSERT_EQ_INT(mpidp_reqtable_pending(t), 0);
    ASSERT_OK(mpidp_reqtable_destroy(t));
}

TEST(claimed_slots_are_neither_pending_nor_free)
{
    mpidp_reqtable_t *t;
    ASSERT_OK(mpidp_reqtable_create(1, &t));
    mpidp_req_t h, h2;
    ASSERT_OK(mpidp_reqtable_claim(t, "a", &h));
    ASSERT_EQ_INT(mpidp_reqtable_pending(t), 0);       /* nothing posted yet */
    ASSERT_EQ_INT(mpidp_reqtable_claim(t, "b", &h2), MPIDP_EFULL);
    ASSERT_EQ_INT(mpidp_reqtable_destroy(t), MPIDP_ESTATE);
    int done = 0;
    ASSERT_OK(mpidp_reqtable_test(t, h, &done));      /* no request: reads as done */
    ASSERT_EQ_INT(done, 1);
    mpidp_reqtable_unclaim(t, h);
    ASSERT_OK(mpidp_reqtable_claim(t, "b", &h2));
    ASSERT_TRUE(h2.gen != h.gen);
    mpidp_reqtable_unclaim(t, h2);
    ASSERT_OK(mpidp_reqtable_destroy(t));
}

TEST(post_done_registers_or_translates_the_failure)
{
    mpidp_reqtable_t *t;
    ASSERT_OK(mpidp_reqtable_create(1, &t));
    mpidp_req_t slot, h = MPIDP_REQ_NONE;
    /* A failed post frees its slot and reports MPI's message with the context. */
    ASSERT_OK(mpidp_reqtable_claim(t, "MPI_Ibcast of 3 float32", &slot));
    ASSERT_EQ_INT(mpidp__post_done(t, slot, MPI_ERR_COUNT, MPI_REQUEST_NULL, MPI_COMM_SELF,
                                   "MPI_Ibcast of 3 float32", &h), MPIDP_EMPI);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "MPI_Ibcast of 3 float32: ") != NULL);
    ASSERT_EQ_INT(h.gen, 0);
    /* A successful one is tracked and waited for. */
    ASSERT_OK(mpidp_reqtable_claim(t, "barrier", &slot));
    MPI_Request req;
    int rc = MPI_Ibarrier(MPI_COMM_SELF, &req);
    ASSERT_OK(mpidp__post_done(t, slot, rc, req, MPI_COMM_SELF, "barrier", &h));
    ASSERT_EQ_INT(h.gen, slot.gen);
    ASSERT_EQ_INT(mpidp_reqtable_pending(t), 1);
    ASSERT_OK(mpidp_reqtable_wait(t, h, 5.0));
    ASSERT_EQ_INT(mpidp__mpi_fail(MPI_ERR_TRUNCATE, "context %d", 7), MPIDP_EMPI);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "context 7: ") != NULL);
    ASSERT_OK(mpidp_reqtable_destroy(t));
}

/* A new table spins as long as MPI's word on shared cores says; the
 * setting reads back, clamped at 0; and a wait tests at once, then yields
 * the core while the spin lasts, then sleeps between tests. */
TEST(waits_spin_for_the_time_set_then_sleep)
{
    mpidp_reqtable_t *t;
    ASSERT_OK(mpidp_reqtable_create(4, &t));
    ASSERT_TRUE(mpidp_reqtable_spin(t) == (mpidp__mpi_yields_when_idle() ? MPIDP_SPIN_SHARED_CORES_SECONDS
                                                                         : MPIDP_SPIN_SECONDS));
    mpidp_reqtable_set_spin(t, 0.5);
    ASSERT_TRUE(mpidp_reqtable_spin(t) == 0.5);
    mpidp_reqtable_set_spin(t, -1.0);
    ASSERT_TRUE(mpidp_reqtable_spin(t) == 0.0);
    mpidp_reqtable_set_spin(t, 0.0 / 0.0);
    ASSERT_TRUE(mpidp_reqtable_spin(t) == 0.0);
    ASSERT_OK(mpidp_reqtable_destroy(t));
    ASSERT_EQ_INT(mpidp__wait_step(0, 1.0, 0.02), MPIDP__WAIT_TEST);
    ASSERT_EQ_INT(mpidp__wait_step(63, 1.0, 0.02), MPIDP__WAIT_TEST);
    ASSERT_EQ_INT(mpidp__wait_step(64, 0.0, 0.02), MPIDP__WAIT_YIELD);
    ASSERT_EQ_INT(mpidp__wait_step(1000, 0.019, 0.02), MPIDP__WAIT_YIELD);
    ASSERT_EQ_INT(mpidp__wait_step(1000, 0.02, 0.02), MPIDP__WAIT_SLEEP);
    ASSERT_EQ_INT(mpidp__wait_step(64, 0.0, 0.0), MPIDP__WAIT_SLEEP); /* spin 0: sleep at once */
}

/* MPI's word on whether this node's ranks share its cores: a boolean that
 * follows OMPI_MCA_mpi_yield_when_idle where it is set (mpirun also turns it
 * on by itself when it oversubscribes a node), the same on every call (the
 * tool interface is opened and closed each time). */
TEST(mpi_says_whether_it_yields_when_idle)
{
    int before = -1, after = -2;
    MPI_Query_thread(&before);
    int yields = mpidp__mpi_yields_when_idle();
    MPI_Query_thread(&after);
    ASSERT_EQ_INT(after, before); /* Open MPI's MPI_T_init_thread can overwrite it */
    ASSERT_TRUE(yields == 0 || yields == 1);
    ASSERT_EQ_INT(mpidp__mpi_yields_when_idle(), yields);
    const char *set = getenv("OMPI_MCA_mpi_yield_when_idle");
    if (set && strcmp(set, "1") == 0) ASSERT_EQ_INT(yields, 1);
    if (set && strcmp(set, "0") == 0) ASSERT_EQ_INT(yields, 0);
}

/* Open MPI's MPI_Iallreduce algorithm: `prefer` replaces only a 0 (Open
 * MPI's own choice), read back through the tool interface; the thread level
 * stays; an in-place allreduce still sums. (This test's process keeps the
 * algorithm it set: the variable is process-wide.) */
TEST(mpi_iallreduce_algorithm_is_preferred_only_over_open_mpis_choice)
{
    int level = -1, now = mpidp_mpi_iallreduce_algorithm(0);
    const char *set = getenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm");
    if (now == -1) return; /* not Open MPI's libnbc: nothing to choose */
    ASSERT_EQ_INT(now, set ? atoi(set) : 0);
    ASSERT_EQ_INT(mpidp_mpi_iallreduce_algorithm(0), now); /* prefer 0: a read */
    int chosen = mpidp_mpi_iallreduce_algorithm(3);
    ASSERT_EQ_INT(chosen, now == 0 ? 3 : now);
    ASSERT_EQ_INT(mpidp_mpi_iallreduce_algorithm(1), chosen); /* not 0 any more: kept */
    MPI_Query_thread(&level);
    ASSERT_EQ_INT(level, MPI_THREAD_MULTIPLE);
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    float x[1000];
    for (int i = 0; i < 1000; i++) x[i] = (float)(rank + i);
    MPI_Request req;
    ASSERT_EQ_INT(MPI_Iallreduce(MPI_IN_PLACE, x, 1000, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req),
                  MPI_SUCCESS);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
    for (int i = 0; i < 1000; i++)
        ASSERT_TRUE(x[i] == (float)(size * i + size * (size - 1) / 2));
}

TEST_MAIN_MPI_THREADS(completed_request_frees_its_slot, full_table_is_refused_and_slots_are_reused,
              deadline_names_what_is_pending, bad_arguments, claimed_slots_are_neither_pending_nor_free,
              post_done_registers_or_translates_the_failure,
              progress_completes_exactly_the_finished_requests,
              waits_spin_for_the_time_set_then_sleep, mpi_says_whether_it_yields_when_idle,
              mpi_iallreduce_algorithm_is_preferred_only_over_open_mpis_choice)
