/* ULFM support: error classes, run-time detection, revoking the core's
 * communicators (see mpidp/ft.h). */
#include "mpidp/ft.h"

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* ULFM declares its names in mpi-ext.h (Open MPI's MPI extensions). */
#if defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#endif

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI && defined(MPIX_ERR_PROC_FAILED)
#define MPIDP_HAVE_ULFM 1
#else
#define MPIDP_HAVE_ULFM 0
#endif

int mpidp_ft_compiled(void) { return MPIDP_HAVE_ULFM; }

int mpidp_ft_running(void)
{
#if MPIDP_HAVE_ULFM
    int *value = NULL, found = 0;
    if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPIX_FT, &value, &found) != MPI_SUCCESS) return 0;
    return found && value != NULL && *value != 0;
#else
    return 0;
#endif
}

int mpidp_ft_is_peer_failure(int mpi_rc)
{
#if MPIDP_HAVE_ULFM
    int cls = mpi_rc;
    if (MPI_Error_class(mpi_rc, &cls) != MPI_SUCCESS) cls = mpi_rc;
    return cls == MPIX_ERR_PROC_FAILED || cls == MPIX_ERR_PROC_FAILED_PENDING ||
           cls == MPIX_ERR_REVOKED;
#else
    (void)mpi_rc;
    return 0;
#endif
}

/* MPIX_Comm_get_failed (Open MPI 5) reads the failures without acknowledging
 * them, which would change what a later MPIX_Comm_agree reports. */
#if MPIDP_HAVE_ULFM && defined(OMPI_MAJOR_VERSION) && OMPI_MAJOR_VERSION >= 5
static int has_failed_rank(MPI_Comm comm)
{
    MPI_Group failed;
    int n = 0;
    if (MPIX_Comm_get_failed(comm, &failed) != MPI_SUCCESS) return 0;
    MPI_Group_size(failed, &n);
    MPI_Group_free(&failed);
    return n > 0;
}
#else
static int has_failed_rank(MPI_Comm comm)
{
    (void)comm;
    return 0;
}
#endif

/* Error classes that a peer's death can cause without MPI naming it: Open
 * MPI's libnbc ends a schedule whose round lost its peer with MPI_ERR_OTHER
 * ("Error in NBC_Start_round"), a message cut short is a truncation, and a
 * request of a failed multi-request call reports MPI_ERR_IN_STATUS. Argument
 * errors (counts, types, ops, buffers) are never among them. */
static int failure_can_cause(int mpi_rc)
{
    int cls = mpi_rc;
    if (MPI_Error_class(mpi_rc, &cls) != MPI_SUCCESS) cls = mpi_rc;
    return cls == MPI_ERR_OTHER || cls == MPI_ERR_INTERN || cls == MPI_ERR_TRUNCATE ||
           cls == MPI_ERR_IN_STATUS || cls == MPI_ERR_PENDING || cls == MPI_ERR_UNKNOWN;
}

static int is_revoked(MPI_Comm comm)
{
    int flag = 0;
#if MPIDP_HAVE_ULFM
    if (MPIX_Comm_is_revoked(comm, &flag) != MPI_SUCCESS) flag = 0;
#else
    (void)comm;
#endif
    return flag;
}

/* The error a suspected failure stood for, on this thread (see
 * mpidp_ft_take_suspected). */
static _Thread_local int suspected_rc = MPI_SUCCESS;

int mpidp_ft_take_suspected(void)
{
    int rc = suspected_rc;
    suspected_rc = MPI_SUCCESS;
    return rc;
}

int mpidp_ft_classify(int mpi_rc, MPI_Comm comm)
{
    if (mpi_rc == MPI_SUCCESS || comm == MPI_COMM_NULL || mpidp_ft_is_peer_failure(mpi_rc) ||
        !mpidp_ft_running())
        return mpi_rc;
#if MPIDP_HAVE_ULFM
    /* A survivor revoked it: it went to recovery because a rank failed. */
    if (is_revoked(comm)) return MPIX_ERR_REVOKED;
    if (!failure_can_cause(mpi_rc)) return mpi_rc;
    /* Failure detection can lag the error that the dead peer caused, by
     * seconds on a loaded node: a short look names the failure where it is
     * known; otherwise the error counts as a suspected failure all the same.
     * Nothing is applied before every rank agrees (the step's end, then
     * recover()'s agreement and shrink, which find out whether a rank did
     * fail), so a suspicion that proves wrong costs one step done again; one
     * that keeps recurring with no rank lost ends in recover() as the error it
     * is (mpidp/fault_tolerance/recovery.py). */
    for (int k = 0; k < 10; k++) { /* 0.1 s */
        if (has_failed_rank(comm) || is_revoked(comm)) return MPIX_ERR_PROC_FAILED;
        struct timespec ten_ms = {0, 10000000};
        nanosleep(&ten_ms, NULL);
    }
    suspected_rc = mpi_rc;
    return MPIX_ERR_PROC_FAILED;
#else
    (void)failure_can_cause;
    (void)is_revoked;
    (void)has_failed_rank;
    return mpi_rc;
#endif
}

int mpidp_ft_comm_broken(MPI_Comm comm)
{
#if MPIDP_HAVE_ULFM
    return comm != MPI_COMM_NULL && mpidp_ft_running() && (is_revoked(comm) || has_failed_rank(comm));
#else
    (void)comm;
    return 0;
#endif
}

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static MPI_Comm *tracked;
static size_t n_tracked, cap_tracked;

