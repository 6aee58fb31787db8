/* mpidp's own duplicate of a user's communicator.
 *
 * Every engine posts on a duplicate, never on the user's communicator, so
 * that mpidp's messages cannot match the program's, and the duplicate has
 * MPI_ERRORS_RETURN so that a failure comes back as a status. MPI_Comm_dup
 * is collective: a rank that never joins would block the others forever,
 * so the duplicate is made with MPI_Comm_idup through the request table and
 * waited for with the deadline of every wait. */
#ifndef MPIDP_COMM_H
#define MPIDP_COMM_H

#include <mpi.h>

#include "mpidp/reqtable.h"

/* Duplicates `user` into *out (MPI_ERRORS_RETURN set) and reports this
 * rank's number and the size. Collective over user.
 *
 * On failure *out is MPI_COMM_NULL, except when the duplication was posted
 * but did not complete (MPIDP_ETIMEDOUT, MPIDP_EDEPARTED): then
 * *in_flight = 1 and MPI will still write the new handle into *out, so
 * the memory *out points to must never be freed or reused. */
int mpidp_comm_dup(MPI_Comm user, mpidp_reqtable_t *reqs, double timeout_s, MPI_Comm *out,
                   int *rank, int *size, int *in_flight);

/* Frees a duplicate made by mpidp_comm_dup (*c becomes MPI_COMM_NULL);
 * nothing after MPI_Finalize, when no handle may be freed. */
void mpidp_comm_free(MPI_Comm *c);

#endif /* MPIDP_COMM_H */
