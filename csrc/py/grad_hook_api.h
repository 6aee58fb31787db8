/* What mpidp._C offers its optional C++ gradient hook (csrc/torch/grad_hook.cpp,
 * the module mpidp._grad_hook, built against libtorch): a table of functions
 * in the capsule MPIDP_GRAD_HOOK_API_CAPSULE. The C++ hook calls `arrived`
 * without the GIL for the common case (the parameter's .grad is its bucket
 * view) and falls back to the Python-level Reducer.grad_arrived(i, param)
 * for everything else, so the semantics live in one place (reducer_pass.c). */
#ifndef MPIDP_PY_GRAD_HOOK_API_H
#define MPIDP_PY_GRAD_HOOK_API_H

#include <Python.h>
#include <stddef.h>

#define MPIDP_GRAD_HOOK_API_CAPSULE "mpidp._C._grad_hook_api"
/* Raised whenever the table or the meaning of an entry changes. */
#define MPIDP_GRAD_HOOK_API_VERSION 3

/* What an observer says parameter i's .grad is. */
enum { MPIDP_GRAD_HOOK_NONE, MPIDP_GRAD_HOOK_VIEW, MPIDP_GRAD_HOOK_OTHER };
typedef int (*mpidp_grad_hook_observer_t)(void *ctx, size_t i);

typedef struct {
    int version;
    /* GIL held. The number of parameters of `reducer` when it is a
     * _C.Reducer, else -1 with a TypeError. */
    Py_ssize_t (*n_params)(PyObject *reducer);
    /* GIL held; i < n_params. Parameter i and its .grad's bucket view (borrowed:
     * the reducer holds them). */
    PyObject *(*param)(PyObject *reducer, size_t i);
    PyObject *(*view)(PyObject *reducer, size_t i);
    /* GIL not needed. Parameter i's .grad is its bucket view: mark it, as
     * grad_arrived would. 1: done; 2: done, and a full bucket waits for its
     * sum to start (device-resident buckets): call `bucket_full` with the
     * GIL, once per bucket rather than per parameter; 0: nothing done, the caller must call grad_arrived(i,
     * param) (a backward opens, a forked process); -1: the core failed with
     * *status (call `raise` with the GIL). */
    int (*arrived)(PyObject *reducer, size_t i, int *status);
    /* GIL held: sets the Python exception for a failed `arrived`. */
    void (*raise)(PyObject *reducer, int status);
    /* GIL held. From now on the reducer asks `observe(ctx, i)` what
     * parameter i's .grad is (its passes read every .grad), instead of
     * Python's attribute; NULL: back to the attribute. The caller keeps ctx
     * alive until it sets NULL. */
    void (*set_observer)(PyObject *reducer, mpidp_grad_hook_observer_t observe, void *ctx);
    /* GIL held. After `arrived` returned 2: the reducer's owner starts the
     * full buckets' sums. 0, or -1 with a Python exception. */
    int (*bucket_full)(PyObject *reducer);
} mpidp_grad_hook_api_t;

#endif /* MPIDP_PY_GRAD_HOOK_API_H */
