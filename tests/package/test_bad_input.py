"""Bad input to the DataParallel API: a clear TypeError/ValueError naming the
argument and what was expected."""

import pytest
import torch
from mpi4py import MPI

import mpidp


def model():
    return torch.nn.Linear(3, 2)


def dp_opt(m):
    return mpidp.DataParallelOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))


def test_optimizer_wrapper_needs_a_torch_optimizer():
    with pytest.raises(TypeError, match="torch_optimizer: expected a torch.optim.Optimizer"):
        mpidp.DataParallelOptimizer("sgd")
    with pytest.raises(TypeError, match="blocking: expected a bool"):
        mpidp.DataParallelOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), blocking=1)


def test_raw_torch_optimizer_where_a_wrapper_is_needed():
    m = model()
    with pytest.raises(TypeError, match=r"optimizer: expected mpidp.DataParallelOptimizer.*wrap it"):
        mpidp.DataParallel(m, MPI.COMM_WORLD, torch.optim.SGD(m.parameters(), lr=0.1))


def test_non_optimizer():
    with pytest.raises(TypeError, match="optimizer: expected a mpidp.DataParallelOptimizer"):
        mpidp.DataParallel(model(), MPI.COMM_WORLD, 42)
    m = model()
    with pytest.raises(TypeError, match="optimizer"):
        mpidp.DataParallel(m, MPI.COMM_WORLD, [dp_opt(m), "adam"])


def test_non_module():
    with pytest.raises(TypeError, match="module: expected a torch.nn.Module, got function"):
        mpidp.DataParallel(lambda x: x, MPI.COMM_WORLD)


def test_comm_that_is_not_a_communicator():
    with pytest.raises(TypeError, match="comm: expected an mpi4py communicator"):
        mpidp.DataParallel(model(), comm=0)
    with pytest.raises(ValueError, match="comm: the communicator is MPI.COMM_NULL"):
        mpidp.DataParallel(model(), comm=MPI.COMM_NULL)


def test_non_float_parameters():
    m = model()
    m.steps = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ValueError, match="module: parameter 'steps' has dtype torch.int64"):
        mpidp.DataParallel(m)
    c = model()
    c.z = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="parameter 'z' has dtype torch.complex64"):
        mpidp.DataParallel(c)


def test_c_types_check_their_arguments():
    with pytest.raises(TypeError, match="comm: expected an mpi4py communicator"):
        mpidp._C.Comm(3)
    with pytest.raises(TypeError):
        mpidp._C.Work()  # handed out by allreduce only
    with pytest.raises(ValueError, match="plan_buckets"):
        mpidp._C.plan_buckets([1], [9], 10, 10)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 0,
                    reason="this machine has a GPU: NCCL is possible")
def test_nccl_without_gpus_says_so():
    with pytest.raises(RuntimeError, match="backend='nccl' needs CUDA GPUs.*backend='gloo'"):
        mpidp.init_process_group(MPI.COMM_SELF, backend="nccl")


def test_a_default_group_asked_again_with_another_backend_is_refused():
    """A second init_process_group with the same ranks does nothing, but not
    silently when it asks for another backend than the group has."""
    import torch.distributed as dist
    made_here = not dist.is_initialized()
    if made_here:
        mpidp.init_process_group(backend="gloo")
    other = "gloo" if dist.get_backend() == "mpidp" else "mpidp"
    try:
        with pytest.raises(RuntimeError, match=f"already initialised with backend .*not '{other}'"):
            mpidp.init_process_group(backend=other)
        mpidp.init_process_group()       # no backend asked: nothing to refuse
    finally:
        if made_here:
            dist.destroy_process_group()


