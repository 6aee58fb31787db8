/* NCCL under a device communicator (mpidp/devcomm.h): the library and the
 * CUDA runtime that the process already loaded (torch's), opened by path and
 * used through the few C entry points below, so that mpidp builds without
 * either. The declarations are the documented C ABI of NCCL >= 2.14 and of
 * the CUDA runtime. */
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "devcomm_internal.h"
#include "fail.h"
#include "mpi_util.h"
#include "post.h"
#include "mpidp/mpiops.h"
#include "mpidp/status.h"
#include "mpidp/tensor.h"

enum { NCCL_SUCCESS = 0, NCCL_INVALID_ARGUMENT = 4, NCCL_INVALID_USAGE = 5, NCCL_IN_PROGRESS = 7 };
enum { NCCL_SUM = 0, NCCL_PROD = 1, NCCL_MAX = 2, NCCL_MIN = 3 };
enum { CUDA_SUCCESS = 0, CUDA_NOT_READY = 600, CUDA_EVENT_DISABLE_TIMING = 0x02 };
#define NCCL_ID_BYTES 128
#define NCCL_CONFIG_MAGIC 0xcafebeefu
#define NCCL_UNDEF_INT INT_MIN

typedef struct { char internal[NCCL_ID_BYTES]; } nccl_id_t;

/* ncclConfig_t as NCCL 2.14 defined it; later versions read an older
 * config by its size and version fields. */
typedef struct {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cga_cluster_size;
    int min_ctas;
    int max_ctas;
    const char *net_name;
} nccl_config_t;
#define NCCL_CONFIG_VERSION 21403

struct mpidp_nccl_api {
    void *lib, *cudart;
    int (*get_version)(int *);
    int (*get_unique_id)(nccl_id_t *);
    int (*comm_init_rank_config)(void **, int, nccl_id_t, int, nccl_config_t *);
    int (*comm_init_rank)(void **, int, nccl_id_t, int);
    int (*all_reduce)(const void *, void *, size_t, int, int, void *, void *);
    int (*broadcast)(const void *, void *, size_t, int, int, void *, void *);
    int (*all_gather)(const void *, void *, size_t, int, void *, void *);
    int (*reduce_scatter)(const void *, void *, size_t, int, int, void *, void *);
    int (*comm_get_async_error)(void *, int *);
    int (*comm_abort)(void *);
    int (*comm_destroy)(void *);
    const char *(*get_error_string)(int);
    int (*set_device)(int);
    int (*event_create)(void **, unsigned);
    int (*event_record)(void *, void *);
    int (*event_query)(void *);
    int (*event_destroy)(void *);
    const char *(*cuda_error_string)(int);
};

static int load(void **fn, void *lib, const char *name, const char *path)
{
    dlerror();
    *fn = dlsym(lib, name);
    if (*fn == NULL)
        return mpidp__fail(MPIDP_ENOTSUP, "device communicator: %s has no %s", path, name);
    return MPIDP_OK;
}

static int open_libraries(struct mpidp_nccl_api *a, const char *nccl_path, const char *cudart_path)
{
    a->lib = dlopen(nccl_path, RTLD_NOW | RTLD_LOCAL);
    if (a->lib == NULL)
        return mpidp__fail(MPIDP_ENOTSUP, "device communicator: cannot load NCCL (%s)", dlerror());
    a->cudart = dlopen(cudart_path, RTLD_NOW | RTLD_LOCAL);
    if (a->cudart == NULL)
        return mpidp__fail(MPIDP_ENOTSUP, "device communicator: cannot load the CUDA runtime (%s)",
                           dlerror());
    struct { void **fn; void *lib; const char *name, *path; } want[] = {
        {(void **)&a->get_version, a->lib, "ncclGetVersion", nccl_path},
        {(void **)&a->get_unique_id, a->lib, "ncclGetUniqueId", nccl_path},
        {(void **)&a->comm_init_rank_config, a->lib, "ncclCommInitRankConfig", nccl_path},
        {(void **)&a->comm_init_rank, a->lib, "ncclCommInitRank", nccl_path},
        {(void **)&a->all_reduce, a->lib, "ncclAllReduce", nccl_path},
        {(void **)&a->broadcast, a->lib, "ncclBroadcast", nccl_path},
        {(void **)&a->all_gather, a->lib, "ncclAllGather", nccl_path},
        {(void **)&a->reduce_scatter, a->lib, "ncclReduceScatter", nccl_path},
        {(void **)&a->comm_get_async_error, a->lib, "ncclCommGetAsyncError", nccl_path},
        {(void **)&a->comm_abort, a->lib, "ncclCommAbort", nccl_path},
        {(void **)&a->comm_destroy, a->lib, "ncclCommDestroy", nccl_path},
        {(void **)&a->get_error_string, a->lib, "ncclGetErrorString", nccl_path},
        {(void **)&a->set_device, a->cudart, "cudaSetDevice", cudart_path},
        {(void **)&a->event_create, a->cudart, "cudaEventCreateWithFlags", cudart_path},
        {(void **)&a->event_record, a->cudart, "cudaEventRecord", cudart_path},
        {(void **)&a->event_query, a->cudart, "cudaEventQuery", cudart_path},
        {(void **)&a->event_destroy, a->cudart, "cudaEventDestroy", cudart_path},
        {(void **)&a->cuda_error_string, a->cudart, "cudaGetErrorString", cudart_path},
    };
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
        int rc = load(want[k].fn, want[k].lib, want[k].name, want[k].path);
        if (rc != MPIDP_OK) return rc;
    }
    return MPIDP_OK;
}

