/* Background averaging needs MPI_THREAD_MULTIPLE: a process whose MPI was
 * initialized with a lower thread level is refused, saying so. */
#include <mpi.h>
#include <string.h>

#include "mpidp/bgavg.h"
#include "mpidp/status.h"
#include "test.h"

TEST(a_lower_thread_level_is_refused_with_a_message)
{
    int level = MPI_THREAD_MULTIPLE;
    MPI_Query_thread(&level);
    ASSERT_TRUE(level != MPI_THREAD_MULTIPLE);    /* MPI_Init asks for MPI_THREAD_SINGLE */
    float w[4] = {1, 2, 3, 4};
    float *segs[1] = {w};
    size_t lens[1] = {4};
    mpidp_bgavg_opts_t o = {.segs = segs, .lens = lens, .n_segs = 1, .interval_s = 0.5,
                            .timeout_s = 10, .what = "AsyncModelAverageAlgorithm"};
    mpidp_bgavg_t *x = NULL;
    ASSERT_EQ_INT(mpidp_bgavg_start(MPI_COMM_WORLD, &o, &x), MPIDP_ESTATE);
    ASSERT_TRUE(strstr(mpidp_error_detail(), "MPI_THREAD_MULTIPLE") != NULL);
    ASSERT_TRUE(x == NULL);
}

TEST_MAIN_MPI(a_lower_thread_level_is_refused_with_a_message)
