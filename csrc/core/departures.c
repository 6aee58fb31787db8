/* Ranks whose program has ended (see mpidp/departures.h). */
#include "mpidp/departures.h"

#include <pthread.h>
#include <stdlib.h>

#include "mpi_util.h"
#include "mpidp/reqtable.h"
#include "mpidp/status.h"
#include "fail.h"
#include "departures_internal.h"

#define TAG 7301

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    int started, announced;
    MPI_Comm comm;          /* mpidp's duplicate of the world */
    MPI_Group group;        /* its group, for membership */
    int rank, size;
    MPI_Request recv;       /* the notice listened for */
    int notice;
    double *gone_at;        /* per world rank: when its notice arrived (0: not gone) */
    int n_gone;
    double grace_s;
} dep = {.grace_s = MPIDP_DEPARTURE_GRACE_SECONDS};

static int listen_locked(void)
{
    return MPI_Irecv(&dep.notice, 1, MPI_INT, MPI_ANY_SOURCE, TAG, dep.comm, &dep.recv);
}

int mpidp_departures_start(MPI_Comm world)
{
    pthread_mutex_lock(&lock);
    int rc = MPI_SUCCESS;
    if (!dep.started) {
        rc = MPI_Comm_dup(world, &dep.comm);
        if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(dep.comm, MPI_ERRORS_RETURN);
        if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(dep.comm, &dep.rank);
        if (rc == MPI_SUCCESS) rc = MPI_Comm_size(dep.comm, &dep.size);
        if (rc == MPI_SUCCESS) rc = MPI_Comm_group(dep.comm, &dep.group);
        if (rc == MPI_SUCCESS) {
            dep.gone_at = calloc((size_t)dep.size, sizeof *dep.gone_at);
            if (dep.gone_at == NULL) rc = MPI_ERR_NO_MEM;
        }
        if (rc == MPI_SUCCESS) rc = listen_locked();
        dep.started = rc == MPI_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return rc == MPI_SUCCESS ? MPIDP_OK : mpidp__mpi_fail(rc, "listening for ranks that end");
}

void mpidp_departures_set_grace(double seconds)
{
    pthread_mutex_lock(&lock);
    dep.grace_s = seconds > 0 ? seconds : 0;
    pthread_mutex_unlock(&lock);
}

double mpidp_departures_grace(void)
{
    pthread_mutex_lock(&lock);
    double g = dep.grace_s;
    pthread_mutex_unlock(&lock);
    return g;
}

/* Reads every notice that has arrived. Lock held. */
static void poll_locked(double now)
{
    for (;;) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Test(&dep.recv, &flag, &st) != MPI_SUCCESS || !flag) return;
        if (st.MPI_SOURCE >= 0 && st.MPI_SOURCE < dep.size && dep.gone_at[st.MPI_SOURCE] == 0) {
            dep.gone_at[st.MPI_SOURCE] = now;
            dep.n_gone++;
        }
        if (listen_locked() != MPI_SUCCESS) return;
    }
}

/* 1 when world rank r is a member of comm (MPI_COMM_NULL: of any). */
static int member(MPI_Comm comm, int r)
{
    if (comm == MPI_COMM_NULL) return 1;
    MPI_Group g;
    int out = MPI_UNDEFINED;
    if (MPI_Comm_group(comm, &g) != MPI_SUCCESS) return 1;
    MPI_Group_translate_ranks(dep.group, 1, &r, g, &out);
    MPI_Group_free(&g);
    return out != MPI_UNDEFINED;
}

int mpidp__departures_check(MPI_Comm comm, double wait_start, double now, const char *what)
{
    pthread_mutex_lock(&lock);
    int gone = -1;
    double waited = 0;
    if (dep.started && !dep.announced) {
        poll_locked(now);
        for (int r = 0; dep.n_gone > 0 && r < dep.size && gone < 0; r++) {
            if (dep.gone_at[r] == 0) continue;
            double since = dep.gone_at[r] > wait_start ? dep.gone_at[r] : wait_start;
            if (now - since > dep.grace_s && member(comm, r)) gone = r, waited = now - since;
        }
    }
    pthread_mutex_unlock(&lock);
    if (gone < 0) return MPIDP_OK;
    return mpidp__fail(MPIDP_EDEPARTED, "rank %d of the job has ended its program (it exited: "
                       "sys.exit or SystemExit on that rank, or its script ended sooner) while "
                       "this rank waits for it in %s; %.1f s later the operation has not "
                       "completed and never will", gone, what ? what : "an operation", waited);
}

int mpidp_departures_announce(void)
{
    pthread_mutex_lock(&lock);
    int rc = MPI_SUCCESS;
    if (dep.started && !dep.announced) {
        dep.announced = 1;
        /* Stop listening: the receive is cancelled, or completes with a notice. */
        MPI_Cancel(&dep.recv);
        MPI_Wait(&dep.recv, MPI_STATUS_IGNORE);
        static const int one = 1;
        MPI_Request *sends = calloc((size_t)dep.size, sizeof *sends);
        int n = 0;
        for (int r = 0; sends != NULL && r < dep.size && rc == MPI_SUCCESS; r++)
            if (r != dep.rank) rc = MPI_Isend(&one, 1, MPI_INT, r, TAG, dep.comm, &sends[n++]);
        /* Four bytes go eagerly; a rank that has already finalized never
         * receives, so the sends are given up on after a second. */
        double end = mpidp_now() + 1.0;
        int all = 0;
        while (rc == MPI_SUCCESS && !all && mpidp_now() < end)
            rc = MPI_Testall(n, sends, &all, MPI_STATUSES_IGNORE);
        for (int i = 0; !all && i < n; i++)
            if (sends[i] != MPI_REQUEST_NULL) MPI_Request_free(&sends[i]);
        free(sends);
    }
    pthread_mutex_unlock(&lock);
    return rc == MPI_SUCCESS ? MPIDP_OK
                             : mpidp__mpi_fail(rc, "telling the other ranks this one ends");
}
