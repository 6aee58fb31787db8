/* The per-process set-up of the C tests that run across ranks (test_mpi_*.c):
 * this rank and the world's size, the core's MPI operations, and a request
 * table to post into. */
#ifndef MPIDP_TEST_MPI_WORLD_H
#define MPIDP_TEST_MPI_WORLD_H

#include <mpi.h>

#include "mpidp/mpiops.h"
#include "mpidp/reqtable.h"

/* This process's rank in MPI_COMM_WORLD and the world's size, set by table(). */
static int rank_, size_;

/* A request table with room for `capacity` requests, after the set-up every
 * test needs (rank_ and size_ read, the MPI operations registered). Each test
 * calls it first, so the set-up does not depend on which test runs first or
 * alone. */
static inline mpidp_reqtable_t *table(size_t capacity)
{
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    mpidp_mpiops_init();
    mpidp_reqtable_t *t = NULL;
    mpidp_reqtable_create(capacity, &t);
    return t;
}

#endif /* MPIDP_TEST_MPI_WORLD_H */
