"""Heat's exception rule in every argument check: an argument of the wrong
type (a string where a dtype, an int, a float or a bool is expected) raises
TypeError, a value of the right type out of range ValueError, and the message
starts with the argument's name. Heat's users write `except TypeError`
around such calls, so the type is part of the interface.

Each case builds one public object (or calls one public function) with every
argument valid but one."""

import re

import pytest
import torch

import mpidp
from dp_reference import SIZE
from mpidp import MPI
from mpidp.algorithms import (ByteGradAlgorithm, GradientAllReduceAlgorithm, QAdamAlgorithm,
                              QAdamOptimizer)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1)


def daso(**kwargs):
    args = dict(local_optimizer=sgd(model()), total_epochs=4)
    args.update(kwargs)
    return mpidp.DASO(**args)


def data_parallel(**kwargs):
    args = dict(module=model(), blocking_parameter_updates=True)
    args.update(kwargs)
    return mpidp.DataParallel(**args)


def multi_gpu(**kwargs):
    m = model()
    args = dict(module=m, optimizer=mpidp.DASO(sgd(m), total_epochs=4))
    args.update(kwargs)
    return mpidp.DataParallelMultiGPU(**args)


def slowmo(**kwargs):
    return mpidp.SlowMoDistributedDataParallel(model(), **kwargs)


def diloco(**kwargs):
    m = model()
    args = dict(model=m, inner_optimizer=sgd(m), outer_optimizer=sgd(m), sync_every=4)
    args.update(kwargs)
    return mpidp.DiLoCo(**args)


def qadam(**kwargs):
    return QAdamOptimizer(model().parameters(), **kwargs)


def with_bagua(**kwargs):
    m = model()
    args = dict(module=m, optimizers=[sgd(m)], algorithm=GradientAllReduceAlgorithm())
    args.update(kwargs)
    return mpidp.with_bagua(**args)


def daso_method(name, *args):
    return getattr(daso(), name)(*args)


def joined_data_parallel(**kwargs):
    net = data_parallel()
    with net.join(**kwargs):
        pass


