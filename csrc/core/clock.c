/* mpidp_now (mpidp/reqtable.h): the core's one clock, in a file of its own
 * so that what reads it (the request table's deadlines, the departures'
 * grace) depends on nothing else for it. */
#include <time.h>

#include "mpidp/reqtable.h"

double mpidp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