static int nccl_type(int dtype)
{
    switch (dtype) {
    case MPIDP_I8: return 0;
    case MPIDP_U8: return 1;
    case MPIDP_I32: return 2;
    case MPIDP_I64: return 4;
    case MPIDP_F16: return 6;
    case MPIDP_F32: return 7;
    case MPIDP_F64: return 8;
    case MPIDP_BF16: return 9;
    }
    return -1;
}

static int nccl_fail(mpidp_devcomm_t *dc, int nrc, const char *what)
{
    return mpidp__fail(MPIDP_ECUDA, "%s: NCCL: %s", what, dc->api->get_error_string(nrc));
}

static void pause_100us(void)
{
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
}

/* Polls a non-blocking communicator until NCCL's work on the host is done
 * (its state leaves ncclInProgress), at most until `deadline`. */
static int settle(mpidp_devcomm_t *dc, double deadline, const char *what)
{
    for (;;) {
        int state = NCCL_SUCCESS;
        int nrc = dc->api->comm_get_async_error(dc->nccl_comm, &state);
        if (nrc != NCCL_SUCCESS) return nccl_fail(dc, nrc, what);
        if (state == NCCL_SUCCESS) return MPIDP_OK;
        if (state != NCCL_IN_PROGRESS) return nccl_fail(dc, state, what);
        if (mpidp_now() > deadline)
            return mpidp__fail(MPIDP_ETIMEDOUT, "%s: NCCL did not finish within the deadline", what);
        pause_100us();
    }
}

/* Rank 0's unique id (or its failure) to every rank, under the deadline. */
static int share_id(mpidp_devcomm_t *dc, nccl_id_t *id, double timeout_s)
{
    unsigned char msg[1 + NCCL_ID_BYTES] = {0};
    if (dc->rank == 0) {
        msg[0] = dc->api->get_unique_id(id) == NCCL_SUCCESS;
        memcpy(msg + 1, id, NCCL_ID_BYTES);
    }
    const char *what = "device communicator: MPI_Ibcast of NCCL's unique id";
    mpidp_req_t slot, h;
    int rc = mpidp_reqtable_claim(dc->reqs, what, &slot);
    if (rc != MPIDP_OK) return rc;
    MPI_Request req;
    int mrc = MPI_Ibcast(msg, (int)sizeof msg, MPI_BYTE, 0, dc->comm, &req);
    if ((rc = mpidp__post_done(dc->reqs, slot, mrc, req, dc->comm, what, &h)) != MPIDP_OK) return rc;
    if ((rc = mpidp_reqtable_wait(dc->reqs, h, timeout_s)) != MPIDP_OK) return rc;
    if (!msg[0]) return mpidp__fail(MPIDP_ECUDA, "device communicator: ncclGetUniqueId failed on rank 0");
    memcpy(id, msg + 1, NCCL_ID_BYTES);
    return MPIDP_OK;
}

/* Every rank's outcome of the set-up: the communicator is usable only where
 * it is on every rank. */
static int agree(mpidp_devcomm_t *dc, int ok, double timeout_s)
{
    int all = ok;
    const char *what = "device communicator: MPI_Iallreduce of the NCCL set-up's outcome";
    mpidp_req_t h;
    int rc = mpidp__post_iallreduce(dc->comm, dc->reqs, &all, 1, MPIDP_OP_MIN, MPIDP_I32, what, &h);
    if (rc == MPIDP_OK) rc = mpidp_reqtable_wait(dc->reqs, h, timeout_s);
    if (rc != MPIDP_OK) return rc;
    return all ? MPIDP_OK
               : mpidp__fail(MPIDP_ECUDA, "device communicator: NCCL's set-up failed on another "
                             "rank (its error names the cause)");
}

