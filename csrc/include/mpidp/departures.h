/* Ranks whose program has ended while others may still wait for them.
 *
 * A rank that leaves early -- sys.exit(1) on one rank, a checkpoint-on-
 * preemption SIGTERM handler raising SystemExit, a loop that ends sooner --
 * stays in MPI_Finalize, which waits for every rank, so mpirun sees nothing
 * wrong and the other ranks wait in their next collective until the
 * deadline (30 minutes by default). So as its program ends, after its own
 * pending operations have landed, every rank tells every other rank that it
 * is gone, on a duplicate of the world communicator of its own (a 4-byte
 * eager message each). The waits of the request table read these notices:
 * a wait for a request posted on a communicator that holds a rank that has
 * gone ends with MPIDP_EDEPARTED, naming the rank, once the request has not
 * completed within the grace (mpidp_departures_set_grace) since both the
 * notice and the start of the wait. What a rank that has gone took part in
 * has completed on its side, so such a request completes soon or never; the
 * grace covers the other ranks' share of it. At a normal end every rank's
 * operations complete before it leaves, so nobody is left waiting.
 *
 * Process-wide state (one MPI per process), guarded by a mutex. */
#ifndef MPIDP_DEPARTURES_H
#define MPIDP_DEPARTURES_H

#include <mpi.h>

#define MPIDP_DEPARTURE_GRACE_SECONDS 10.0

/* Duplicates `world` (collective over it: call it where every rank is) and
 * starts listening for notices. A second call does nothing. */
int mpidp_departures_start(MPI_Comm world);

/* Seconds a wait goes on after a rank of its communicator has gone (< 0
 * reads as 0). */
void mpidp_departures_set_grace(double seconds);
double mpidp_departures_grace(void);

/* This rank is leaving: stops listening and tells every other rank. Call it
 * once, after the rank's own operations have landed and before MPI_Finalize;
 * nothing when not started. */
int mpidp_departures_announce(void);

#endif /* MPIDP_DEPARTURES_H */
