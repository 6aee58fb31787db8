"""The Python halves of the core's engines (private): the gradient reducer
and its device and host paths, the deferred step and the pending and stale
reads of non-blocking DataParallel, the error-feedback wire, the device
parameter sync, the kernels' tensor front, the gossip graphs, and the hooks
the engines put on modules (module_hooks, loads, progress)."""
