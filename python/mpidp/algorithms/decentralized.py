"""Bagua's decentralized algorithms on mpidp's engines (mpidp.algorithms):
DecentralizedAlgorithm and LowPrecisionDecentralizedAlgorithm.

Every rank keeps its own model; instead of averaging gradients, ranks
average weights with peers (the core's peer graphs and peer exchange, or
the allreduce for "all"), so the replicas stay close without ever being
equal. With hierarchical=True (the default, as Bagua's) the workers are the
nodes: the node's ranks first take their node's mean (a reduce-scatter: each
local rank holds a slice), each local rank runs the algorithm on its slice
with its counterparts on the other nodes, and the node gathers the slices
back -- so a node's ranks hold one replica and each carries 1/L of the
inter-node bytes. Where that cannot help (one rank per node, one node) it
warns and every rank is a worker.

DecentralizedAlgorithm (D-PSGD): at the forward pre-hook of every
communication_interval-th training forward the weights are sent; when that
backward ends they are replaced by the average -- over all workers
("all") or with this step's shift_one partner, (x_i + x_p) / 2 -- so the
optimizer's step applies the gradient taken at the old weights to the
averaged ones: x_i <- W x - lr grad f_i(x_i).

LowPrecisionDecentralizedAlgorithm (DCD-PSGD on a ring): after every
communication_interval-th optimizer step, with x^_l, x^_i, x^_r this
worker's copies of its left neighbour's, its own and its right neighbour's
weights as the neighbours know them,
    d = x_i - x^_i + (x^_l + x^_i + x^_r) / 3 - x^_i,
the 8-bit quantized Q(d) goes to both neighbours, x^_i += Q(d), x_i = x^_i,
and the neighbours' Q(d_l), Q(d_r) update x^_l, x^_r. Everyone decodes the
same bytes, so a worker's copy held by its neighbours stays bit for bit its
own (3x the model's memory).

Fault-tolerant mode: an exchange is agreed by every rank before any takes
its result, so one a rank's death interrupted is taken by none. recover()
rebuilds the workers over the survivors (flat, with a warning, where the
nodes became uneven): DecentralizedAlgorithm redoes the interrupted step's
exchange with the survivors' graph (with an odd number of workers,
shift_one leaves out, in each round, the worker paired with the missing
one: it keeps its weights, so no survivor's weight is lost);
LowPrecisionDecentralizedAlgorithm takes its new neighbours' copies exact
(x^ of every worker restarts from its weights, sent in float32 once) and
redoes the interrupted exchange on the survivors' ring.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict

import torch

from .. import _C
from ..primitives import kernels
from .._engines import module_hooks
from .bagua.algorithm import Algorithm
from .._runtime.args import check_bool, check_choice, check_int
from .._runtime.model_consistency import check_every, check_in_sync, check_same_step, ranks_named
from .driver import Driver
from .._runtime.mpi import communicator, resolve_comm
from .._runtime.flat_buffers import flatten, write_back
from .._runtime.hook_handles import remove_handles
from .._runtime.model_checks import float32_cpu_trainable
from ..collectives.tensors import allgather, allreduce_agreed, reduce_scatter_agreed
from .._runtime import fault_tolerant_mode
from .._runtime.topology import nodes_are_even, useful_hierarchy

__all__ = ["DecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithm"]


class _Workers:
    """Who the workers are: every rank of `comm`, or (hierarchical, where it
    helps) the nodes, each local rank working on its slice of the node's mean."""

    def __init__(self, comm, hierarchical: bool, who: str):
        self.world = resolve_comm(comm)     # every rank (the MPIDP_CHECK votes)
        self.world_mpi = communicator(comm).mpi
        self.node = None
        if hierarchical:
            comms = useful_hierarchy(comm, who, "every rank is a worker", stacklevel=5)
            if comms is not None:
                self.node = comms[0]
                self.comm = resolve_comm(comms[1])
        if self.node is None:
            self.comm = resolve_comm(comm)
        self.size, self.rank = self.comm.size, self.comm.rank
        # Each worker's rank in `world`, so that MPIDP_CHECK names world ranks.
        out = torch.empty(self.size, dtype=torch.float64)
        self.comm.allgather(torch.tensor([float(self.world.rank)], dtype=torch.float64), out)
        self.world_ranks = [int(v) for v in out]

    def local_part(self, flat: torch.Tensor) -> torch.Tensor:
        """This worker's share of `flat`: all of it, or this local rank's
        slice of the node's mean."""
        return flat if self.node is None else reduce_scatter_agreed(flat, op="avg", comm=self.node)

    def whole(self, part: torch.Tensor) -> torch.Tensor:
        return part if self.node is None else allgather(part, comm=self.node)


