"""Every import path a user or the docs name keeps working now that the
package's layers are folders (docs/design-notes.md, "The package's
layers"): the public names, the public modules at their former paths (the
same module objects as at their new ones), and pickles that name a class by
its former module."""

import importlib
import pickle

import pytest

import mpidp

PUBLIC_NAMES = [
    "BaguaModule", "CommError", "CommTimeout", "DASO", "DataParallel", "DataParallelMultiGPU",
    "DataParallelOptimizer", "DeMo", "DiLoCo", "HierarchicalModelAverager", "MPI", "MPICommunication",
    "MPI_SELF", "MPI_WORLD", "Membership", "PeriodicModelAverager", "PostLocalSGDOptimizer",
    "RanksLost", "SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel", "SparseLoCo", "Topology",
    "Work", "WrapperCopy", "allgather", "allreduce", "allreduce_scalar", "barrier", "broadcast",
    "broadcast_optimizer_state", "broadcast_parameters", "cross_node_comm", "enable_fault_tolerance",
    "init_process_group", "local_rank", "mpi_library_version", "node_comm", "rank", "recover",
    "reduce_scatter", "size", "topology", "with_bagua", "get_timeout", "set_timeout",
    "fault_tolerance.recover", "fault_tolerance.enabled", "fault_tolerance.is_replacement",
    "fault_tolerance.recovery_times", "fault_tolerance.reset_grad_scaler",
    "fault_tolerance.save_checkpoint", "fault_tolerance.share_state",
    "fault_tolerance.steps_committed", "fault_tolerance.world_comm", "fault_tolerance.RanksLost",
    "fault_tolerance.step_boundary", "fault_tolerance.commit_step",
    "fault_tolerance.keep_whole_groups",
    "algorithms.GradientAllReduceAlgorithm", "algorithms.ByteGradAlgorithm",
    "algorithms.QAdamAlgorithm", "algorithms.QAdamOptimizer", "algorithms.DecentralizedAlgorithm",
    "algorithms.LowPrecisionDecentralizedAlgorithm", "algorithms.AsyncModelAverageAlgorithm",
    "algorithms.LocalSGDAlgorithm", "algorithms.SlowMoAlgorithm", "algorithms.DiLoCoAlgorithm",
    "algorithms.SparseLoCoAlgorithm", "algorithms.MuLoCoAlgorithm",
    "algorithms.NoLoCoAlgorithm", "algorithms.EagerDiLoCoAlgorithm",
    "algorithms.DESLOCAlgorithm", "algorithms.Algorithm",
    "gossip.DynamicDirectedExponentialGraph", "gossip.UniformMixing", "kernels.quantize8",
    "kernels.pack", "nn.DataParallel", "nn.DataParallelMultiGPU", "optim.DASO",
    "optim.DataParallelOptimizer", "collectives.allreduce", "collectives.Work",
    "collectives.allreduce_agreed", "collectives.reduce_scatter_agreed", "collectives.check_root",
    "collectives.reduce_scatter",
]

# The public modules' former paths (one flat folder, then algorithms/ before
# Bagua's plumbing moved to algorithms/bagua/) -> where they are now.
FORMER_PATHS = {
    "mpidp.daso": "mpidp.algorithms.daso", "mpidp.data_parallel": "mpidp.algorithms.data_parallel",
    "mpidp.data_parallel_multi": "mpidp.algorithms.data_parallel_multi",
    "mpidp.optimizer": "mpidp.algorithms.optimizer", "mpidp.averaging": "mpidp.algorithms.averaging",
    "mpidp.async_average": "mpidp.algorithms.async_average", "mpidp.slowmo": "mpidp.algorithms.slowmo",
    "mpidp.diloco": "mpidp.algorithms.diloco", "mpidp.sparseloco": "mpidp.algorithms.sparseloco",
    "mpidp.demo": "mpidp.algorithms.demo", "mpidp.bagua": "mpidp.algorithms.bagua",
    "mpidp.qadam": "mpidp.algorithms.qadam", "mpidp.decentralized": "mpidp.algorithms.decentralized",
    "mpidp.replica_algorithms": "mpidp.algorithms.bagua.adapters",
    "mpidp.wrapper_copy": "mpidp.algorithms.driver", "mpidp.gossip": "mpidp.primitives.gossip",
    "mpidp.kernels": "mpidp.primitives.kernels", "mpidp.broadcast": "mpidp.collectives.model_state",
    "mpidp.communication": "mpidp.collectives.communication",
    "mpidp.process_group": "mpidp.collectives.process_groups",
    "mpidp.topology": "mpidp._runtime.topology",
    "mpidp.algorithms.replica_algorithms": "mpidp.algorithms.bagua.adapters",
    "mpidp.algorithms.bagua_family": "mpidp.algorithms.bagua",
    "mpidp.algorithms.algorithm": "mpidp.algorithms.bagua.algorithm",
    "mpidp.algorithms.wrapper_copy": "mpidp.algorithms.driver",
    "mpidp.planning.algorithms": "mpidp.planning.algorithm_costs",
}


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_public_name(name):
    obj = mpidp
    for part in name.split("."):
        obj = getattr(obj, part)
    assert obj is not None


@pytest.mark.parametrize("former", sorted(FORMER_PATHS))
def test_a_module_at_its_former_path_is_the_module_now(former):
    assert importlib.import_module(former) is importlib.import_module(FORMER_PATHS[former])


def test_the_front_ends_import():
    for name in ("mpidp.horovod", "mpidp.horovod.torch", "mpidp.horovod.torch.elastic",
                 "mpidp.c10d", "mpidp.nn", "mpidp.optim", "mpidp.fault_tolerance",
                 "mpidp.collectives", "mpidp.algorithms"):
        importlib.import_module(name)


def test_a_pickle_naming_a_former_module_loads():
    # What pickle wrote for a WrapperCopy's class before the move (protocol 0).
    assert pickle.loads(b"cmpidp.wrapper_copy\nWrapperCopy\n.") is mpidp.WrapperCopy
    assert pickle.loads(b"cmpidp.algorithms.wrapper_copy\nWrapperCopy\n.") is mpidp.WrapperCopy
    assert pickle.loads(b"cmpidp.daso\nDASO\n.") is mpidp.DASO
    assert pickle.loads(pickle.dumps(mpidp.WrapperCopy)) is mpidp.WrapperCopy
