/* The glue's gradient reducer, shared by csrc/py/reducer.c (the Reducer and
 * GradHook types) and csrc/py/reducer_pass.c (a backward pass: reading and
 * writing `.grad` as the core reducer decides, staging buckets between device
 * and host). */
#ifndef MPIDP_PY_REDUCER_H
#define MPIDP_PY_REDUCER_H

#include "module.h"

#include <stdint.h>

#include "mpidp/reducer.h"

typedef struct {
    PyObject_HEAD
    mpidp_reducer_t *core;     /* owns the buckets' state and the pass's decisions */
    mpidp_py_state *st;
    PyObject *module;
    PyObject *comm;
    PyObject *params;          /* tuple of parameters */
    PyObject *views;           /* tuple of gradient views into the buckets */
    PyObject *bucket_tensors;  /* tuple of flat bucket tensors (host memory) */
    PyObject *device_buckets;  /* staging: the buckets the .grad views live in, or NULL */
    PyObject *host_grads;      /* staging: per bucket, the gradient part of the host bucket */
    PyObject *dev_grads;       /* ... and of the device bucket (narrowed once, at construction) */
    PyObject *event_type;      /* staging on a GPU: torch.cuda.Event (copies run
                                * asynchronously, tracked by events); NULL: synchronous */
    PyObject **stage_event;    /* per bucket: the recorded event of its copy to the host */
    uint8_t *copy_issued;      /* per bucket: copied (or copying) to the host in this pass */
    PyObject *queue_callback;  /* autograd's Variable._execution_engine.queue_callback */
    mpidp_py_borrowed_t *buckets;
    size_t n_buckets;
    size_t n_params;
    uint8_t *seen, *act;       /* scratch: mpidp_grad_seen_t / mpidp_grad_action_t per parameter */
    long long *versions;       /* scratch: per bucket */
    int blocking;
    int queued;                /* _finalize_backward queued for the current backward */
} mpidp_py_reducer_t;

/* Each returns 0, or -1 with a Python exception set. */
int mpidp_py_reducer_core_status(mpidp_py_reducer_t *r, int rc, const char *what);
/* A core call with a fresh error detail: CORE(r, "what", mpidp_reducer_x(...)) < 0 on failure. */
#define CORE(r, what, call) (mpidp_error_clear(), mpidp_py_reducer_core_status((r), (call), (what)))

/* One gradient hook (hot path): parameter i's gradient was accumulated. */
int mpidp_py_reducer_on_grad(mpidp_py_reducer_t *r, size_t i, PyObject *param);
/* Before backward: None grads pointed at their zeroed views. */
int mpidp_py_reducer_prepare(mpidp_py_reducer_t *r);
/* End of backward: mark what no hook marked, post everything, finalize. */
int mpidp_py_reducer_finalize(mpidp_py_reducer_t *r);
/* Completes the open pass (no step due), if any. */
int mpidp_py_reducer_complete(mpidp_py_reducer_t *r);
/* Non-blocking mode, a step is due: deliver bucket b; after the step, give
 * its `.grad`s back as the user left them. */
int mpidp_py_reducer_deliver(mpidp_py_reducer_t *r, size_t b);
int mpidp_py_reducer_after_step(mpidp_py_reducer_t *r, size_t b);
/* Non-blocking mode, between backward and the step: the mean into `.grad`
 * now, and the pass ends (the step that follows is an ordinary one). */
int mpidp_py_reducer_deliver_now(mpidp_py_reducer_t *r);
/* Non-blocking mode: 1 when gradients were changed in place since the end of
 * backward, 0 if not, -1 on error. */
int mpidp_py_reducer_edited(mpidp_py_reducer_t *r);
/* join: one pass of bucket allreduces contributing zeros. */
int mpidp_py_reducer_shadow_pass(mpidp_py_reducer_t *r);
/* Staging (csrc/py/reducer_staging.c): copies the gradient part of bucket b
 * between device and host (TO_HOST_ASYNC: from a backward hook, may run
 * ahead on a GPU); stage_full copies every full bucket and tells the core
 * which have arrived (flush: waits for every copy). */
enum { MPIDP_PY_TO_HOST, MPIDP_PY_TO_HOST_ASYNC, MPIDP_PY_TO_DEVICE };
int mpidp_py_reducer_stage(mpidp_py_reducer_t *r, size_t b, int how);
int mpidp_py_reducer_stage_full(mpidp_py_reducer_t *r, int flush);
int mpidp_py_reducer_staging_init(void);
/* obj.name(), result dropped: 0, or -1 with the exception set. */
int mpidp_py_call_method0(PyObject *obj, PyObject *name);

/* A GradHook for parameter i (csrc/py/gradhook.c), and its type's set-up. */
PyObject *mpidp_py_gradhook_new(mpidp_py_reducer_t *r, size_t i);
int mpidp_py_gradhook_init(PyObject *module, mpidp_py_state *st);
/* Interned names used by the pass (set up by the type's init). */
int mpidp_py_reducer_pass_init(void);

#endif /* MPIDP_PY_REDUCER_H */
