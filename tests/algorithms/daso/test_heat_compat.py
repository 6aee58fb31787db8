"""Heat scripts run with only the import changed (`import mpidp as ht`):
ht.nn.DataParallel, ht.nn.DataParallelMultiGPU, ht.optim.DASO,
ht.optim.DataParallelOptimizer, ht.MPI_WORLD. The script is written the way
Heat's own examples are (tests/support/heat_style_train.py)."""

import re
import socket

import pytest

import mpidp
from mpi_jobs import run_mpi


def test_heat_names_are_mpidp_names():
    ht = mpidp
    assert ht.nn.DataParallel is mpidp.DataParallel
    assert ht.nn.DataParallelMultiGPU is mpidp.DataParallelMultiGPU
    assert ht.optim.DASO is mpidp.DASO
    assert ht.optim.DataParallelOptimizer is mpidp.DataParallelOptimizer
    world = ht.MPI_WORLD
    assert (world.rank, world.size) == (mpidp.MPI.COMM_WORLD.Get_rank(), mpidp.MPI.COMM_WORLD.Get_size())
    assert world.handle is mpidp.MPI.COMM_WORLD
    assert world.allreduce(1) == world.size       # anything else is mpi4py's
    with pytest.raises(TypeError, match="handle: expected an mpi4py intra-communicator"):
        ht.MPICommunication(3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.serial
@pytest.mark.parametrize("method,extra", [("dp", []), ("daso", []), ("daso", ["--node-local-group"])],
                         ids=["data_parallel", "daso", "daso_heat_node_group"])
def test_a_heat_style_script_trains_on_4_ranks_as_2_nodes(method, extra):
    rc, out, _ = run_mpi(4, ["tests/support/heat_style_train.py", method, *extra], timeout=300,
                         MPIDP_RANKS_PER_NODE="2", RANKS_PER_NODE="2", MASTER_ADDR="127.0.0.1",
                         BASE_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
    assert rc == 0, out
    lines = re.findall(r"rank (\d): accuracy ([\d.]+) digest (\d+)", out)
    assert len(lines) == 4, out
    assert len({digest for _, _, digest in lines}) == 1, out   # every rank holds the same model
    assert all(float(acc) >= 0.85 for _, acc, _ in lines), out
