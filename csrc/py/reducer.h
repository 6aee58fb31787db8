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
    PyObject *module;
    PyObject *comm;
    PyObject *params;          /* tuple of parameters */
    PyObject *views;           /* tuple of gradient views into the buckets */
    PyObject *bucket_tensors;  /* tuple of flat bucket tensors (host memory) */
    mpidp_py_borrowed_t *buckets;
    size_t n_buckets;
    size_t n_params;
    uint8_t *seen, *act;       /* scratch: mpidp_grad_seen_t / mpidp_grad_action_t per parameter */
    long long *versions;       /* scratch: per bucket */
} mpidp_py_reducer_t;

/* A core call with a fresh error detail: CORE(r, "what", mpidp_reducer_x(...)) < 0 on failure. */
#define CORE(r, what, call) MPIDP_PY_CALL((r)->st, what, call)

/* A bucket layout (mpidp_bucket_plan) of parameters of given sizes and dtypes. */
typedef struct {
    size_t n, n_buckets;
    size_t *numel, *offset;
    int *dtype;
    uint32_t *bucket_of;
    mpidp_bucket_info_t *info;
} mpidp_py_plan_t;

/* Plans the buckets of parameters with sizes `numel` and dtype codes `dtype`
 * (sequences of ints) under the caps in bytes. 0, or -1 with an exception
 * naming `what` (*p is then freed). */
int mpidp_py_plan(mpidp_py_state *st, const char *what, PyObject *numel, PyObject *dtype,
                  unsigned long long first_cap, unsigned long long cap, mpidp_py_plan_t *p);
void mpidp_py_plan_free(mpidp_py_plan_t *p);

/* An index argument below `limit`, or -1 with an exception. */
Py_ssize_t mpidp_py_index_arg(PyObject *arg, size_t limit, const char *what);

/* The methods of csrc/py/reducer_pass.c (see their comments there). */
PyObject *mpidp_py_reducer_grad_arrived(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *mpidp_py_reducer_prepare(PyObject *self, PyObject *unused);
PyObject *mpidp_py_reducer_mark_unhooked(PyObject *self, PyObject *unused);
PyObject *mpidp_py_reducer_decide(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif /* MPIDP_PY_REDUCER_H */
