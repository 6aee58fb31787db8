"""DataParallelMultiGPU: node-local DistributedDataParallel, for DASO."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ._consistency import check_same_structure
from ._mpi import MPI, as_mpi4py, resolve_comm
from ._params import broadcast_state, check_module
from .daso import DASO
from .process_group import init_process_group
from .topology import node_comm, topology

__all__ = ["DataParallelMultiGPU"]


class DataParallelMultiGPU(torch.nn.Module):
    """Wraps `module` in torch DistributedDataParallel over the ranks of this
    node (gloo on CPUs, NCCL on GPUs), for training with mpidp.DASO, which
    syncs the nodes with each other.

    The node-local process group is created from MPI if torch.distributed is
    not initialised yet (see mpidp.init_process_group). Parameters and buffers
    start equal on every rank of `comm` (rank 0's), then `optimizer.set_model`
    is called. With one rank per node there is nothing to do within a node, so
    the module is used as it is (with a warning).
    """

    def __init__(self, module: torch.nn.Module, optimizer: DASO, comm=MPI.COMM_WORLD):
        check_module(module)
        if not isinstance(optimizer, DASO):
            raise TypeError("optimizer: expected a mpidp.DASO (DataParallelMultiGPU runs DASO; for "
                            f"other optimizers use mpidp.DataParallel), got {type(optimizer).__name__}")
        c_comm = resolve_comm(comm)
        mpi_comm = as_mpi4py(comm)
        topo = topology(mpi_comm)
        super().__init__()
        self.comm = comm
        self.loc_gpus = topo.local_size
        check_same_structure(c_comm, mpi_comm, module, "DataParallelMultiGPU")
        broadcast_state(module, c_comm)
        if topo.local_size == 1:
            warnings.warn("DataParallelMultiGPU: one rank per node, so there is no node-local "
                          "data parallelism; DASO syncs the nodes only", stacklevel=2)
            self.module = module
        else:
            if not dist.is_initialized():
                init_process_group(node_comm(mpi_comm))
            elif dist.get_world_size() != topo.local_size:
                raise RuntimeError(
                    f"DataParallelMultiGPU: torch.distributed is initialised with "
                    f"{dist.get_world_size()} ranks, but this node has {topo.local_size}; DASO "
                    "needs the node-local group (call mpidp.init_process_group() instead)")
            device_ids = None
            first = next(module.parameters(), None)
            if first is not None and first.is_cuda:
                device_ids = [first.device.index]
            self.module = torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids)
        optimizer.set_model(self.module)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)
