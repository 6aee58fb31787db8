/* Staging of DataParallel's buckets: gradients that live in GPU memory are
 * reduced through pinned host buckets. The core says which full bucket must
 * be copied to the host (mpidp_reducer_next_to_stage) and which result must
 * come back (mpidp_reducer_needs_unstaging); this file copies, with torch
 * (asynchronously on a GPU, each copy to the host tracked by a CUDA event),
 * and reports back (mpidp_reducer_staged / _unstaged). */
#include "reducer.h"

#include "mpidp/status.h"

static PyObject *str_copy_, *str_zero_, *str_record;
static PyObject *kw_non_blocking; /* ("non_blocking",): keyword names of copy_ */

int mpidp_py_reducer_staging_init(void)
{
    if (str_copy_) return 0;
    str_copy_ = PyUnicode_InternFromString("copy_");
    str_zero_ = PyUnicode_InternFromString("zero_");
    str_record = PyUnicode_InternFromString("record");
    kw_non_blocking = Py_BuildValue("(s)", "non_blocking");
    return str_copy_ && str_zero_ && str_record && kw_non_blocking ? 0 : -1;
}

int mpidp_py_call_method0(PyObject *obj, PyObject *name)
{
    PyObject *res = PyObject_CallMethodNoArgs(obj, name);
    Py_XDECREF(res);
    return res ? 0 : -1;
}

/* Copies the gradient part of bucket b between its device and host buffers
 * (the flags that follow it live on the host only). On a GPU the copy is
 * asynchronous (pinned host memory, torch's current stream): to the host it
 * is followed by an event that says when the host bytes are there; back to
 * the device, stream order puts it before everything that reads the
 * gradients, and the host bucket is next written only after the next pass's
 * copy to the host has completed (see mpidp_py_reducer_stage_full). */
int mpidp_py_reducer_stage(mpidp_py_reducer_t *r, size_t b, int how)
{
    if (r->device_buckets == NULL) return 0;
    int to_host = how != MPIDP_PY_TO_DEVICE;
    /* Only the backward hooks' copies to the host may run ahead (their arrival
     * is checked before the core reads them); every other caller reads the
     * host bucket right away. */
    int non_blocking = r->event_type != NULL && how != MPIDP_PY_TO_HOST;
    PyObject *h = PyTuple_GET_ITEM(r->host_grads, b), *d = PyTuple_GET_ITEM(r->dev_grads, b);
    /* dst.copy_(src, non_blocking=...), without building arguments per call */
    PyObject *argv[] = {to_host ? h : d, to_host ? d : h, non_blocking ? Py_True : Py_False};
    PyObject *res = PyObject_VectorcallMethod(str_copy_, argv, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                              kw_non_blocking);
    if (res == NULL) return -1;
    Py_DECREF(res);
    if (how == MPIDP_PY_TO_HOST_ASYNC && non_blocking) {
        PyObject *ev = PyObject_CallNoArgs(r->event_type);
        if (ev == NULL || mpidp_py_call_method0(ev, str_record) < 0) {
            Py_XDECREF(ev);
            return -1;
        }
        Py_XSETREF(r->stage_event[b], ev);
    }
    return 0;
}

/* Tells the core that bucket b's gradients are in its host buffer (after its
 * copy's event, if any, has passed: `wait` waits for it, else only a copy
 * already done counts). */
static int report_staged(mpidp_py_reducer_t *r, size_t b, int wait)
{
    PyObject *ev = r->stage_event[b];
    if (ev != NULL) {
        PyObject *res = PyObject_CallMethod(ev, wait ? "synchronize" : "query", NULL);
        if (res == NULL) return -1;
        int done = wait || PyObject_IsTrue(res);
        Py_DECREF(res);
        if (!done) return 0;
        Py_CLEAR(r->stage_event[b]);
    }
    return CORE(r, "DataParallel backward", mpidp_reducer_staged(r->core, b));
}

/* What the core asks after parameters were marked: copy every full bucket to
 * the host, and tell it which copies have arrived (it then posts in bucket
 * order). With `flush`, wait for every copy: everything full gets posted. */
int mpidp_py_reducer_stage_full(mpidp_py_reducer_t *r, int flush)
{
    size_t b, from = 0;
    while (from < r->n_buckets && mpidp_reducer_next_to_stage(r->core, from, &b)) {
        from = b + 1;
        if (!r->copy_issued[b]) {
            if (mpidp_py_reducer_stage(r, b, MPIDP_PY_TO_HOST_ASYNC) < 0) return -1;
            r->copy_issued[b] = 1;
            /* Non-blocking mode: the core zeroes the host bucket once it is
             * copied for sending; the device bucket, where the .grad views are,
             * must match (stream order puts this after the copy). */
            if (!r->blocking && mpidp_py_call_method0(PyTuple_GET_ITEM(r->device_buckets, b), str_zero_) < 0)
                return -1;
        }
        if (report_staged(r, b, flush) < 0) return -1;
    }
    return 0;
}
