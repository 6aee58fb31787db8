"""Horovod's PyTorch API (horovod.torch 0.28.1) over mpidp's core.

    import mpidp.horovod.torch as hvd      # was: import horovod.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

Launch with `mpirun -np N python train.py` or `srun python train.py`
(docs/horovod.md: what differs from Horovod, on purpose)."""

from .._basics import (HorovodInternalError, HostsUpdatedInterrupt, ProcessSet, add_process_set,
                       ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                       global_process_set, gloo_built, gloo_enabled, init, is_homogeneous,
                       is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                       mpi_threads_supported, nccl_built, rank, remove_process_set, rocm_built,
                       shutdown, size)
from .._timeline import start as start_timeline, stop as stop_timeline
from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async,
                      allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall,
                      alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
                      broadcast_async_, grouped_allgather, grouped_allgather_async,
                      grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                      grouped_allreduce_async_, grouped_reducescatter, grouped_reducescatter_async,
                      join, poll, reducescatter, reducescatter_async, sparse_allreduce_async,
                      synchronize)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from . import elastic

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ProcessSet", "add_process_set",
           "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
           "global_process_set", "gloo_built", "gloo_enabled", "init", "is_homogeneous",
           "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "rank", "remove_process_set", "rocm_built",
           "shutdown", "size", "start_timeline", "stop_timeline", "Compression",
           "allgather_object", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters", "Adasum", "Average", "Max", "Min", "Product", "Sum",
           "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async",
           "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "grouped_allgather", "grouped_allgather_async",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
           "join", "poll", "reducescatter", "reducescatter_async", "sparse_allreduce_async",
           "synchronize", "DistributedOptimizer", "SyncBatchNorm", "elastic"]
