"""Horovod's framework-independent names over mpidp: `mpidp.horovod.init()`,
rank / size / local_* / cross_*, process sets, the capability queries and
HorovodInternalError. The PyTorch API is `mpidp.horovod.torch`: a Horovod
script runs with its import changed to `import mpidp.horovod.torch as hvd`."""

from ._basics import (HorovodInternalError, HostsUpdatedInterrupt, ProcessSet, add_process_set,
                      ccl_built, cross_rank, cross_size, cuda_built, ddl_built, global_process_set,
                      gloo_built, gloo_enabled, init, is_homogeneous, is_initialized, local_rank,
                      local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                      remove_process_set, rocm_built, shutdown, size)
from ._timeline import start as start_timeline, stop as stop_timeline

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ProcessSet", "add_process_set",
           "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
           "global_process_set", "gloo_built", "gloo_enabled", "init", "is_homogeneous",
           "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "rank", "remove_process_set", "rocm_built",
           "shutdown", "size", "start_timeline", "stop_timeline"]