def _workers_after_loss(survivors, hierarchical: bool, who: str) -> "_Workers":
    """The workers over the survivors: as before, or flat (with a warning)
    where the nodes now hold different numbers of ranks. Growing back: as
    the replacement's set-up makes them (the launch's size again)."""
    if hierarchical and not fault_tolerant_mode.growing() and not nodes_are_even(survivors):
        warnings.warn(f"{who}: after the loss of ranks the nodes hold different numbers of "
                      "ranks; every rank is a worker from now on", stacklevel=4)
        hierarchical = False
    return _Workers(survivors, hierarchical, who)


class _DecentralizedHandle(Driver):
    what = "DecentralizedAlgorithm"

    def __init__(self, module, optimizers, comm, hierarchical: bool, mode: str, interval: int):
        self.module, self.mode, self.interval = module, mode, interval
        self.hierarchical = hierarchical
        self.params = float32_cpu_trainable(module)
        self.workers = _Workers(comm, hierarchical, "DecentralizedAlgorithm")
        if mode == "shift_one" and self.workers.size > 1 and self.workers.size % 2:
            raise ValueError(f"peer_selection_mode: 'shift_one' pairs the workers and needs an "
                             f"even number of them, got {self.workers.size}"
                             + (" nodes" if self.workers.node is not None else " ranks"))
        self.step = 0            # training forwards so far (Bagua's train step counter)
        self.exchanges = 0       # completed exchanges
        self._check_every = check_every() if mode == "all" else 0  # "all" makes replicas equal
        self._pending = None     # (work, sent, received) of an exchange in flight
        self._queued = False
        # Fault-tolerant mode: the step whose exchange is posted and not yet
        # taken (a loss sends the loop back to it, and its forward posts it again).
        self._exchange_step = None
        self._claim(module, communicator(comm))
        self._handles = [module_hooks.register(module, "register_forward_pre_hook",
                                               self._before_forward)]
        self._handles += [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        if fault_tolerant_mode.enabled():
            # A training step is applied by the optimizer's step: it counts as committed.
            optimizer = optimizers[0] if optimizers else None
            if optimizer is None:
                raise ValueError("optimizers: in fault-tolerant mode DecentralizedAlgorithm counts "
                                 "the steps of the first optimizer; pass it to with_bagua")
            self._handles.append(optimizer.register_step_post_hook(
                lambda *_: fault_tolerant_mode.commit_step()))
        if fault_tolerant_mode.joining():      # a replacement: rank 0's step count
            self.step = self.workers.world_mpi.bcast(None, root=0)

    def _before_forward(self, _module, _inputs) -> None:
        if not (self.module.training and torch.is_grad_enabled()):
            return
        self.drain()                       # a forward without backward in between
        if self.step % self.interval == 0 and self.workers.size > 1:
            self._start()
        self.step += 1

    def _start(self) -> None:
        check_same_step(self.workers.world, self.step, "DecentralizedAlgorithm")
        sent = self.workers.local_part(flatten(self.params))
        if self.mode == "all":
            work = allreduce_agreed(sent, op="avg", comm=self.workers.comm, async_op=True)
            received = None
        else:
            t = self.step // self.interval     # the exchange's number: a new pairing each time
            size = self.workers.size
            # An odd number of workers (survivors of a loss): the worker paired
            # with the missing one keeps its weights this round.
            out, inp = _C.graph_peers(_C.GRAPH_SHIFT_ONE, size + size % 2, 1, self.workers.rank, t)
            if out[0] == size:
                # An exchange with no peer: every rank numbers its exchanges alike.
                work, received = self.workers.comm.peer_exchange(sent, (), (), ()), None
            else:
                received = torch.empty_like(sent)
                work = self.workers.comm.peer_exchange(sent, out, (received,), inp)
        self._pending = (work, sent, received)
        self._exchange_step = self.step
        self._queued = False

    def _on_grad(self, _param) -> None:
        if self._pending is not None and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.drain)

    def drain(self) -> None:
        """Complete an exchange in flight and take its average as the weights."""
        if self._pending is None:
            return
        work, sent, received = self._pending
        self._pending = None
        work.wait()
        if fault_tolerant_mode.enabled():
            fault_tolerant_mode.agree_all_alive("DecentralizedAlgorithm exchange",
                                                "no rank took its average",
                                                self.workers.world_mpi)
        self._exchange_step = None
        mixed = sent if received is None else (sent + received) * 0.5
        write_back(self.workers.whole(mixed), self.params)
        self.exchanges += 1
        if self._check_every and self.exchanges % self._check_every == 0:
            check_in_sync(self.workers.world, list(self.module.named_parameters()),
                          "DecentralizedAlgorithm", f"right after average {self.exchanges}")

    def _remove_hooks(self) -> None:
        remove_handles(self._handles)

    def _continue_on(self, survivors) -> None:
        """Fault-tolerant mode, after a rank was lost (mpidp.recover()): the
        workers are made again of the survivors; the exchange the loss
        interrupted was taken by none of them, so the loop's redo of its
        step posts it again, to the survivors' peers. Where replacements
        joined, each survivor keeps its replica (with_bagua's set-up, run
        again, gives the replacements rank 0's) and sends them the step
        count; the exchange is then redone by all."""
        self.workers = _workers_after_loss(survivors, self.hierarchical, self.what)
        self._pending, self._queued = None, False
        if self._exchange_step is not None:
            self.step, self._exchange_step = self._exchange_step, None
        self._claim(self.module, communicator(survivors))
        for p in self.params:                  # the cut-short step's, spent
            p.grad = None
        if fault_tolerant_mode.growing():
            self.workers.world_mpi.bcast(self.step, root=0)

    def _takes_replacements(self) -> bool:
        return True       # a replacement starts from rank 0's replica (_continue_on)

    def algorithm_state(self) -> Dict[str, Any]:
        return {"step": self.step}

    def load_algorithm_state(self, state: Dict[str, Any]) -> None:
        if set(state) != {"step"}:
            raise ValueError(f"state: expected the keys ['step'], got {sorted(state)}")
        self.step = check_int("state['step']", state["step"], 0)


