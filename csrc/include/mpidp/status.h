/* Status codes of the mpidp C core.
 *
 * Every core function returns an int: MPIDP_OK (0) or one of the negative codes
 * below. Results travel through out-parameters. The codes come from one X-macro
 * table so the enum, the names and the messages can never drift apart.
 *
 * A failing function may leave a human-readable detail (which MPI call, the MPI
 * error string, which argument) in a thread-local buffer, read back with
 * mpidp_error_detail(); the Python glue appends it to the exception message. */
#ifndef MPIDP_STATUS_H
#define MPIDP_STATUS_H

#include <stddef.h>

#define MPIDP_STATUS_TABLE(X)                                                   \
    X(MPIDP_OK,        0,   "success")                                          \
    X(MPIDP_EINVAL,   -1,   "invalid argument")                                 \
    X(MPIDP_ENOMEM,   -2,   "out of memory")                                    \
    X(MPIDP_EMPI,     -3,   "MPI call failed")                                  \
    X(MPIDP_ETIMEDOUT,-4,   "timed out waiting for communication")              \
    X(MPIDP_ENOTSUP,  -5,   "not supported")                                    \
    X(MPIDP_ESTATE,   -6,   "operation not valid in the current state")         \
    X(MPIDP_EDTYPE,   -7,   "unsupported dtype")                                \
    X(MPIDP_EDEVICE,  -8,   "unsupported device")                               \
    X(MPIDP_EFULL,    -9,   "too many requests in flight")                      \
    X(MPIDP_ECUDA,    -10,  "CUDA call failed")                                 \
    X(MPIDP_EMISMATCH,-11,  "ranks disagree")                                   \
    X(MPIDP_ECALLBACK,-12,  "a caller-supplied callback failed")                \
    X(MPIDP_EDEPARTED,-13,  "a rank the operation waits for has ended its program")   \
    X(MPIDP_EPEERFAILED,-14, "a rank failed (MPI fault tolerance: process failed or communicator revoked)")

enum mpidp_status {
#define MPIDP__ENUM(name, value, msg) name = (value),
    MPIDP_STATUS_TABLE(MPIDP__ENUM)
#undef MPIDP__ENUM
};

/* The fixed message of a status code ("unknown status" for anything else). */
const char *mpidp_strerror(int status);

/* A wait that ended with this status left its operation posted (a deadline
 * passed, or a rank it needs has ended): MPI may still write its buffers, so
 * they must stay allocated. */
static inline int mpidp_left_in_flight(int status)
{
    return status == MPIDP_ETIMEDOUT || status == MPIDP_EDEPARTED;
}
/* The symbolic name of a status code ("MPIDP_EINVAL"), for logs and tests. */
const char *mpidp_status_name(int status);

/* Thread-local detail of the last failure on this thread, "" when none. */
const char *mpidp_error_detail(void);
/* Forget any recorded detail (called at the start of each glue entry point). */
void mpidp_error_clear(void);
/* Record `detail` as this thread's failure detail, for a failure that the
 * glue found itself (a wait of its own past its deadline). */
void mpidp_error_set(const char *detail);

#endif /* MPIDP_STATUS_H */
