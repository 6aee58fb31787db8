/* Core-private: what the request table's waits ask of the departures. */
#ifndef MPIDP_CORE_DEPARTURES_INTERNAL_H
#define MPIDP_CORE_DEPARTURES_INTERNAL_H

#include "mpidp/departures.h"

/* For the request table's waits: MPIDP_EDEPARTED (with a detail naming the
 * rank and `what`) when a rank of `comm` (MPI_COMM_NULL: any rank) has gone
 * and max(its notice, wait_start) lies more than the grace before `now`;
 * MPIDP_OK otherwise, also when not started. */
int mpidp__departures_check(MPI_Comm comm, double wait_start, double now, const char *what);

#endif /* MPIDP_CORE_DEPARTURES_INTERNAL_H */
