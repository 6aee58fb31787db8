"""Collectives whose ranks pass tensors or settings that differ raise on every
rank, naming what each group of ranks passed, before anything is sent.

MPI matches a collective by order alone: a broadcast into a larger receiver
or one of another dtype used to exit 0 with the receiver's own tail or
reinterpreted bytes, and allreduce_scalar(1) beside allreduce_scalar(1.5)
summed int64 and float64 bytes. The last rank passes the odd one out; after
the error the same communicator must still give correct results."""

import re

import pytest
import torch

import mpidp
from dp_reference import RANK, SIZE

pytestmark = [pytest.mark.ranks3,
              pytest.mark.skipif(SIZE == 1, reason="one rank always agrees with itself")]

ODD = RANK == SIZE - 1
OTHERS = list(range(SIZE - 1))


def odd(mine, theirs):
    return theirs if ODD else mine


CASES = {
    "broadcast-larger-receiver": (lambda: mpidp.broadcast(torch.zeros(odd(8, 10))),
                                  "broadcast", "float32 [8], root 0", "float32 [10], root 0"),
    "broadcast-dtype": (lambda: mpidp.broadcast(torch.zeros(8, dtype=odd(torch.float32,
                                                                         torch.float64))),
                        "broadcast", "float32 [8]", "float64 [8]"),
    "broadcast-root": (lambda: mpidp.broadcast(torch.zeros(4), root=odd(0, 1)),
                       "broadcast", "root 0", "root 1"),
    "broadcast-async": (lambda: mpidp.broadcast(torch.zeros(odd(3, 2)), async_op=True).wait(),
                        "broadcast", "float32 [3]", "float32 [2]"),
    "allreduce-shape": (lambda: mpidp.allreduce(torch.zeros(odd(2, 3), 2)),
                        "allreduce", "float32 [2, 2], op sum", "float32 [3, 2], op sum"),
    "allreduce-transposed": (lambda: mpidp.allreduce(torch.zeros(odd((2, 3), (3, 2)))),
                             "allreduce", "[2, 3]", "[3, 2]"),
    "allreduce-op": (lambda: mpidp.allreduce(torch.zeros(4), op=odd("sum", "avg")),
                     "allreduce", "op sum", "op avg"),
    "allreduce-wire": (lambda: mpidp.allreduce(torch.zeros(4), wire_dtype=odd(None,
                                                                             torch.bfloat16)),
                       "allreduce", "wire none", "wire bfloat16"),
    "allreduce-async": (lambda: mpidp.allreduce(torch.zeros(odd(4, 5)), async_op=True).wait(),
                        "allreduce", "[4]", "[5]"),
    "allreduce_scalar-int-and-float": (lambda: mpidp.allreduce_scalar(odd(1, 1.5), op="sum"),
                                       "allreduce", "int64 [1]", "float64 [1]"),
    "allgather-trailing": (lambda: mpidp.allgather(torch.zeros(2, odd(3, 4))),
                           "allgather", "float32 [*, 3]", "float32 [*, 4]"),
    "allgather-dtype": (lambda: mpidp.allgather(torch.zeros(2, dtype=odd(torch.int32,
                                                                        torch.int64))),
                        "allgather", "int32 [*]", "int64 [*]"),
    "reduce_scatter-shape": (lambda: mpidp.reduce_scatter(torch.zeros(odd(2, 3) * SIZE)),
                             "reduce_scatter", f"[{2 * SIZE}]", f"[{3 * SIZE}]"),
    "reduce_scatter-counts": (lambda: mpidp.reduce_scatter(
        torch.zeros(2 * SIZE), counts=odd([2] * SIZE, [4] + [2] * (SIZE - 2) + [0])),
        "reduce_scatter", "layout #", "layout #"),
    "broadcast_parameters": (lambda: mpidp.broadcast_parameters(
        torch.nn.Linear(3, odd(2, 4))), "broadcast_parameters", "root 0", "root 0"),
    "different-calls": (lambda: (mpidp.allreduce(torch.zeros(4)) if not ODD
                                 else mpidp.broadcast(torch.zeros(4))),
                        "", "allreduce of float32 [4]", "broadcast of float32 [4]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_raises_naming_both_and_the_communicator_goes_on(case):
    call, call_name, mine, theirs = CASES[case]
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert f"mpidp.{call_name}" in message or not call_name, message
    assert re.search(rf"rank\(s\) \[{', '.join(map(str, OTHERS))}\]: [^;]*{re.escape(mine)}",
                     message), message
    assert re.search(rf"rank\(s\) \[{SIZE - 1}\]: [^;]*{re.escape(theirs)}", message), message
    t = torch.full((5,), float(RANK + 1))
    mpidp.allreduce(t)
    assert torch.equal(t, torch.full((5,), SIZE * (SIZE + 1) / 2))


def test_gossip_mix_refuses_workers_with_other_shapes():
    comm = mpidp._runtime.mpi.world()
    graph = mpidp.gossip.RingGraph(RANK, SIZE)
    with pytest.raises(ValueError, match=rf"mpidp.gossip.mix: .*rank\(s\) \[{SIZE - 1}\]: "
                                         r"gossip.mix of float32 \[3\]"):
        mpidp.gossip.mix(torch.zeros(odd(2, 3)), graph, mpidp.gossip.UniformMixing(graph), comm)


def test_agreeing_ranks_get_the_collectives_results():
    """The check does not change a result: every collective above on
    matching tensors, against the values computed from every rank's data."""
    x = torch.arange(4.0) + RANK
    mpidp.allreduce(x, op="avg")
    assert torch.equal(x, torch.arange(4.0) + (SIZE - 1) / 2)
    b = torch.full((3,), float(RANK))
    assert torch.equal(mpidp.broadcast(b, root=SIZE - 1), torch.full((3,), float(SIZE - 1)))
    assert mpidp.allreduce_scalar(RANK + 1, op="sum") == SIZE * (SIZE + 1) // 2
    block = mpidp.reduce_scatter(torch.ones(2 * SIZE))
    assert torch.equal(block, torch.full((2,), float(SIZE)))
