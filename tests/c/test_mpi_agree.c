/* mpidp_agree across real ranks (mpirun -np 2, also 3 and 4): equal
 * signatures agree; one field that differs on any one rank, by any amount
 * and in either direction, disagrees on every rank; bad arguments are
 * refused before anything is posted. */
#include <limits.h>
#include <mpi.h>
#include <stdint.h>

#include "mpidp/agree.h"
#include "mpidp/status.h"
#include "mpi_world.h"
#include "test.h"

#define N 5

/* Whether the ranks agree on sig (-1 when the call itself failed). */
static int agree_on(const int64_t *sig, mpidp_reqtable_t *reqs)
{
    int agreed = -1;
    return mpidp_agree(MPI_COMM_WORLD, sig, N, reqs, 10.0, &agreed) == MPIDP_OK ? agreed : -1;
}

TEST(equal_signatures_agree)
{
    mpidp_reqtable_t *reqs = table(4);
    int64_t sig[N] = {7, -1, 0, INT64_MAX, INT64_MIN + 1};
    ASSERT_EQ_INT(agree_on(sig, reqs), 1);
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    mpidp_reqtable_destroy(reqs);
}

TEST(one_field_on_one_rank_disagrees_everywhere)
{
    mpidp_reqtable_t *reqs = table(4);
    static const int64_t deltas[] = {1, -1, 1000000007, -((int64_t)1 << 40)};
    for (int odd = 0; odd < size_; odd++)
        for (size_t field = 0; field < N; field++)
            for (size_t d = 0; d < sizeof deltas / sizeof *deltas; d++) {
                int64_t sig[N] = {3, 1, -4, 1, 5};
                if (rank_ == odd) sig[field] += deltas[d];
                ASSERT_EQ_INT(agree_on(sig, reqs), size_ == 1);
            }
    mpidp_reqtable_destroy(reqs);
}

TEST(bad_arguments_post_nothing)
{
    mpidp_reqtable_t *reqs = table(4);
    int64_t sig[MPIDP_AGREE_MAX_FIELDS + 1] = {INT64_MIN};
    int agreed = -1;
    ASSERT_EQ_INT(mpidp_agree(MPI_COMM_WORLD, sig, 1, reqs, 1.0, &agreed), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_agree(MPI_COMM_WORLD, sig + 1, 0, reqs, 1.0, &agreed), MPIDP_EINVAL);
    ASSERT_EQ_INT(mpidp_agree(MPI_COMM_WORLD, sig + 1, MPIDP_AGREE_MAX_FIELDS + 1, reqs, 1.0,
                              &agreed), MPIDP_EINVAL);
    ASSERT_EQ_INT(agreed, -1);
    ASSERT_EQ_INT((int)mpidp_reqtable_pending(reqs), 0);
    mpidp_reqtable_destroy(reqs);
}

TEST_MAIN_MPI(equal_signatures_agree, one_field_on_one_rank_disagrees_everywhere,
              bad_arguments_post_nothing)
