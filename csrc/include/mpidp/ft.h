/* Fault tolerance over ULFM, MPI's User-Level Failure Mitigation extension.
 *
 * With ULFM (Open MPI 5 launched with `mpirun --with-ft ulfm`), an operation
 * that needs a rank that died fails with MPI_ERR_PROC_FAILED (or
 * MPI_ERR_REVOKED once a survivor revoked the communicator) instead of
 * ending the job. The core reports both as MPIDP_EPEERFAILED. The rank that
 * sees such a failure revokes every communicator the core made
 * (mpidp_ft_revoke_all), so that no survivor is left waiting on a peer that
 * went to recovery; the agreement and the shrink that follow are done above
 * the core (mpidp/fault_tolerance/, through mpi4py). */
#ifndef MPIDP_FT_H
#define MPIDP_FT_H

#include <mpi.h>

/* 1 when mpidp was compiled against an MPI with the ULFM extension. */
int mpidp_ft_compiled(void);
/* 1 when, besides, this job runs with fault tolerance on (MPIX_FT attribute
 * of MPI_COMM_WORLD; Open MPI: mpirun --with-ft ulfm). */
int mpidp_ft_running(void);
/* 1 when `mpi_rc` is a ULFM error: a peer failed or the communicator was revoked. */
int mpidp_ft_is_peer_failure(int mpi_rc);

/* What an MPI error on `comm` is, with fault tolerance running: a peer's
 * failure (MPIX_ERR_PROC_FAILED or MPIX_ERR_REVOKED) where it is one, where
 * `comm` was revoked, or where it is of a class that a peer's death can cause
 * (MPI_ERR_OTHER: Open MPI's non-blocking collectives report a peer that died
 * mid-operation as "Error in NBC_Start_round"; a truncated message), whether
 * or not failure detection has named a failed rank yet: the ranks agree
 * afterwards whether one failed. Argument errors, and every error without
 * fault tolerance, are returned as they are. */
int mpidp_ft_classify(int mpi_rc, MPI_Comm comm);
/* The MPI error that this thread's last mpidp_ft_classify took for a
 * suspected failure (no failed rank known yet), once; else MPI_SUCCESS. */
int mpidp_ft_take_suspected(void);

/* 1 when fault tolerance is running and `comm` is revoked or has a failed
 * rank: what looks like another fault on it (a notification that makes no
 * sense) is the failure's doing. */
int mpidp_ft_comm_broken(MPI_Comm comm);

/* The communicators the core made (its duplicates), revoked together. */
void mpidp_ft_track(MPI_Comm c);
void mpidp_ft_untrack(MPI_Comm c);
/* Revokes every tracked communicator (a no-op without ULFM). Returns how
 * many were revoked now (already revoked ones are skipped). */
int mpidp_ft_revoke_all(void);

/* With fault tolerance running: posts every live rank's agreement over
 * `comm` (MPIX_Comm_iagree, which works on a revoked communicator and gives
 * every live rank the same bitwise AND of their *flag, or the same failure)
 * into *req; a rank whose own part failed (*flag 0) first revokes `comm`, so
 * that no rank is left in a call waiting for it. Returns MPI's code; without
 * ULFM, MPI_ERR_UNSUPPORTED_OPERATION and posts nothing. */
int mpidp_ft_post_agree(MPI_Comm comm, int *flag, MPI_Request *req);

/* Ends the process with status 0 `seconds` from now, from a thread of its
 * own, unless it has ended by then: after ranks were lost, Open MPI's
 * MPI_Finalize can wait forever for them (ompi#11404), and it runs once
 * the program is done. Returns 0, or -1 where no thread could start. */
int mpidp_ft_exit_watchdog(double seconds);

/* Makes the kernel end this process (SIGKILL) when the process that
 * launched it ends, where the system allows (Linux: PR_SET_PDEATHSIG; else a
 * no-op returning 1). Open MPI 5's launcher with ULFM does not kill a rank
 * that is busy outside MPI when another rank aborts the job: prterun exits
 * and that rank lives on, an orphan (reproduced: a survivor that never calls
 * recover(), the others aborting at the deadline). A rank must not outlive
 * its job. Returns 0, 1 where unsupported, or -1 where the launcher had
 * already gone (the process is then being killed). */
int mpidp_ft_end_with_launcher(void);

/* The job's communicator in fault-tolerant mode (mpidp's world after a
 * recovery: the survivors and the replacements that joined them), which
 * mpidp_abort_job aborts; not kept beyond the caller's own handle. */
void mpidp_ft_set_job_comm(MPI_Comm comm);

/* Ends the job: MPI_Abort over the job's communicator (mpidp_ft_set_job_comm;
 * MPI_COMM_WORLD until one is set), never returns. With ULFM running, Open
 * MPI 5's launcher (prterun --with-ft ulfm) can deadlock when several ranks
 * call MPI_Abort at the same moment -- every rank gone, the launcher waiting
 * forever (measured: 4 of 60 jobs whose 3 ranks all aborted, under load; 0
 * of 60 with the others a second behind rank 0). A job-wide error reaches
 * every rank at once, so there rank 0 of the job aborts at once and every
 * other rank a second later, by when rank 0's abort has usually ended it.
 * Should MPI_Abort not end the process within 10 s, it ends itself (_exit).
 * Without ULFM, at once. */
void mpidp_abort_job(int code);

#endif /* MPIDP_FT_H */