int mpidp__nccl_open(mpidp_devcomm_t *dc, const char *nccl_path, const char *cudart_path,
                     int device, double timeout_s)
{
    struct mpidp_nccl_api *a = dc->api = calloc(1, sizeof *a);
    if (a == NULL) return mpidp__fail(MPIDP_ENOMEM, "device communicator");
    /* A rank that cannot load NCCL still takes part in the agreement below,
     * so that no rank waits in NCCL's set-up for it. */
    int local = open_libraries(a, nccl_path, cudart_path);
    if (local == MPIDP_OK && (a->get_version(&dc->nccl_version) != NCCL_SUCCESS ||
                              dc->nccl_version < 21403))
        local = mpidp__fail(MPIDP_ENOTSUP, "device communicator: NCCL %d is older than 2.14.3",
                            dc->nccl_version);
    if (local == MPIDP_OK && a->set_device(device) != CUDA_SUCCESS)
        local = mpidp__fail(MPIDP_ECUDA, "device communicator: cudaSetDevice(%d) failed", device);
    char local_detail[256] = "";
    if (local != MPIDP_OK) snprintf(local_detail, sizeof local_detail, "%s", mpidp_error_detail());
    int rc = agree(dc, local == MPIDP_OK, timeout_s);
    if (local != MPIDP_OK) return mpidp__fail(local, "%s", local_detail); /* this rank's own cause */
    nccl_id_t id;
    if (rc == MPIDP_OK) rc = share_id(dc, &id, timeout_s);
    if (rc != MPIDP_OK) return rc;
    double deadline = mpidp_now() + (timeout_s > 0 ? timeout_s : 1e30);
    /* Non-blocking, so that a rank that never comes is a timeout here
     * instead of a hang inside NCCL. */
    nccl_config_t cfg = {.size = sizeof cfg, .magic = NCCL_CONFIG_MAGIC,
                         .version = NCCL_CONFIG_VERSION, .blocking = 0,
                         .cga_cluster_size = NCCL_UNDEF_INT, .min_ctas = NCCL_UNDEF_INT,
                         .max_ctas = NCCL_UNDEF_INT, .net_name = NULL};
    int nrc = a->comm_init_rank_config(&dc->nccl_comm, dc->size, id, dc->rank, &cfg);
    if (nrc == NCCL_INVALID_ARGUMENT || nrc == NCCL_INVALID_USAGE) {
        /* A library that does not take this config: the blocking set-up
         * (every rank got here, so all are on their way into it). */
        dc->nccl_comm = NULL;
        nrc = a->comm_init_rank(&dc->nccl_comm, dc->size, id, dc->rank);
        dc->blocking_comm = 1;
    }
    if (nrc != NCCL_SUCCESS && nrc != NCCL_IN_PROGRESS) rc = nccl_fail(dc, nrc, "ncclCommInitRank");
    else rc = settle(dc, deadline, "ncclCommInitRankConfig");
    char detail[256] = "";
    if (rc != MPIDP_OK) snprintf(detail, sizeof detail, "%s", mpidp_error_detail());
    int arc = agree(dc, rc == MPIDP_OK, timeout_s);
    if (rc != MPIDP_OK) return mpidp__fail(rc, "%s", detail);
    return arc;
}

static int cuda_fail(mpidp_devcomm_t *dc, int crc, const char *what)
{
    return mpidp__fail(MPIDP_ECUDA, "%s: CUDA: %s", what, dc->api->cuda_error_string(crc));
}

static int nccl_op(int op)
{
    switch (op) {
    case MPIDP_OP_SUM: return NCCL_SUM;
    case MPIDP_OP_PROD: return NCCL_PROD;
    case MPIDP_OP_MAX: return NCCL_MAX;
    case MPIDP_OP_MIN: return NCCL_MIN;
    }
    return -1;
}

