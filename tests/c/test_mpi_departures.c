/* Ranks that end their program (mpidp/departures.h), across real ranks
 * (mpirun -np 2, also 3 and 4): the last rank announces that it is gone;
 * every other rank's wait for a message from it ends with MPIDP_EDEPARTED
 * naming it once the grace has passed, while a collective among the ranks
 * that remain completes; checks before the start, or after this rank's own
 * announcement, find nothing. */
#include <mpi.h>
#include <string.h>

#include "mpidp/departures.h"
#include "mpi_util.h"
#include "post.h"
#include "mpidp/status.h"
#include "mpi_world.h"
#include "test.h"
#include "departures_internal.h"

TEST(checks_before_start_find_nothing)
{
    mpidp_reqtable_t *reqs = table(4);
    ASSERT_OK(mpidp__departures_check(MPI_COMM_WORLD, 0.0, 1e9, "x"));
    mpidp_reqtable_destroy(reqs);
}

TEST(a_wait_for_a_rank_that_ended_names_it_and_the_others_go_on)
{
    mpidp_reqtable_t *reqs = table(8);
    ASSERT_OK(mpidp_departures_start(MPI_COMM_WORLD));
    ASSERT_OK(mpidp_departures_start(MPI_COMM_WORLD));     /* a second start: nothing */
    mpidp_departures_set_grace(0.2);
    int last = size_ - 1;
    MPI_Comm rest;
    MPI_Comm_split(MPI_COMM_WORLD, rank_ == last ? MPI_UNDEFINED : 0, rank_, &rest);
    if (rank_ == last) {
        ASSERT_OK(mpidp_departures_announce());
        ASSERT_OK(mpidp_departures_announce());            /* once only */
    } else {
        /* A message the last rank never sends. */
        int buf = 0;
        MPI_Request req, copy;
        mpidp_req_t h, slot;
        ASSERT_OK(mpidp_reqtable_claim(reqs, "a receive from the last rank", &slot));
        MPI_Irecv(&buf, 1, MPI_INT, last, 99, MPI_COMM_WORLD, &req);
        copy = req;
        ASSERT_OK(mpidp__post_done(reqs, slot, MPI_SUCCESS, req, MPI_COMM_WORLD,
                                   "a receive from the last rank", &h));
        double t0 = mpidp_now();
        ASSERT_EQ_INT(mpidp_reqtable_wait(reqs, h, 30.0), MPIDP_EDEPARTED);
        ASSERT_TRUE(mpidp_now() - t0 >= 0.2);
        char want[64];
        snprintf(want, sizeof want, "rank %d of the job has ended its program", last);
        ASSERT_TRUE(strstr(mpidp_error_detail(), want) != NULL);
        ASSERT_TRUE(strstr(mpidp_error_detail(), "a receive from the last rank") != NULL);
        MPI_Cancel(&copy);
        ASSERT_EQ_INT(mpidp_reqtable_wait_all(reqs, 30.0) == MPIDP_OK, 1);
        if (rest != MPI_COMM_NULL) {
            /* Among the ranks that remain, the gone rank is no reason to stop. */
            MPI_Request b;
            ASSERT_OK(mpidp_reqtable_claim(reqs, "barrier of the rest", &slot));
            MPI_Ibarrier(rest, &b);
            ASSERT_OK(mpidp__post_done(reqs, slot, MPI_SUCCESS, b, rest, "barrier", &h));
            ASSERT_OK(mpidp_reqtable_wait(reqs, h, 30.0));
            MPI_Comm_free(&rest);
        }
        ASSERT_OK(mpidp_departures_announce());
        ASSERT_OK(mpidp__departures_check(MPI_COMM_WORLD, 0.0, 1e9, "after leaving"));
    }
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    mpidp_reqtable_destroy(reqs);
}

TEST_MAIN_MPI(checks_before_start_find_nothing,
              a_wait_for_a_rank_that_ended_names_it_and_the_others_go_on)