CASES = [
    # --- DASO: Heat's 14 constructor arguments
    ("downcast_type", TypeError, lambda: daso(downcast_type="asdf")),
    ("downcast_type", TypeError, lambda: daso(downcast_type="bfloat16")),
    ("downcast_type", ValueError, lambda: daso(downcast_type=torch.int8)),
    ("local_optimizer", TypeError, lambda: daso(local_optimizer="sgd")),
    ("total_epochs", TypeError, lambda: daso(total_epochs="4")),
    ("total_epochs", TypeError, lambda: daso(total_epochs=2.5)),
    ("total_epochs", ValueError, lambda: daso(total_epochs=0)),
    ("comm", TypeError, lambda: daso(comm="world")),
    ("comm", ValueError, lambda: daso(comm=MPI.COMM_NULL)),
    ("warmup_epochs", TypeError, lambda: daso(warmup_epochs="1")),
    ("warmup_epochs", ValueError, lambda: daso(warmup_epochs=-1)),
    ("cooldown_epochs", TypeError, lambda: daso(cooldown_epochs=True)),
    ("cooldown_epochs", ValueError, lambda: daso(cooldown_epochs=-1)),
    ("scheduler", TypeError, lambda: daso(scheduler=3)),
    ("stability_level", TypeError, lambda: daso(stability_level="0.05")),
    ("stability_level", ValueError, lambda: daso(stability_level=1.5)),
    ("stability_level", ValueError, lambda: daso(stability_level=float("nan"))),
    ("max_global_skips", TypeError, lambda: daso(max_global_skips="8")),
    ("max_global_skips", ValueError, lambda: daso(max_global_skips=0)),
    ("sending_chunk_size", TypeError, lambda: daso(sending_chunk_size=1e6)),
    ("sending_chunk_size", ValueError, lambda: daso(sending_chunk_size=0)),
    ("sending_chunk_size", ValueError, lambda: daso(sending_chunk_size=2**31)),
    ("use_mpi_groups", TypeError, lambda: daso(use_mpi_groups=1)),
    ("skip_reduction_factor", TypeError, lambda: daso(skip_reduction_factor="2")),
    ("skip_reduction_factor", ValueError, lambda: daso(skip_reduction_factor=1)),
    ("local_skip_factor", TypeError, lambda: daso(local_skip_factor=4.0)),
    ("local_skip_factor", ValueError, lambda: daso(local_skip_factor=0)),
    ("verbose", TypeError, lambda: daso(verbose="yes")),
    # DASO's methods
    ("loss", TypeError, lambda: daso_method("epoch_loss_logic", "0.5")),
    ("loss", ValueError, lambda: daso_method("epoch_loss_logic", torch.zeros(2))),
    ("loss_globally_averaged", TypeError, lambda: daso_method("epoch_loss_logic", 0.5, 1)),
    ("state", TypeError, lambda: daso_method("load_state_dict", "checkpoint.pt")),
    ("state", ValueError, lambda: daso_method("load_state_dict", {"format": "other"})),
    ("scaler", TypeError, lambda: daso_method("add_scaler", "amp")),
    # --- DataParallel
    ("module", TypeError, lambda: data_parallel(module="model")),
    ("comm", TypeError, lambda: data_parallel(comm=0)),
    ("optimizer", TypeError, lambda: data_parallel(optimizer="sgd")),
    ("blocking_parameter_updates", TypeError,
     lambda: data_parallel(blocking_parameter_updates="yes")),
    ("wire_dtype", TypeError, lambda: data_parallel(wire_dtype="bfloat16")),
    ("wire_dtype", ValueError, lambda: data_parallel(wire_dtype=torch.int32)),
    ("bucket_cap_mb", TypeError, lambda: data_parallel(bucket_cap_mb="25")),
    ("bucket_cap_mb", ValueError, lambda: data_parallel(bucket_cap_mb=0)),
    ("bucket_cap_mb", ValueError, lambda: data_parallel(bucket_cap_mb=float("inf"))),
    ("first_bucket_cap_mb", TypeError, lambda: data_parallel(first_bucket_cap_mb=None)),
    ("first_bucket_cap_mb", ValueError, lambda: data_parallel(first_bucket_cap_mb=-1.0)),
    ("broadcast_buffers", TypeError, lambda: data_parallel(broadcast_buffers=1)),
    ("hierarchical", TypeError, lambda: data_parallel(hierarchical="yes")),
    ("adopt_optimizer_state", TypeError, lambda: joined_data_parallel(adopt_optimizer_state=1)),
    # --- DataParallelMultiGPU and DataParallelOptimizer
    ("module", TypeError, lambda: multi_gpu(module="model")),
    ("optimizer", TypeError, lambda: multi_gpu(optimizer="daso")),
    ("comm", TypeError, lambda: multi_gpu(comm="world")),
    ("broadcast_buffers", TypeError, lambda: multi_gpu(broadcast_buffers="yes")),
    ("torch_optimizer", TypeError, lambda: mpidp.DataParallelOptimizer("sgd")),
    ("blocking", TypeError, lambda: mpidp.DataParallelOptimizer(sgd(model()), blocking=1)),
    # --- the model averagers
    ("period", TypeError, lambda: mpidp.PeriodicModelAverager("4")),
    ("period", ValueError, lambda: mpidp.PeriodicModelAverager(0)),
    ("warmup_steps", TypeError, lambda: mpidp.PeriodicModelAverager(4, warmup_steps=1.5)),
    ("warmup_steps", ValueError, lambda: mpidp.PeriodicModelAverager(4, warmup_steps=-1)),
    ("process_group", TypeError, lambda: mpidp.PeriodicModelAverager(4, process_group="world")),
    ("period_group_size_dict", TypeError, lambda: mpidp.HierarchicalModelAverager([4, SIZE])),
    ("period_group_size_dict", ValueError, lambda: mpidp.HierarchicalModelAverager({})),
    ("period_group_size_dict", TypeError, lambda: mpidp.HierarchicalModelAverager({"4": SIZE})),
    ("period_group_size_dict", ValueError, lambda: mpidp.HierarchicalModelAverager({4: SIZE + 1})),
    ("optim", TypeError, lambda: mpidp.PostLocalSGDOptimizer("sgd", mpidp.PeriodicModelAverager(4))),
    ("averager", TypeError, lambda: mpidp.PostLocalSGDOptimizer(sgd(model()), "periodic")),
    # --- SlowMo
    ("module", TypeError, lambda: mpidp.SlowMoDistributedDataParallel("model")),
    ("slowmo_base_algorithm", TypeError, lambda: slowmo(slowmo_base_algorithm=0)),
    ("slowmo_base_algorithm", ValueError, lambda: slowmo(slowmo_base_algorithm="gossip")),
    ("slowmo_momentum", TypeError, lambda: slowmo(slowmo_momentum="0.5")),
    ("slowmo_momentum", ValueError, lambda: slowmo(slowmo_momentum=-0.5)),
    ("slowmo_lr", TypeError, lambda: slowmo(slowmo_lr=None)),
    ("slowmo_lr", ValueError, lambda: slowmo(slowmo_lr=-1.0)),
    ("slowmo_frequency", TypeError, lambda: slowmo(slowmo_frequency="48")),
    ("slowmo_frequency", ValueError, lambda: slowmo(slowmo_frequency=0)),
    ("localsgd_frequency", TypeError, lambda: slowmo(localsgd_frequency=3.0)),
    ("localsgd_frequency", ValueError, lambda: slowmo(localsgd_frequency=0)),
    ("slowmo_num_shards", TypeError, lambda: slowmo(slowmo_num_shards="32")),
    ("slowmo_num_shards", ValueError, lambda: slowmo(slowmo_num_shards=0)),
    ("nprocs_per_node", TypeError, lambda: slowmo(nprocs_per_node="1")),
    ("nprocs_per_node", ValueError, lambda: slowmo(nprocs_per_node=SIZE + 1)),
    ("broadcast_buffers", TypeError, lambda: slowmo(broadcast_buffers="yes")),
    ("slowmo_memory_efficient", TypeError, lambda: slowmo(slowmo_memory_efficient=1)),
    ("overlap", TypeError, lambda: slowmo(overlap="no")),
    ("synch_freq", TypeError, lambda: slowmo(synch_freq="0")),
    ("comm", TypeError, lambda: slowmo(comm="world")),
    # --- DiLoCo
    ("model", TypeError, lambda: diloco(model="model")),
    ("inner_optimizer", TypeError, lambda: diloco(inner_optimizer="sgd")),
    ("outer_optimizer", TypeError, lambda: diloco(outer_optimizer="sgd")),
    ("sync_every", TypeError, lambda: diloco(sync_every="4")),
    ("sync_every", ValueError, lambda: diloco(sync_every=0)),
    ("fragment_sync_delay", TypeError, lambda: diloco(fragment_sync_delay=1.0)),
    ("fragment_sync_delay", ValueError, lambda: diloco(fragment_sync_delay=4)),
    ("fragment_update_alpha", TypeError, lambda: diloco(fragment_update_alpha="0.5")),
    ("fragment_update_alpha", ValueError, lambda: diloco(fragment_update_alpha=1.5)),
    ("wire_dtype", TypeError, lambda: diloco(wire_dtype="bfloat16")),
    ("wire_dtype", ValueError, lambda: diloco(wire_dtype=torch.uint8)),
    ("sync_buffers", TypeError, lambda: diloco(sync_buffers="yes")),
    ("model_fragments", TypeError, lambda: diloco(model_fragments=3)),
    ("model_fragments", TypeError, lambda: diloco(model_fragments=torch.nn.Linear(4, 3))),
    ("model_fragments", ValueError, lambda: diloco(model_fragments=[])),
    ("comm", TypeError, lambda: diloco(comm="world")),
    # --- Bagua's API
    ("module", TypeError, lambda: with_bagua(module="model")),
    ("optimizers", TypeError, lambda: with_bagua(optimizers=["sgd"])),
    ("algorithm", TypeError, lambda: with_bagua(algorithm="bytegrad")),
    ("do_flatten", TypeError, lambda: with_bagua(do_flatten=1)),
    ("hierarchical", TypeError, lambda: GradientAllReduceAlgorithm(hierarchical="yes")),
    ("average", TypeError, lambda: ByteGradAlgorithm(average=1)),
    ("q_adam_optimizer", TypeError, lambda: QAdamAlgorithm(torch.optim.Adam(model().parameters()))),
    ("hierarchical", TypeError, lambda: QAdamAlgorithm(qadam(), hierarchical=None)),
    ("lr", TypeError, lambda: qadam(lr="1e-3")),
    ("lr", ValueError, lambda: qadam(lr=-1e-3)),
    ("warmup_steps", TypeError, lambda: qadam(warmup_steps="100")),
    ("warmup_steps", ValueError, lambda: qadam(warmup_steps=0)),
    ("betas", TypeError, lambda: qadam(betas=0.9)),
    ("betas[0]", TypeError, lambda: qadam(betas=("0.9", 0.999))),
    ("betas[1]", ValueError, lambda: qadam(betas=(0.9, 1.0))),
    ("eps", TypeError, lambda: qadam(eps="1e-8")),
    ("eps", ValueError, lambda: qadam(eps=-1.0)),
    ("weight_decay", TypeError, lambda: qadam(weight_decay=None)),
    ("weight_decay", ValueError, lambda: qadam(weight_decay=-0.1)),
    # --- the collectives
    ("op", TypeError, lambda: mpidp.allreduce(torch.zeros(3), op=MPI.SUM)),
    ("op", ValueError, lambda: mpidp.allreduce(torch.zeros(3), op="mean")),
    ("wire_dtype", TypeError, lambda: mpidp.allreduce(torch.zeros(3), wire_dtype="bfloat16")),
    ("wire_dtype", ValueError, lambda: mpidp.allreduce(torch.zeros(3), wire_dtype=torch.int8)),
    ("async_op", TypeError, lambda: mpidp.allreduce(torch.zeros(3), async_op=1)),
    ("async_op", TypeError, lambda: mpidp.broadcast(torch.zeros(3), async_op="yes")),
    ("async_op", TypeError, lambda: mpidp.allgather(torch.zeros(3), async_op=1)),
    ("async_op", TypeError, lambda: mpidp.reduce_scatter(torch.zeros(3), async_op=None)),
    ("async_op", TypeError, lambda: mpidp.barrier(async_op=0)),
    ("tensor", TypeError, lambda: mpidp.allreduce([1.0, 2.0])),
    ("root", TypeError, lambda: mpidp.broadcast(torch.zeros(3), root="0")),
    ("root", ValueError, lambda: mpidp.broadcast(torch.zeros(3), root=SIZE)),
    ("op", TypeError, lambda: mpidp.reduce_scatter(torch.zeros(3), op=None)),
    ("op", ValueError, lambda: mpidp.reduce_scatter(torch.zeros(3), op="max")),
    ("backend", TypeError, lambda: mpidp.init_process_group(MPI.COMM_WORLD, backend=3)),
    ("backend", ValueError, lambda: mpidp.init_process_group(MPI.COMM_WORLD, backend="tcp")),
]


def case_id(case):
    name, exc, _ = case
    return f"{name}-{exc.__name__}"


@pytest.mark.parametrize("name, exc, call", CASES, ids=[case_id(c) for c in CASES])
def test_wrong_types_raise_type_error_and_bad_values_value_error(name, exc, call):
    # Exactly `exc`: a ValueError where TypeError is expected (or the
    # reverse) fails, which pytest.raises alone would not catch for subclasses.
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    assert type(info.value) is exc, f"{name}: raised {type(info.value).__name__}: {info.value}"
    assert re.match(rf"{re.escape(name)}(?!\w)", str(info.value)), \
        f"the message does not start with {name!r}: {info.value}"


def test_a_dtype_given_as_a_string_is_told_how_to_write_it():
    with pytest.raises(TypeError, match=r"write torch\.bfloat16, not the string"):
        daso(downcast_type="bfloat16")
