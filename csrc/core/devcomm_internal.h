/* Core-private: the device communicator's state, shared by devcomm.c (the
 * communicator, the stand-in, the request table's engine) and
 * devcomm_nccl.c (NCCL and the CUDA runtime, loaded at run time). */
#ifndef MPIDP_CORE_DEVCOMM_INTERNAL_H
#define MPIDP_CORE_DEVCOMM_INTERNAL_H

#include <pthread.h>

#include "mpidp/devcomm.h"

typedef struct {
    MPI_Request greq;  /* the generalized request the table tracks */
    void *event;       /* cudaEvent_t recorded after the NCCL call */
    double started;    /* mpidp_now() at the start: the watchdog's deadline counts from it */
} mpidp__devop_t;

/* A stand-in collective: MPI runs it on a private copy, which lands in the
 * caller's output only when it is waited for -- as a device result is
 * visible only to work ordered after it -- so a caller that forgets to wait
 * reads its own unreduced bucket. */
typedef struct {
    mpidp_req_t h;
    void *buf, *shadow;
    size_t bytes;
} mpidp__standin_op_t;

struct mpidp_nccl_api; /* devcomm_nccl.c */

struct mpidp_devcomm {
    mpidp_devcomm_kind_t kind;
    MPI_Comm comm;
    int rank, size;
    mpidp_reqtable_t *reqs;
    int engine_added;
    /* NCCL: `mu` guards the operations, the failure and the NCCL
     * communicator against the watchdog thread, which aborts NCCL when an
     * operation outlives timeout_s or NCCL reports an error -- also while
     * the host is blocked in a CUDA synchronisation, where no wait of mpidp
     * runs. It calls no MPI; the table's engine completes the requests. */
    pthread_mutex_t mu;
    pthread_t watchdog;
    int watchdog_running, stop;
    double timeout_s;
    int aborted;
    int fail_status;        /* MPIDP_OK, or why the communicator was aborted */
    char fail_detail[256];
    mpidp__devop_t *ops;    /* NCCL operations in flight, in no order */
    size_t n_ops, cap_ops;
    void **free_events;     /* events to reuse */
    size_t n_free_events, cap_free_events;
    mpidp__standin_op_t *sops; /* stand-in sums not yet waited for */
    size_t n_sops, cap_sops;
    int nccl_version;
    void *nccl_comm;        /* ncclComm_t */
    int blocking_comm;      /* NCCL refused the non-blocking config: made blocking */
    struct mpidp_nccl_api *api;
};


/* devcomm_nccl.c, below devcomm.c (it calls nothing there). open: loads
 * the libraries, agrees with every rank that all could, shares rank 0's
 * unique id and makes the NCCL communicator under the deadline (collective;
 * on failure the caller aborts and destroys dc). The collective enqueues
 * NCCL's call on `stream` and records an event after it (*event);
 * event_passed: 1 passed, 0 not yet, -1 a CUDA error; async_error: 1 when
 * NCCL reported an error for the communicator (both record the detail). */
int mpidp__nccl_open(mpidp_devcomm_t *dc, const char *nccl_path, const char *cudart_path,
                     int device, double timeout_s);
int mpidp__nccl_collective(mpidp_devcomm_t *dc, const mpidp_devop_t *op, void *stream,
                           const char *what, void **event);
int mpidp__nccl_event_passed(mpidp_devcomm_t *dc, void *event);
void mpidp__nccl_event_release(mpidp_devcomm_t *dc, void *event);
int mpidp__nccl_async_error(mpidp_devcomm_t *dc);
void mpidp__nccl_abort(mpidp_devcomm_t *dc);
void mpidp__nccl_close(mpidp_devcomm_t *dc);

#endif /* MPIDP_CORE_DEVCOMM_INTERNAL_H */
