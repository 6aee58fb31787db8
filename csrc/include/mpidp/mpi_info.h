/* What the core knows of the MPI library beyond its standard calls: whether
 * MPI has finalized, and Open MPI's non-blocking allreduce algorithm. */
#ifndef MPIDP_MPI_INFO_H
#define MPIDP_MPI_INFO_H

/* Open MPI's choice of algorithm for a non-blocking allreduce (libnbc's
 * coll_libnbc_iallreduce_algorithm: 0 lets Open MPI choose, which for an
 * in-place call -- every allreduce mpidp posts -- is a binomial tree: reduce
 * to one rank, then broadcast, each rank's bytes crossing the network twice;
 * 1 ring, 2 binomial, 3 Rabenseifner's reduce-scatter + allgather, 4
 * recursive doubling). With `prefer` > 0, a 0 in force becomes `prefer`
 * (through the MPI tool interface, so also after MPI_Init; process-wide).
 * Returns the value in force, or -1 where MPI has no such variable (not Open
 * MPI, or no libnbc). */
int mpidp_mpi_iallreduce_algorithm(int prefer);

/* 1 once MPI_Finalize has run: no request can be tested or write any more,
 * and no handle may be freed. */
int mpidp_mpi_finalized(void);

/* 1 when the MPI library takes device (CUDA) pointers: built with CUDA
 * support (Open MPI's MPIX_CUDA_AWARE_SUPPORT) and, at run time,
 * MPIX_Query_cuda_support() says so; 0 otherwise or where MPI cannot tell. */
int mpidp_mpi_cuda_aware(void);

#endif /* MPIDP_MPI_INFO_H */
