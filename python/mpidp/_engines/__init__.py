"""The Python halves of the core's engines (private): the gradient reducer
and its device and host paths, the deferred step of non-blocking
DataParallel with its two guards against stale reads (apply_on_read: a
parameter read through its module applies the update first;
first_forward_watch: a parameter read before its layer runs), the
error-feedback wire, the device
parameter sync, and the hooks
the engines put on modules (module_hooks, load_watch, progress)."""