/* Enqueues `op` (checked by devcomm.c) on `stream`. */
static int enqueue(mpidp_devcomm_t *dc, const mpidp_devop_t *op, int type, void *stream)
{
    struct mpidp_nccl_api *a = dc->api;
    const void *send = op->send != NULL ? op->send : op->recv;
    switch (op->kind) {
    case MPIDP_DEVOP_ALLREDUCE:
        return a->all_reduce(send, op->recv, op->count, type, nccl_op(op->op), dc->nccl_comm,
                             stream);
    case MPIDP_DEVOP_BCAST:
        return a->broadcast(op->recv, op->recv, op->count, type, op->root, dc->nccl_comm, stream);
    case MPIDP_DEVOP_ALLGATHER:
        return a->all_gather(send, op->recv, op->count, type, dc->nccl_comm, stream);
    case MPIDP_DEVOP_REDUCE_SCATTER:
        return a->reduce_scatter(send, op->recv, op->count, type, nccl_op(op->op), dc->nccl_comm,
                                 stream);
    }
    return NCCL_INVALID_ARGUMENT;
}

int mpidp__nccl_collective(mpidp_devcomm_t *dc, const mpidp_devop_t *op, void *stream,
                           const char *what, void **event)
{
    struct mpidp_nccl_api *a = dc->api;
    int type = nccl_type(op->dtype);
    if (type < 0)
        return mpidp__fail(MPIDP_EDTYPE, "%s: NCCL takes no %s", what, mpidp_dtype_name(op->dtype));
    void *ev = NULL;
    if (dc->n_free_events > 0) {
        ev = dc->free_events[--dc->n_free_events];
    } else {
        int crc = a->event_create(&ev, CUDA_EVENT_DISABLE_TIMING);
        if (crc != CUDA_SUCCESS) return cuda_fail(dc, crc, what);
    }
    int nrc = enqueue(dc, op, type, stream);
    int rc = MPIDP_OK;
    if (nrc == NCCL_IN_PROGRESS) rc = settle(dc, mpidp_now() + 600.0, what);
    else if (nrc != NCCL_SUCCESS) rc = nccl_fail(dc, nrc, what);
    if (rc == MPIDP_OK) {
        int crc = a->event_record(ev, stream);
        if (crc != CUDA_SUCCESS) rc = cuda_fail(dc, crc, what);
    }
    if (rc != MPIDP_OK) {
        mpidp__nccl_event_release(dc, ev);
        return rc;
    }
    *event = ev;
    return MPIDP_OK;
}

int mpidp__nccl_event_passed(mpidp_devcomm_t *dc, void *event)
{
    int crc = dc->api->event_query(event);
    if (crc == CUDA_SUCCESS) return 1;
    if (crc == CUDA_NOT_READY) return 0;
    mpidp__fail(MPIDP_ECUDA, "a device collective failed: CUDA: %s", dc->api->cuda_error_string(crc));
    return -1;
}

void mpidp__nccl_event_release(mpidp_devcomm_t *dc, void *event)
{
    if (event == NULL) return;
    if (dc->n_free_events == dc->cap_free_events) {
        size_t cap = dc->cap_free_events ? 2 * dc->cap_free_events : 16;
        void **ev = realloc(dc->free_events, cap * sizeof *ev);
        if (ev == NULL) {
            dc->api->event_destroy(event);
            return;
        }
        dc->free_events = ev;
        dc->cap_free_events = cap;
    }
    dc->free_events[dc->n_free_events++] = event;
}

int mpidp__nccl_async_error(mpidp_devcomm_t *dc)
{
    int state = NCCL_SUCCESS;
    int nrc = dc->api->comm_get_async_error(dc->nccl_comm, &state);
    if (nrc == NCCL_SUCCESS && (state == NCCL_SUCCESS || state == NCCL_IN_PROGRESS)) return 0;
    mpidp__fail(MPIDP_ECUDA, "NCCL reported an error: %s",
                dc->api->get_error_string(nrc != NCCL_SUCCESS ? nrc : state));
    return 1;
}

void mpidp__nccl_abort(mpidp_devcomm_t *dc)
{
    if (dc->nccl_comm != NULL) dc->api->comm_abort(dc->nccl_comm);
    dc->nccl_comm = NULL;
}

void mpidp__nccl_close(mpidp_devcomm_t *dc)
{
    struct mpidp_nccl_api *a = dc->api;
    if (a == NULL) return;
    if (dc->nccl_comm != NULL) a->comm_destroy(dc->nccl_comm);
    dc->nccl_comm = NULL;
    for (size_t k = 0; k < dc->n_free_events; k++) a->event_destroy(dc->free_events[k]);
    free(dc->free_events);
    /* The libraries stay loaded: torch holds them, and so may NCCL's threads. */
    free(a);
    dc->api = NULL;
}
