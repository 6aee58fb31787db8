/* MPI posting and failure reporting (see mpi_util.h). */
#include "mpi_util.h"

/* Open MPI's extensions (MPIX_Query_cuda_support) where the headers have them. */
#if defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#endif

#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "mpidp/ft.h"
#include "mpidp/status.h"
#include "fail.h"

/* The message of an MPI error code ("MPI_ERR_TRUNCATE: ..."). */
static const char *mpi_errstr(int code, char *buf, size_t len)
{
    char msg[MPI_MAX_ERROR_STRING];
    int n = 0;
    if (MPI_Error_string(code, msg, &n) != MPI_SUCCESS) snprintf(msg, sizeof msg, "MPI error %d", code);
    snprintf(buf, len, "%s", msg);
    return buf;
}

int mpidp__mpi_fail(int mpi_rc, const char *fmt, ...)
{
    char context[256], msg[MPI_MAX_ERROR_STRING];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(context, sizeof context, fmt, ap);
    va_end(ap);
    int status = mpidp_ft_is_peer_failure(mpi_rc) ? MPIDP_EPEERFAILED : MPIDP_EMPI;
    int suspected = status == MPIDP_EPEERFAILED ? mpidp_ft_take_suspected() : MPI_SUCCESS;
    if (suspected != MPI_SUCCESS)
        return mpidp__fail(status, "%s: %s (no failed rank is known yet; taken for a peer's "
                                   "failure, which the ranks' agreement settles)",
                           context, mpi_errstr(suspected, msg, sizeof msg));
    return mpidp__fail(status, "%s: %s", context, mpi_errstr(mpi_rc, msg, sizeof msg));
}

static int op_keyval = MPI_KEYVAL_INVALID;
static int op_keyval_rc = MPI_SUCCESS;
static pthread_once_t op_keyval_once = PTHREAD_ONCE_INIT;

static void create_op_keyval(void)
{
    op_keyval_rc = MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, MPI_COMM_NULL_DELETE_FN,
                                          &op_keyval, NULL);
}

int mpidp__next_op_number(MPI_Comm comm, const char *what, unsigned *out)
{
    pthread_once(&op_keyval_once, create_op_keyval);
    int rc = op_keyval_rc;
    void *value = NULL;
    int found = 0;
    if (rc == MPI_SUCCESS) rc = MPI_Comm_get_attr(comm, op_keyval, &value, &found);
    /* The counter travels in the attribute's pointer value itself. */
    uintptr_t n = found ? (uintptr_t)value : 0;
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_attr(comm, op_keyval, (void *)(n + 1));
    if (rc != MPI_SUCCESS) return mpidp__mpi_fail(rc, "%s: numbering the operation", what);
    *out = (unsigned)n;
    return MPIDP_OK;
}

int mpidp_mpi_cuda_aware(void)
{
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
    return MPIX_Query_cuda_support() == 1;
#else
    return 0;
#endif
}

int mpidp_mpi_finalized(void)
{
    int finalized = 1;
    MPI_Finalized(&finalized);
    return finalized;
}

/* Opens MPI's tool interface once, at the level MPI runs at, and keeps it
 * open: Open MPI's MPI_T_init_thread registers every component's variables
 * again after an MPI_T_finalize (a fifth of a second per session, paid by
 * every rank at import), and MPI_Finalize needs no MPI_T_finalize first.
 * Open MPI's MPI_T_init_thread overwrites the level MPI_Query_thread
 * reports (and that its own locking follows) with the one asked for, so it
 * is asked for the level MPI already has. Called from the importing thread. */
static int tool_interface_open(void)
{
    static int opened = 0;
    int level = MPI_THREAD_SINGLE, provided;
    if (!opened && MPI_Query_thread(&level) == MPI_SUCCESS &&
        MPI_T_init_thread(level, &provided) == MPI_SUCCESS)
        opened = 1;
    return opened;
}

/* Reads into value[] (zeroed first; *size: its bytes) and then, with
 * `write`, sets the MPI tool interface's control variable `name`: a scalar
 * of at most 16 bytes bound to no object. 1 on success, 0 where MPI has no
 * such variable or refuses. */
static int cvar_access(const char *name, unsigned char value[16], int *size, const void *write)
{
    int idx, count, ok = 0;
    memset(value, 0, 16);
    *size = 0;
    if (!tool_interface_open()) return 0;
    char found[64], desc[8];
    int found_len = sizeof found, desc_len = sizeof desc, verbosity, bind, scope;
    MPI_Datatype type;
    MPI_T_enum enumtype;
    MPI_T_cvar_handle h;
    if (MPI_T_cvar_get_index(name, &idx) == MPI_SUCCESS &&
        MPI_T_cvar_get_info(idx, found, &found_len, &verbosity, &type, &enumtype, desc, &desc_len,
                            &bind, &scope) == MPI_SUCCESS &&
        MPI_Type_size(type, size) == MPI_SUCCESS && *size > 0 && *size <= 16 &&
        bind == MPI_T_BIND_NO_OBJECT &&
        MPI_T_cvar_handle_alloc(idx, NULL, &h, &count) == MPI_SUCCESS) {
        ok = count == 1 && MPI_T_cvar_read(h, value) == MPI_SUCCESS &&
             (write == NULL || MPI_T_cvar_write(h, write) == MPI_SUCCESS);
        MPI_T_cvar_handle_free(&h);
    }
    return ok;
}

int mpidp__mpi_yields_when_idle(void)
{
    unsigned char value[16];
    int size, yields = 0;
    /* Open MPI declares it a C bool: any nonzero byte is true. */
    if (cvar_access("mpi_yield_when_idle", value, &size, NULL))
        for (int i = 0; i < size; i++) yields |= value[i] != 0;
    return yields;
}

int mpidp_mpi_iallreduce_algorithm(int prefer)
{
    unsigned char value[16];
    int size, now;
    if (!cvar_access("coll_libnbc_iallreduce_algorithm", value, &size, NULL) ||
        size != (int)sizeof now)
        return -1;
    memcpy(&now, value, sizeof now);
    if (now != 0 || prefer <= 0) return now;
    return cvar_access("coll_libnbc_iallreduce_algorithm", value, &size, &prefer) ? prefer : now;
}
