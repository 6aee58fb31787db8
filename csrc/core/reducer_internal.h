/* The reducer's private state, shared by csrc/core/reducer.c (buckets:
 * readiness, posting, completion, delivery) and csrc/core/reducer_pass.c
 * (what each parameter's .grad must become over a pass). Not a public
 * header: callers use mpidp/reducer.h. */
#ifndef MPIDP_REDUCER_INTERNAL_H
#define MPIDP_REDUCER_INTERNAL_H

#include "mpidp/pack.h"
#include "mpidp/reducer.h"
#include "mpidp/status.h"

typedef struct {
    mpidp_bucket_info_t info;
    void *data;            /* numel data elements, then n_params flags */
    void *comm;            /* what MPI reduces when not the data itself: the data + flags
                            * packed to the wire dtype, or (separate mode) copied */
    size_t pending;        /* parameters not yet marked in this pass */
    int staged_in;         /* staged mode: the caller copied this pass's gradients in */
    int home;              /* staged mode: the result was copied back */
    mpidp_bucket_state_t state;
    mpidp_req_t req;       /* the allreduce (with a uint8 wire: of the flags only) */
    struct mpidp_qallreduce *q; /* uint8 wire: the data's quantized allreduce in flight */
    struct {                   /* hierarchical mode (reducer_hier.c) */
        int phase;             /* idle, scatter, cross, gather, done */
        int dtype;             /* what travels: the wire or the bucket's dtype */
        void *buf;             /* the bucket's data as it travels (bucket or comm buffer) */
        void *slice;           /* this local rank's slice of it */
        int *counts, *displs;  /* the slices of every local rank, in elements */
    } h;
} bucket_t;

struct mpidp_reducer {
    MPI_Comm comm;
    int size;
    int divisor;           /* gradients are averaged over this many ranks */
    double drain_timeout_s;
    mpidp_reqtable_t *reqs;
    size_t n_params;
    uint32_t *param_bucket;
    size_t *param_offset;
    size_t *param_numel;
    size_t *param_flag;    /* index of the parameter's flag after the bucket data */
    uint8_t *ready;
    size_t n_ready;
    size_t *bucket_first;  /* n_buckets + 1: bucket b's parameters are members[first[b] .. first[b+1]) */
    size_t *members;       /* n_params parameter indices, grouped by bucket, in index order */
    size_t n_buckets;
    bucket_t *buckets;
    size_t next_to_post;   /* buckets below this index are posted (or done) */
    int wire;              /* MPIDP_BF16/MPIDP_F16: float32 buckets travel compressed; -1 */
    int separate;          /* results stay in bk->comm until delivered */
    int staged;            /* buckets are posted only once the caller staged them */
    int device;            /* the caller reduces the gradients where they live; the core the flags */
    uint8_t *dev_deliver;  /* device mode: per parameter, the delivery the caller must make */
    char name[48];

    /* Hierarchical mode (reducer_hier.c). */
    int hier;
    MPI_Comm h_node, h_cross, h_gather; /* node reduce-scatter, cross-node, node allgather */
    int h_size, h_rank;                 /* the node's ranks and this rank's place in it */
    size_t h_next_cross, h_next_gather; /* the next bucket to start each phase for */
    int h_error;                        /* a failed phase: sticky, with its detail */
    char h_detail[200];

    /* The pass (reducer_pass.c): what the caller's .grad were and must become. */
    uint8_t *was_none;     /* .grad was None when prepare pointed it at its view */
    uint8_t *local_has;    /* this rank contributed a gradient (or it was fixed up since) */
    uint8_t *after;        /* separate mode: the after-step action decided at delivery */
    long long *version;    /* separate mode: each bucket's version counter at finalize */
    uint8_t *delivered;    /* separate mode: bucket delivered for the step */
    uint8_t *applied;      /* separate mode: bucket's after-step actions handed out */
    int finalized;         /* every parameter marked: every bucket posted or staged */
    int backward_open;     /* a communicating backward's first gradient arrived; until finalize */
    int paused;            /* no_sync: gradients arriving are held, not marked */
    int held;              /* a paused backward held gradients no pass has reduced yet */
    double last_hook_progress; /* mpidp_now() of the last progress a hook drove */
};

/* A float32 bucket that travels compressed (bf16/fp16 wire). */
static inline int bk_compressed(const mpidp_reducer_t *r, const bucket_t *bk)
{
    return (r->wire == MPIDP_BF16 || r->wire == MPIDP_F16) && bk->info.dtype == MPIDP_F32;
}

/* The bucket's collective has completed: bring compressed results home.
 * (Here, not in reducer.c, so that the hierarchical engine, which completes
 * its buckets' last phase, calls nothing of the reducer that drives it.) */
static inline int reducer_complete_bucket(mpidp_reducer_t *r, bucket_t *bk)
{
    if (bk_compressed(r, bk) && !r->separate) {
        const mpidp_pack_kernels_t *k = mpidp_pack_kernels();
        size_t count = bk->info.numel + bk->info.n_params;
        if (r->wire == MPIDP_BF16) k->unpack_bf16(bk->data, bk->comm, NULL, 0.0f, 1.0f, 0.0f, count);
        else k->unpack_fp16(bk->data, bk->comm, NULL, 0.0f, 1.0f, 0.0f, count);
    }
    bk->state = MPIDP_BUCKET_DONE;
    return MPIDP_OK;
}


/* Hierarchical mode: set-up (slices, engine registration), freeing, the
 * first phase of bucket b over `buf` travelling as `dtype`, progress (the
 * request table's engine callback too), waiting for bucket b, and forgetting
 * the pass. */
int mpidp__hier_init(mpidp_reducer_t *r, const mpidp_reducer_config_t *cfg);
void mpidp__hier_free(mpidp_reducer_t *r);
int mpidp__hier_post(mpidp_reducer_t *r, size_t b, void *buf, int dtype);
int mpidp__hier_progress(mpidp_reducer_t *r);
void mpidp__hier_engine(void *ctx);
int mpidp__hier_wait(mpidp_reducer_t *r, size_t b, double timeout_s);
void mpidp__hier_reset(mpidp_reducer_t *r);

#endif /* MPIDP_REDUCER_INTERNAL_H */
