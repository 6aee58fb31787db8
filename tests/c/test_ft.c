/* mpidp/ft.h on an MPI without ULFM (the suite's Open MPI 4.1; under ULFM
 * it is exercised by tests/fault_tolerance/ulfm): nothing claims fault tolerance, no error is
 * taken for a peer's failure, revoking is a no-op, tracking holds any number
 * of communicators; and the exit watchdog ends a process, with status 0, at
 * its time. */
#include <mpi.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "mpidp/ft.h"
#include "test.h"

TEST(without_ulfm_nothing_claims_fault_tolerance)
{
    ASSERT_EQ_INT(mpidp_ft_compiled(), 0);
    ASSERT_EQ_INT(mpidp_ft_running(), 0);
    ASSERT_EQ_INT(mpidp_ft_is_peer_failure(MPI_SUCCESS), 0);
    ASSERT_EQ_INT(mpidp_ft_is_peer_failure(MPI_ERR_OTHER), 0);
    ASSERT_EQ_INT(mpidp_ft_is_peer_failure(MPI_ERR_COMM), 0);
    ASSERT_EQ_INT(mpidp_ft_revoke_all(), 0);
    /* Without fault tolerance every error is what MPI said: the job ends on it. */
    ASSERT_EQ_INT(mpidp_ft_classify(MPI_ERR_OTHER, MPI_COMM_WORLD), MPI_ERR_OTHER);
    ASSERT_EQ_INT(mpidp_ft_classify(MPI_ERR_TRUNCATE, MPI_COMM_WORLD), MPI_ERR_TRUNCATE);
    ASSERT_EQ_INT(mpidp_ft_take_suspected(), MPI_SUCCESS);
}

TEST(tracking_holds_many_communicators_and_lets_them_go)
{
    enum { N = 40 };
    MPI_Comm comms[N];
    for (int i = 0; i < N; i++) {
        ASSERT_EQ_INT(MPI_Comm_dup(MPI_COMM_SELF, &comms[i]), MPI_SUCCESS);
        mpidp_ft_track(comms[i]);
    }
    ASSERT_EQ_INT(mpidp_ft_revoke_all(), 0);   /* no ULFM: nothing to revoke with */
    for (int i = N - 1; i >= 0; i -= 2) mpidp_ft_untrack(comms[i]);
    for (int i = 0; i < N; i += 2) mpidp_ft_untrack(comms[i]);
    mpidp_ft_untrack(comms[0]);                  /* untracked already: ignored */
    for (int i = 0; i < N; i++) MPI_Comm_free(&comms[i]);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

TEST(the_exit_watchdog_ends_the_process_with_status_0_at_its_time)
{
    double t0 = now_s();
    pid_t child = fork();
    ASSERT_TRUE(child >= 0);
    if (child == 0) {   /* no MPI here: a forked child must not touch it */
        if (mpidp_ft_exit_watchdog(0.2) != 0) _exit(7);
        sleep(20);
        _exit(9);
    }
    int status = 0;
    ASSERT_EQ_INT((int)waitpid(child, &status, 0), (int)child);
    double took = now_s() - t0;
    ASSERT_TRUE(WIFEXITED(status));
    ASSERT_EQ_INT(WEXITSTATUS(status), 0);
    ASSERT_TRUE(took >= 0.2 && took < 10.0);
}

TEST_MAIN_MPI(without_ulfm_nothing_claims_fault_tolerance,
              tracking_holds_many_communicators_and_lets_them_go,
              the_exit_watchdog_ends_the_process_with_status_0_at_its_time)