void mpidp_ft_track(MPI_Comm c)
{
    pthread_mutex_lock(&lock);
    if (n_tracked == cap_tracked) {
        size_t cap = cap_tracked ? 2 * cap_tracked : 16;
        MPI_Comm *grown = realloc(tracked, cap * sizeof *grown);
        if (grown == NULL) {   /* untracked: it is merely not revoked early */
            pthread_mutex_unlock(&lock);
            return;
        }
        tracked = grown;
        cap_tracked = cap;
    }
    tracked[n_tracked++] = c;
    pthread_mutex_unlock(&lock);
}

void mpidp_ft_untrack(MPI_Comm c)
{
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < n_tracked; i++) {
        if (tracked[i] == c) {
            tracked[i] = tracked[--n_tracked];
            break;
        }
    }
    if (n_tracked == 0) {
        free(tracked);
        tracked = NULL;
        cap_tracked = 0;
    }
    pthread_mutex_unlock(&lock);
}

int mpidp_ft_revoke_all(void)
{
    int revoked = 0;
#if MPIDP_HAVE_ULFM
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < n_tracked; i++) {
        int flag = 0;
        if (MPIX_Comm_is_revoked(tracked[i], &flag) == MPI_SUCCESS && !flag &&
            MPIX_Comm_revoke(tracked[i]) == MPI_SUCCESS)
            revoked++;
    }
    pthread_mutex_unlock(&lock);
#endif
    return revoked;
}

int mpidp_ft_post_agree(MPI_Comm comm, int *flag, MPI_Request *req)
{
#if MPIDP_HAVE_ULFM
    if (!*flag) MPIX_Comm_revoke(comm);
    return MPIX_Comm_iagree(comm, flag, req);
#else
    (void)comm;
    (void)flag;
    (void)req;
    return MPI_ERR_UNSUPPORTED_OPERATION;
#endif
}

static void *exit_after(void *arg)
{
    double seconds = *(double *)arg;
    free(arg);
    struct timespec left = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&left, &left) != 0) {
    }
    _exit(0);
    return NULL;
}

int mpidp_ft_exit_watchdog(double seconds)
{
    double *arg = malloc(sizeof *arg);
    if (arg == NULL) return -1;
    *arg = seconds > 0 ? seconds : 0;
    pthread_t t;
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0) {
        free(arg);
        return -1;
    }
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, exit_after, arg);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        free(arg);
        return -1;
    }
    return 0;
}

int mpidp_ft_end_with_launcher(void)
{
#if defined(__linux__)
    pid_t launcher = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) return 1;
    /* The launcher may have ended before the request: then the parent is no
     * longer the one read above, and nothing will send the signal. */
    if (getppid() != launcher) {
        kill(getpid(), SIGKILL);
        return -1;
    }
    return 0;
#else
    return 1;
#endif
}

/* Seconds a rank other than 0 waits before its MPI_Abort in fault-tolerant
 * mode (see mpidp_abort_job in mpidp/ft.h). */
#define ABORT_BEHIND_RANK0_S 1
/* Seconds MPI_Abort is given to end this process before it ends itself. */
#define ABORT_GRACE_S 10

/* The job's communicator now (mpidp's world: the survivors and the
 * replacements merged with them); MPI_COMM_NULL: MPI_COMM_WORLD. Set by
 * the main thread, read by whichever thread aborts. */
static MPI_Comm job_comm = MPI_COMM_NULL;

void mpidp_ft_set_job_comm(MPI_Comm comm)
{
    __atomic_store_n(&job_comm, comm, __ATOMIC_RELEASE);
}

static void *exit_with(void *arg)
{
    int code = (int)(intptr_t)arg;
    struct timespec left = {ABORT_GRACE_S, 0};
    while (nanosleep(&left, &left) != 0) {
    }
    _exit(code);
    return NULL;
}

void mpidp_abort_job(int code)
{
    MPI_Comm comm = __atomic_load_n(&job_comm, __ATOMIC_ACQUIRE);
    if (comm == MPI_COMM_NULL) comm = MPI_COMM_WORLD;
    int rank = 0;
    if (mpidp_ft_running()) {
        /* Under ULFM, MPI_Abort can wait forever (for a launcher busy with
         * another rank's abort, or a peer that is gone) while this process's
         * other threads go on as if nothing ended: it ends itself instead. */
        pthread_t t;
        pthread_attr_t attr;
        if (pthread_attr_init(&attr) == 0) {
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            (void)pthread_create(&t, &attr, exit_with, (void *)(intptr_t)code);  /* or MPI_Abort alone */
            pthread_attr_destroy(&attr);
        }
        if (MPI_Comm_rank(comm, &rank) == MPI_SUCCESS && rank != 0) {
            struct timespec left = {ABORT_BEHIND_RANK0_S, 0};
            while (nanosleep(&left, &left) != 0) {
            }
        }
    }
    /* The job's communicator, not MPI_COMM_WORLD: a replacement's
     * MPI_COMM_WORLD is its own spawn, and the launched ranks' holds none of
     * the replacements, which Open MPI's ULFM launcher would leave running. */
    MPI_Abort(comm, code);
    _exit(code);     /* MPI_Abort does not return; should it, the job still ends here */
}