def test_the_glue_takes_a_dlpack_capsule_as_it_is():
    """The torch.distributed backend hands the core DLPack capsules it made
    itself: the capsule is the tensor's memory (the sum lands in it; the
    glue only borrows it, so it can be passed again), and a capsule that is
    not DLPack's is refused naming the argument."""
    import ctypes
    comm = mpidp._C.Comm(MPI.COMM_WORLD)
    t = torch.full((4,), float(comm.rank + 1))
    capsule = torch._C._to_dlpack_versioned(t)
    total = float(sum(range(1, comm.size + 1)))
    comm.allreduce(capsule, mpidp._C.OP_SUM, mpidp._C.NO_WIRE, False)
    assert torch.equal(t, torch.full((4,), total))
    comm.allreduce(capsule, mpidp._C.OP_SUM, mpidp._C.NO_WIRE, False)
    assert torch.equal(t, torch.full((4,), total * comm.size))
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, (ctypes.c_void_p,
                                                                   ctypes.c_char_p, ctypes.c_void_p)
    foreign = new_capsule(ctypes.addressof(ctypes.c_int(0)), b"not_dltensor", None)
    with pytest.raises(TypeError, match="tensor: expected an unused DLPack capsule"):
        comm.allreduce(foreign, mpidp._C.OP_SUM, mpidp._C.NO_WIRE, False)


def test_messages_name_the_operation_once():
    """The core's detail often starts with the operation the glue names too."""
    with pytest.raises((TypeError, ValueError)) as info:
        mpidp._C.Comm(MPI.COMM_WORLD).allreduce(torch.zeros(3, dtype=torch.float64),
                                                mpidp._C.OP_SUM, mpidp._C.DTYPE_BF16, False)
    message = str(info.value)
    assert message.startswith("allreduce: ") and "allreduce: allreduce" not in message, message


def test_a_failed_work_raises_again_at_every_later_wait():
    """A Work whose operation failed raises at its first wait and again at
    every later wait and result(): a caught CommError must not turn into a
    result that never arrived. The failure: ranks that disagree on the
    message size (each rank's own sizes agree, so nothing is refused before
    posting), so rank 0's longer message is truncated at rank 1."""
    comm = mpidp._C.Comm(MPI.COMM_WORLD)
    me, size = comm.rank, comm.size
    if size < 2:
        pytest.skip("needs a peer")   # one rank has no other rank to exchange with
    n = 8 if me == 0 else 4
    send, recv = torch.zeros(n), torch.zeros(n)
    work = comm.peer_exchange(send, ((me + 1) % size,), (recv,), ((me - 1) % size,))
    failed = 0
    try:
        work.wait()
    except mpidp.CommError:
        failed = 1
        for again in (work.wait, work.result):
            with pytest.raises(mpidp.CommError, match="failed when it was first waited for"):
                again()
        assert work.is_completed()
    assert MPI.COMM_WORLD.allgather(failed)[1] == 1


def test_a_peer_exchange_into_a_buffer_of_another_size_is_refused_before_posting():
    """Refused by the core (mpidp_peerx_start) on every rank alike, naming the
    buffer, before anything is posted: a short buffer would be overrun."""
    comm = mpidp._C.Comm(MPI.COMM_WORLD)
    me, size = comm.rank, comm.size
    if size < 2:
        pytest.skip("needs a peer")   # one rank has no other rank to exchange with
    send, short = torch.zeros(4), torch.zeros(3)
    with pytest.raises(ValueError, match="receive buffer 0 holds 12 bytes, the message 16"):
        comm.peer_exchange(send, ((me + 1) % size,), (short,), ((me - 1) % size,))


def test_keep_whole_groups_names_its_bad_arguments():
    with pytest.raises(TypeError, match="membership: expected what mpidp.recover"):
        mpidp.fault_tolerance.keep_whole_groups((0, 4), 2)
    m = mpidp.fault_tolerance.Membership(0, 2, (1,), 3, 1, MPI.COMM_SELF)
    with pytest.raises(ValueError, match="group_size: 2 does not divide the 3 ranks"):
        mpidp.fault_tolerance.keep_whole_groups(m, 2)
    with pytest.raises(ValueError, match="group_size"):
        mpidp.fault_tolerance.keep_whole_groups(m, 0)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="needs ranks that can differ")
def test_keep_whole_groups_refuses_sizes_that_differ_across_ranks_on_every_rank():
    comm = MPI.COMM_WORLD
    m = mpidp.fault_tolerance.Membership(comm.Get_rank(), comm.Get_size(), (),
                                         comm.Get_size(), 1, comm)
    size = 1 if comm.Get_rank() == 0 else comm.Get_size()     # each divides the job
    with pytest.raises(ValueError, match="group_size: the ranks passed different sizes"):
        mpidp.fault_tolerance.keep_whole_groups(m, size)
