/* The glue's gradient reducer, shared by csrc/py/reducer.c (the type: its
 * layout, construction and the core's small queries) and csrc/py/reducer_pass.c
 * (the methods that read and write `.grad` as the core decides). The order
 * of a pass's calls, staging and the non-blocking flows are Python
 * (python/mpidp/_reducer.py, a subclass of this type). */
#ifndef MPIDP_PY_REDUCER_H
#define MPIDP_PY_REDUCER_H

#include "module.h"

#include <stdint.h>

#include "mpidp/bucket.h"
#include "mpidp/reducer.h"

typedef struct {
    PyObject_HEAD
    mpidp_reducer_t *core;     /* owns the buckets' state and the pass's decisions */
    mpidp_py_state *st;
    PyObject *comm;
    PyObject *hier_comms;      /* None, or the hierarchical mode's 3 Comms (kept alive) */
    PyObject *params;          /* tuple of parameters */
    PyObject *views;           /* tuple of gradient views into the buckets */
    PyObject *bucket_tensors;  /* tuple of flat bucket tensors (host memory) */
    PyObject *on_backward;     /* on_backward_opened(reducer, i), or None */
    mpidp_py_borrowed_t *buckets;
    int device;                /* the core's device mode: full buckets are Python's to post */
    PyObject *on_full;         /* device mode: on_bucket_full(reducer) starts the full buckets' sums */
    size_t n_buckets;
    size_t n_params;
    uint8_t *seen, *act;       /* scratch: mpidp_grad_seen_t / mpidp_grad_action_t per parameter */
    long long *versions;       /* scratch: per bucket */
    /* Set while the C++ gradient hook is installed (grad_hook_api.h): what
     * parameter i's .grad is, read without Python. NULL: the attribute. */
    int (*observe_fn)(void *ctx, size_t i);
    void *observe_ctx;
} mpidp_py_reducer_t;

/* A core call with a fresh error detail: CORE(r, "what", mpidp_reducer_x(...)) < 0 on failure. */
#define CORE(r, what, call) MPIDP_PY_CALL((r)->st, what, call)

/* The parameters' sizes and dtype codes, as the bucket plan takes them. */
typedef struct {
    size_t n;
    size_t *numel;
    int *dtype;
} mpidp_py_sizes_t;

/* Reads `numel` and `dtype` (sequences of ints, one per parameter). 0, or -1
 * with an exception (*s is then freed). */
int mpidp_py_sizes(PyObject *numel, PyObject *dtype, mpidp_py_sizes_t *s);
void mpidp_py_sizes_free(mpidp_py_sizes_t *s);

/* An index argument below `limit`, or -1 with an exception. */
Py_ssize_t mpidp_py_index_arg(PyObject *arg, size_t limit, const char *what);

/* The methods of csrc/py/reducer_pass.c (see their comments there). */
PyObject *mpidp_py_reducer_grad_arrived(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *mpidp_py_reducer_prepare(PyObject *self, PyObject *unused);
PyObject *mpidp_py_reducer_mark_unhooked(PyObject *self, PyObject *unused);
PyObject *mpidp_py_reducer_apply_missing_grads(PyObject *self, PyObject *arg);
PyObject *mpidp_py_reducer_apply_accumulate(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *mpidp_py_reducer_apply_deliver_for_step(PyObject *self, PyObject *const *args,
                                                  Py_ssize_t nargs);
PyObject *mpidp_py_reducer_apply_deliver_now(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *mpidp_py_reducer_apply_after_step(PyObject *self, PyObject *arg);
PyObject *mpidp_py_reducer_end_blocking_backward(PyObject *self, PyObject *unused);

#endif /* MPIDP_PY_REDUCER_H */