class DecentralizedAlgorithm(Algorithm):
    """Decentralized SGD (see the module's docstring): weights averaged over
    all workers ("all") or with one partner per exchange ("shift_one"),
    every communication_interval steps.

    hierarchical: the nodes are the workers (see the module's docstring);
    peer_selection_mode: "all" or "shift_one" (an even number of workers)."""

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all",
                 communication_interval: int = 1):
        check_bool("hierarchical", hierarchical)
        check_choice("peer_selection_mode", peer_selection_mode, ("all", "shift_one"))
        check_int("communication_interval", communication_interval, 1)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval

    def attach(self, module, optimizers, comm):
        return _DecentralizedHandle(module, optimizers, comm, self.hierarchical,
                                    self.peer_selection_mode, self.communication_interval)


class _LowPrecisionHandle(Driver):
    what = "LowPrecisionDecentralizedAlgorithm"

    def __init__(self, module, optimizers, comm, hierarchical: bool, interval: int):
        self.module, self.interval, self.hierarchical = module, interval, hierarchical
        self.params = float32_cpu_trainable(module)
        self.workers = _Workers(comm, hierarchical, "LowPrecisionDecentralizedAlgorithm")
        self._find_neighbours()
        part = self.workers.local_part(flatten(self.params))
        # The copies of the left neighbour's, this worker's and the right
        # neighbour's weights: all equal to the start (with_bagua broadcast it).
        self.replicas = [part.clone(), part.clone(), part.clone()]
        self._round_open = False     # fault-tolerant mode: the hook after a step under way
        self.step = 0
        self.exchanges = 0
        self._check_every = check_every()
        self._claim(module, communicator(comm))
        self._handles = [opt.register_step_post_hook(self._after_step) for opt in optimizers]
        if fault_tolerant_mode.joining():
            # A replacement: rank 0's counts, the copies made exact over the
            # grown ring, and the exchange the loss cut short done with the
            # survivors (who took that step's optimizer step; its weights
            # are rank 0's, which took it too). As _continue_on does there.
            self.step, self.exchanges, redo = self.workers.world_mpi.bcast(None, root=0)
            self._restart_copies()
            if redo:
                self._exchange()

    def _find_neighbours(self) -> None:
        w, r = self.workers.size, self.workers.rank
        self.left, self.right = (r - 1) % w, (r + 1) % w

    def _after_step(self, _optimizer, _args, _kwargs) -> None:
        self.step += 1
        self._round_open = True
        if (self.step - 1) % self.interval == 0 and self.workers.size > 1:
            self._exchange()
        self._round_open = False
        fault_tolerant_mode.commit_step()

    def _continue_on(self, survivors) -> None:
        """Fault-tolerant mode, after a rank was lost (mpidp.recover()): the
        ring is made again of the survivors. Each worker's copy x^ restarts
        from its weights and goes, in float32, to its new neighbours (whose
        copies it had none of), so every copy is exact again; an exchange
        the loss interrupted (taken by none: it is agreed first) is then
        done on the new ring. The optimizer's step before it stands.
        Where replacements joined (with rank 0's weights, from with_bagua's
        set-up run again), they take part in both, after rank 0's counts."""
        self.workers = _workers_after_loss(survivors, self.hierarchical, self.what)
        self._find_neighbours()
        redo = self._round_open and (self.step - 1) % self.interval == 0 \
            and self.workers.size > 1
        if fault_tolerant_mode.growing():
            self.workers.world_mpi.bcast((self.step, self.exchanges, redo), root=0)
        self._restart_copies()
        self._claim(self.module, communicator(survivors))
        if self._round_open:
            if redo:
                self._exchange()
            self._round_open = False
            fault_tolerant_mode.commit_step()
        for p in self.params:                  # the cut-short step's, spent
            p.grad = None

    def _restart_copies(self) -> None:
        """Every copy x^ exact again: each worker's from its weights, sent in
        float32 to its neighbours."""
        own = self.workers.local_part(flatten(self.params)).clone()
        left, right = own.clone(), own.clone()
        if self.workers.size > 1:
            peers = (self.left,) if self.left == self.right else (self.left, self.right)
            received = (left,) if len(peers) == 1 else (left, right)
            self.workers.comm.peer_exchange(own, peers, received, peers).wait()
            if len(peers) == 1:
                right.copy_(left)
        self.replicas = [left, own, right]

    def _takes_replacements(self) -> bool:
        return True       # from rank 0's weights, every copy exact again (_continue_on)

    def _exchange(self) -> None:
        check_same_step(self.workers.world, self.step, "LowPrecisionDecentralizedAlgorithm")
        left, own, right = self.replicas
        x = self.workers.local_part(flatten(self.params))
        d = x - own + (left + own + right) / 3 - own
        q = torch.empty(kernels.quant8_bytes(d.numel()), dtype=torch.uint8)
        kernels.quantize8(q, d)
        peers = (self.left,) if self.left == self.right else (self.left, self.right)
        received = tuple(torch.empty_like(q) for _ in peers)
        self.workers.comm.peer_exchange(q, peers, received, peers).wait()
        if fault_tolerant_mode.enabled():
            fault_tolerant_mode.agree_all_alive("LowPrecisionDecentralizedAlgorithm exchange",
                                                "no rank took it", self.workers.world_mpi)
        kernels.dequantize8(own, q, accumulate=True)
        kernels.dequantize8(left, received[0], accumulate=True)
        kernels.dequantize8(right, received[-1], accumulate=True)
        write_back(self.workers.whole(own), self.params)
        self.exchanges += 1
        if self._check_every and self.exchanges % self._check_every == 0:
            self._check_copies(peers)

    def _check_copies(self, peers) -> None:
        """MPIDP_CHECK: each neighbour's copy of this worker's weights is this
        worker's own, bit for bit (their checksums, exchanged)."""
        mine = torch.tensor([s - (1 << 64) if s >= (1 << 63) else s
                             for s in _C.checksums(self.replicas)], dtype=torch.int64)
        theirs = tuple(torch.empty_like(mine) for _ in peers)
        self.workers.comm.peer_exchange(mine, peers, theirs, peers).wait()
        # Name the owner of any copy that differs from the owner's own weights:
        # the left neighbour's right copy and the right neighbour's left copy
        # are copies of mine; my left and right copies are copies of theirs.
        owners = set()
        if theirs[0][2] != mine[1] or theirs[-1][0] != mine[1]:
            owners.add(self.workers.rank)
        if theirs[0][1] != mine[0]:
            owners.add(self.left)
        if theirs[-1][1] != mine[2]:
            owners.add(self.right)
        flagged = ranks_named(self.workers.world, [self.workers.world_ranks[r] for r in owners])
        if flagged:
            raise RuntimeError("LowPrecisionDecentralizedAlgorithm: the neighbours' copies of the "
                               f"weights of rank(s) {flagged} differ from their own after "
                               f"exchange {self.exchanges} (MPIDP_CHECK)")

    def drain(self) -> None:
        pass                                   # every exchange completes in its step

    def _remove_hooks(self) -> None:
        remove_handles(self._handles)

    def algorithm_state(self) -> Dict[str, Any]:
        return {"step": self.step, "replicas": [t.clone() for t in self.replicas]}

    def load_algorithm_state(self, state: Dict[str, Any]) -> None:
        if set(state) != {"step", "replicas"}:
            raise ValueError(f"state: expected the keys ['replicas', 'step'], got {sorted(state)}")
        replicas = state["replicas"]
        if len(replicas) != 3 or any(t.shape != self.replicas[0].shape for t in replicas):
            raise ValueError("state: its replicas do not match this worker's (another model, "
                             "world or node layout?)")
        self.step = check_int("state['step']", state["step"], 0)
        self.replicas = [t.clone() for t in replicas]


class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Decentralized SGD on a ring with 8-bit compressed differences (see the
    module's docstring), every communication_interval optimizer steps.

    hierarchical: the nodes are the workers (see the module's docstring)."""

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1):
        check_bool("hierarchical", hierarchical)
        check_int("communication_interval", communication_interval, 1)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval

    def attach(self, module, optimizers, comm):
        return _LowPrecisionHandle(module, optimizers, comm, self.hierarchical,
                                   self.communication_interval)
