"""An allgather whose payloads cross between nodes once each: the error-
feedback wire's route (ef_wire.py) where a communicator spans several nodes
with several ranks on each.

A flat MPI_Iallgather sends every rank's payload to every other rank: with
L ranks on each of M nodes, each payload crosses the link to every rank of
every other node, L (M - 1) times (Open MPI's libnbc sends it to each in
turn). Here each rank gathers first over the ranks with its local rank on
the other nodes (one per node: its payload crosses to each other node once,
M - 1 times, the floor), posted like the flat one and overlapped the same
way; at the wait the node's ranks gather those results among themselves
(shared memory) and the rows are put in the communicator's rank order. The
bytes gathered are the flat allgather's, in the same order: the algorithms
cannot tell the routes apart."""

from __future__ import annotations

from typing import Optional

import torch

from .._runtime.mpi import communicator
from .._runtime.topology import nodes_are_even, topology, useful_hierarchy


class NodeRoute:
    """The two gathers over mpi_comm's nodes (build with NodeRoute.over)."""

    def __init__(self, mpi_comm, node, across):
        self.node = communicator(node).c
        self.across = communicator(across).c
        topo = topology(mpi_comm)
        self.n_nodes = topo.n_nodes
        # The node's gather stacks its ranks in local-rank order, each with
        # one payload per node in node order: rank r's row is l * M + m.
        places = mpi_comm.allgather((topo.node, topo.local_rank))
        self.rows = torch.tensor([local * self.n_nodes + node_ for node_, local in places])

    @staticmethod
    def over(mpi_comm) -> Optional["NodeRoute"]:
        """The route over mpi_comm, or None where the flat allgather is as
        good (one node, one rank per node) or nodes hold different numbers
        of its ranks. Collective over mpi_comm."""
        if mpi_comm is None or mpi_comm.Get_size() < 4:    # no 2 nodes of 2 ranks: flat
            return None
        if not nodes_are_even(mpi_comm):
            return None
        comms = useful_hierarchy(mpi_comm, "", "", warn=False)
        return None if comms is None else NodeRoute(mpi_comm, *comms)

    def staging(self, n: int) -> torch.Tensor:
        """The buffer one bucket's cross-node gather fills (n bytes a rank)."""
        return torch.zeros(self.n_nodes * n, dtype=torch.uint8)

    def post(self, send: torch.Tensor, staged: torch.Tensor):
        """The gather across nodes of this rank's payload `send` into `staged`."""
        return self.across.allgather(send, staged, True)

    def finish(self, work, staged: torch.Tensor, gathered: torch.Tensor) -> None:
        """Waits for `work` (post's), gathers the node's staged buffers and
        writes every rank's payload into `gathered`, in rank order."""
        work.wait()
        stacked = torch.empty_like(gathered)
        self.node.allgather(staged, stacked, False)
        n = staged.numel() // self.n_nodes
        torch.index_select(stacked.view(-1, n), 0, self.rows, out=gathered.view(-1, n))
