/* mpidp_comm_dup across real ranks (mpirun -np 2, also 3 and 4): the
 * duplicate has the user's ranks in the user's order, returns errors
 * instead of aborting, and is a communicator of its own (a message on the
 * user's communicator is not received on it). */
#include <mpi.h>

#include "mpidp/comm.h"
#include "mpidp/status.h"
#include "mpi_world.h"
#include "test.h"

TEST(duplicate_keeps_the_ranks_and_returns_errors)
{
    mpidp_reqtable_t *reqs = table(4);
    MPI_Comm dup = MPI_COMM_NULL;
    int rank = -1, size = -1, in_flight = 1;
    ASSERT_OK(mpidp_comm_dup(MPI_COMM_WORLD, reqs, 10.0, &dup, &rank, &size, &in_flight));
    ASSERT_EQ_INT(rank, rank_);
    ASSERT_EQ_INT(size, size_);
    ASSERT_EQ_INT(in_flight, 0);
    MPI_Errhandler eh;
    MPI_Comm_get_errhandler(dup, &eh);
    ASSERT_TRUE(eh == MPI_ERRORS_RETURN);
    MPI_Errhandler_free(&eh);
    int result = MPI_UNEQUAL;
    MPI_Comm_compare(dup, MPI_COMM_WORLD, &result);
    ASSERT_EQ_INT(result, MPI_CONGRUENT);
    /* an error comes back as a code: a send to a rank that does not exist */
    int x = 0;
    ASSERT_TRUE(MPI_Send(&x, 1, MPI_INT, size_ + 3, 0, dup) != MPI_SUCCESS);
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    MPI_Comm_free(&dup);
    ASSERT_EQ_INT(mpidp_comm_dup(MPI_COMM_WORLD, NULL, 10.0, &dup, &rank, &size, &in_flight),
                  MPIDP_EINVAL);
    ASSERT_OK(mpidp_reqtable_destroy(reqs));
}

TEST_MAIN_MPI(duplicate_keeps_the_ranks_and_returns_errors)
