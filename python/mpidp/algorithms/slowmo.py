"""SlowMo over MPI, with fairscale's names and semantics (LocalSGD or SGP base).

Within a node the ranks average gradients every backward (mpidp.DataParallel
on the node's communicator), so a node's ranks hold one replica. Every
`localsgd_frequency` steps the nodes average their replicas; every
`slowmo_frequency` steps the slow momentum step runs, with γ the parameter
group's lr, α = slowmo_lr and β = slowmo_momentum::

    u ← β u + (θ - x̄) / γ,    θ ← θ - α γ u,    x ← θ

(for constant γ, torch's SGD(lr=α, momentum=β) on the gradient θ - x̄). With
slowmo_memory_efficient, θ and u are sharded over min(world, slowmo_num_shards)
ranks: each shard owner receives its shard of the parameters' world mean
(a reduce-scatter with a count per rank), steps it, and the shards are
gathered back (an allgatherv); that mean replaces the
LocalSGD average on steps where both fall, as in fairscale. When to do what
is the core's averaging schedule (mpidp/averaging_schedule.h).

With the SGP base (stochastic gradient push) the nodes do not average: after
every step each node's master mixes its replica with its in-peers' of a
gossip graph (mpidp.gossip; the core's peer graphs and peer exchange),
x <- w (x + sum of the in-peers' x), w = 1 / (peers + 1), and the node's
ranks take the result.

In fault-tolerant mode (LOCALSGD base over the whole job) each
perform_slowmo is a transaction: the averages and the slow step are
computed into buffers, every rank agrees that every rank lived through
them, and only then are they applied; one a rank's death cut short is done
again over the survivors by recover() (_continue_on). θ and u are kept
whole on every rank there (a shard would die with its owner)."""

from __future__ import annotations

import collections
import enum
import functools
import warnings
import weakref
from typing import Any, Dict, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _C
from .._runtime import fault_tolerant_mode
from .._runtime.args import check_bool, check_int, check_real
from .._runtime.model_consistency import check_same_step, param_group_settings
from .driver import Driver
from .._runtime.mpi import MPI, communicator, revocable
from .._runtime.flat_buffers import flatten, write_back
from .._runtime.state_broadcast import broadcast_buffers, broadcast_tensors
from ..collectives.means import mean_over_ranks
from ..collectives.model_state import broadcast_optimizer_state
from .data_parallel import DataParallel
from ..primitives.gossip import (DynamicDirectedExponentialGraph, GraphManager, MixingManager,
                               UniformMixing, mix)
from .._runtime.topology import topology
from .driver import reduce_wrapper

__all__ = ["SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel"]

_REBUILD = "Build mpidp.SlowMoDistributedDataParallel(model, ...) again after such a change"


class SlowMoBaseAlgorithm(str, enum.Enum):
    """SlowMo's base algorithm (fairscale's names): LOCALSGD averages the
    nodes' parameters every localsgd_frequency steps; SGP gossips them
    between node masters every step (push-sum over a mpidp.gossip graph)."""

    LOCALSGD = "localsgd"
    SGP = "sgp"


class SlowMoDistributedDataParallel(torch.nn.Module, Driver):
    """model = SlowMoDistributedDataParallel(module); after each
    optimizer.step(), call model.perform_slowmo(optimizer).

    nprocs_per_node: ranks that share a replica (consecutive blocks of the
    world; default: the real nodes, or MPIDP_RANKS_PER_NODE's). comm: an
    mpi4py communicator (None: every rank). fairscale's torch-group arguments
    (process groups, ranks, devices) have no meaning here and must stay
    None. With slowmo_base_algorithm=SGP the nodes gossip instead of
    averaging: after every step each node master mixes its replica with its
    in-peers' over `graph` (default mpidp.gossip.DynamicDirectedExponentialGraph
    over the nodes) with `mixing` (UniformMixing), push-sum weights when
    push_sum, synchronously (overlap must stay False, as fairscale asserts);
    slowmo_sgp_average_params averages exactly before each slow step.

    Parameters
    ----------
    module : torch.nn.Module
        The model (a plain module, not another wrapper).
    nprocs_per_node : int, optional
        Ranks that share a replica (see above).
    broadcast_buffers : bool
        Rank 0's buffers go to every rank before each training forward.
    slowmo_base_algorithm : SlowMoBaseAlgorithm
        LOCALSGD (average the nodes every localsgd_frequency steps) or SGP.
    slowmo_momentum : float
        β of the slow momentum (>= 0).
    slowmo_memory_efficient : bool
        Shard θ and u over the ranks (see the module's docstring).
    slowmo_frequency : int
        Steps between slow momentum steps (>= 1).
    slowmo_lr : float
        α, the slow learning rate (>= 0).
    slowmo_num_shards : int
        The most ranks the slow momentum is sharded over (>= 1).
    localsgd_frequency : int
        Steps between two averages of the nodes' replicas (LOCALSGD; >= 1).
    graph, mixing, push_sum, overlap, synch_freq, slowmo_sgp_average_params
        The SGP settings above (fairscale's names).
    use_streams, verbose, profile_mode : bool
        Accepted for fairscale's signature; CUDA streams, logging and
        profiling are not switched by them here.
    process_rank, process_world_size, global_group, master_group, local_node_group, comm_device
        fairscale's torch.distributed set-up: must stay None.
    comm : mpi4py communicator, optional (keyword only)
        The ranks that train together (None: the world).
    """

    def __init__(self, module: torch.nn.Module, nprocs_per_node: Optional[int] = None,
                 broadcast_buffers: bool = True,
                 slowmo_base_algorithm: SlowMoBaseAlgorithm = SlowMoBaseAlgorithm.LOCALSGD,
                 slowmo_momentum: float = 0.5, slowmo_memory_efficient: bool = True,
                 slowmo_frequency: int = 48, slowmo_lr: float = 1.0, slowmo_num_shards: int = 32,
                 localsgd_frequency: int = 3, graph=None, mixing=None, push_sum: bool = True,
                 overlap: bool = False, synch_freq: int = 0, use_streams: bool = True,
                 slowmo_sgp_average_params: bool = False, verbose: bool = False,
                 profile_mode: bool = False, process_rank=None, process_world_size=None,
                 global_group=None, master_group=None, local_node_group=None, comm_device=None,
                 *, comm=None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, (SlowMoDistributedDataParallel, DataParallel)):
            raise TypeError(f"module: is already a {type(module).__name__}; pass the plain module")
        if not isinstance(slowmo_base_algorithm, (SlowMoBaseAlgorithm, str)):
            raise TypeError("slowmo_base_algorithm: expected a mpidp.SlowMoBaseAlgorithm, got "
                            f"{type(slowmo_base_algorithm).__name__}")
        if slowmo_base_algorithm not in tuple(SlowMoBaseAlgorithm):
            raise ValueError("slowmo_base_algorithm: expected SlowMoBaseAlgorithm.LOCALSGD or "
                             f".SGP, got {slowmo_base_algorithm!r}")
        for name, flag in (("broadcast_buffers", broadcast_buffers),
                           ("slowmo_memory_efficient", slowmo_memory_efficient),
                           ("push_sum", push_sum), ("overlap", overlap), ("use_streams", use_streams),
                           ("slowmo_sgp_average_params", slowmo_sgp_average_params),
                           ("verbose", verbose), ("profile_mode", profile_mode)):
            check_bool(name, flag)
        check_int("synch_freq", synch_freq, 0)
        sgp = SlowMoBaseAlgorithm(slowmo_base_algorithm) is SlowMoBaseAlgorithm.SGP
        for name, value in (("process_rank", process_rank),
                            ("process_world_size", process_world_size),
                            ("global_group", global_group), ("master_group", master_group),
                            ("local_node_group", local_node_group), ("comm_device", comm_device)):
            if value is not None:
                raise ValueError(f"{name}: only used by fairscale's torch.distributed set-up; "
                                 "leave it None (pass comm= for the communicator)")
        if not sgp and (graph is not None or mixing is not None):
            raise ValueError("graph, mixing: gossip settings of the SGP base algorithm; leave "
                             "them None with LOCALSGD")
        if graph is not None and not isinstance(graph, GraphManager):
            raise TypeError(f"graph: expected an mpidp.gossip graph, got {type(graph).__name__}")
        if mixing is not None and not isinstance(mixing, MixingManager):
            raise TypeError(f"mixing: expected an mpidp.gossip mixing manager (UniformMixing), "
                            f"got {type(mixing).__name__}")
        if overlap or synch_freq:
            raise ValueError("overlap, synch_freq: SGP runs synchronously (as fairscale's "
                             "SlowMo, which asserts it); leave them at False and 0")
        check_real("slowmo_momentum", slowmo_momentum, 0.0)
        check_real("slowmo_lr", slowmo_lr, 0.0)
        self.slowmo_frequency = check_int("slowmo_frequency", slowmo_frequency, 1)
        self.slowmo_sgp_average_params = slowmo_sgp_average_params
        self.push_sum = push_sum
        self.localsgd_frequency = check_int("localsgd_frequency", localsgd_frequency, 1)
        check_int("slowmo_num_shards", slowmo_num_shards, 1)
        # Every rank starts from rank 0's parameters and buffers (set_up).
        self._setup_settings = {
            "nprocs_per_node": nprocs_per_node, "broadcast_buffers": bool(broadcast_buffers),
            "slowmo_momentum": float(slowmo_momentum), "slowmo_lr": float(slowmo_lr),
            "slowmo_memory_efficient": bool(slowmo_memory_efficient),
            "slowmo_frequency": slowmo_frequency, "slowmo_num_shards": slowmo_num_shards,
            "localsgd_frequency": localsgd_frequency, "sgp": sgp, "push_sum": push_sum,
            "slowmo_sgp_average_params": slowmo_sgp_average_params,
            "graph": None if graph is None else (type(graph).__name__, graph.peers_per_itr)}
        handle = self._set_up(module, comm, settings=self._setup_settings, rebuild=_REBUILD)
        self._world, mpi = handle.c, handle.mpi
        world, rank = self._world.size, self._world.rank
        if nprocs_per_node is not None:
            check_int("nprocs_per_node", nprocs_per_node, 1)
            if world % nprocs_per_node:
                raise ValueError(f"nprocs_per_node: {nprocs_per_node} does not divide the {world} "
                                 "ranks")
        self._one_rank_nodes = False     # fault-tolerant mode, after uneven losses
        # Fault-tolerant mode: where a replacement joined this node, the hook
        # that gives the node its first rank's optimizer state at the next
        # step (_take_place).
        self._node_state_hook = None
        joined = None
        if fault_tolerant_mode.joining():
            # A replacement: the place of a lost rank in its node, and the
            # slow state, from the survivors (_grow_to, which this matches
            # call for call).
            mpi.allgather(None)
            joined = mpi.bcast(None, root=0)
            self._take_place(joined, rank)
        else:
            self._node_id = topology(mpi).node if nprocs_per_node is None \
                else rank // nprocs_per_node
            if fault_tolerant_mode.enabled():
                # The nodes as built: the places replacements fill.
                self._layout = collections.Counter(mpi.allgather(self._node_id))
        node = self._split_nodes(mpi)
        if joined is not None and sgp:
            # A replacement gossips over the survivors' graph (_regraph's),
            # not one its script built for the rank it was spawned as.
            graph, mixing = None, None
        self.sgp = sgp and self._setup_sgp(graph, mixing, joined and joined["graph"])

        self.module = module
        self.broadcast_buffers = bool(broadcast_buffers)
        self.slowmo_momentum = float(slowmo_momentum)
        self.slowmo_lr = float(slowmo_lr)
        self.slowmo = self.slowmo_lr != 1.0 or self.slowmo_momentum != 0.0
        self.slowmo_memory_efficient = bool(slowmo_memory_efficient)
        self.slowmo_num_shards = min(world, slowmo_num_shards)
        # Shards of θ and u would die with their owners in fault-tolerant mode.
        self._sharded = self.slowmo_memory_efficient and not fault_tolerant_mode.enabled()
        self.num_updates = 0
        self._round = None   # fault-tolerant mode: the perform_slowmo under way (_continue_on)
        # Fault-tolerant mode, SGP: what a gossip round changes (the
        # parameters, the push-sum weight, the graph's round), kept from its
        # start until it is agreed, to undo it where a loss cut it short.
        self._gossip_undo = None
        self._kept_flat = None     # its parameters' copy, one buffer for every round
        self._params = [p for p in module.parameters() if p.requires_grad]
        # θ starts as the shared parameters (this rank's shard of them), u at 0.
        # fairscale copies θ after the first step instead, from each rank's own
        # replica, which leaves θ different on every node and the first step
        # out of the first slow step; the SlowMo paper starts from the shared point.
        self._theta = self._flat()[self._shard()].clone() if self.slowmo else None
        self._u = torch.zeros_like(self._theta) if self.slowmo else None
        if joined is not None:
            self._take_slow_state(joined)
        # The node's ranks average gradients every backward: one replica per node.
        self._node_dp = None
        if self.nprocs_per_node > 1:
            with self._building_parts():
                self._node_dp = DataParallel(module, comm=node, blocking_parameter_updates=True,
                                             broadcast_buffers=False)

    def _split_nodes(self, mpi) -> "MPI.Intracomm":
        """The node communicator (this rank's node: self._node_id, or itself
        alone once nodes are uneven) and the masters' one over `mpi`."""
        rank = mpi.Get_rank()
        node = revocable(mpi.Split(rank if self._one_rank_nodes else self._node_id, rank))
        self._node_mpi = node
        self.nprocs_per_node = node.Get_size()
        self.local_rank = node.Get_rank()
        self.logical_world_size = mpi.Get_size() // self.nprocs_per_node
        self._node = communicator(node).c
        masters = revocable(mpi.Split(0 if self.local_rank == 0 else 1, rank))
        self._masters = communicator(masters).c
        return node

    def _setup_sgp(self, graph: Optional[GraphManager], mixing: Optional[MixingManager],
                   survivors_graph=None) -> bool:
        """The gossip of the SGP base between the nodes' masters (ranks of the
        masters' communicator = the graph's workers); False, with fairscale's
        warning, on a single node. `survivors_graph` (a replacement): the
        class and peers per round of the graph the survivors gossip over."""
        if self.logical_world_size == 1:
            warnings.warn("SlowMoDistributedDataParallel: SGP gossips between nodes and there "
                          "is one; it is turned off (as in fairscale)", UserWarning, stacklevel=3)
            return False
        node_index = torch.tensor([self._masters.rank if self.local_rank == 0 else 0])
        broadcast_tensors([node_index], self._node)
        worker = int(node_index)
        if survivors_graph is not None:
            graph = self._graph_over(worker, *survivors_graph)
        elif graph is None:
            graph = DynamicDirectedExponentialGraph(worker, self.logical_world_size,
                                                    self.nprocs_per_node, self.local_rank)
        if graph.world_size != self.logical_world_size or graph.rank != worker:
            raise ValueError(f"graph: built for worker {graph.rank} of {graph.world_size}, but "
                             f"this rank's node is worker {worker} of {self.logical_world_size}")
        mixing = UniformMixing(graph) if mixing is None else mixing
        if mixing.graph_manager is not graph:
            raise ValueError("mixing: built over another graph than `graph`")
        if not mixing.is_uniform():
            raise ValueError("mixing: only uniform mixing is supported (mpidp.gossip.UniformMixing)")
        self.graph, self.mixing = graph, mixing
        self.ps_weight = 1.0
        return True

    # -- the driver interface (mpidp/algorithms/driver.py) ---------------------

    what = "SlowMoDistributedDataParallel"

    def drain(self) -> None:
        pass        # every average, gossip round and slow step completes in perform_slowmo

    def _remove_hooks(self) -> None:
        pass        # its hooks are its node-local DataParallel's, a part

    def algorithm_state(self) -> Dict[str, Any]:
        return self.slowmo_state_dict()

    def load_algorithm_state(self, state: Dict[str, Any]) -> None:
        self.load_slowmo_state_dict(state)

    def train_forward(self, *inputs, **kwargs):
        return self(*inputs, **kwargs)

    def __reduce_ex__(self, protocol):
        return reduce_wrapper(self, self.module)

    def forward(self, *inputs: Any, **kwargs: Any):
        self._check_attached()
        if self.training and torch.is_grad_enabled():
            self._trainable_at_setup.check()
        if self.broadcast_buffers and self.training:
            broadcast_buffers(self.module, self._world)
        runner = self._node_dp if self._node_dp is not None else self.module
        return runner(*inputs, **kwargs)

    # -- the slow momentum -----------------------------------------------------------

    def _shard_counts(self) -> tuple:
        """Elements of the flat parameters each rank owns in memory-efficient
        mode: equal shards for the first slowmo_num_shards ranks (the last
        shorter), none for the others."""
        total = sum(p.numel() for p in self._params)
        length = -(-total // self.slowmo_num_shards)
        return tuple(max(0, min((r + 1) * length, total) - min(r * length, total))
                     if r < self.slowmo_num_shards else 0 for r in range(self._world.size))

    def _shard(self) -> slice:
        """This rank's slice of the flat parameters (all of them unless
        memory-efficient outside fault-tolerant mode)."""
        if not self._sharded:
            return slice(0, sum(p.numel() for p in self._params))
        counts = self._shard_counts()
        start = sum(counts[:self._world.rank])
        return slice(start, start + counts[self._world.rank])

    def _flat(self) -> torch.Tensor:
        return flatten(self._params, torch.float32)

    def _keep_flat(self) -> torch.Tensor:
        """The parameters flat (float32) in a buffer kept across rounds: a
        copy every gossip round, not an allocation."""
        if self._kept_flat is None:
            self._kept_flat = torch.empty(sum(p.numel() for p in self._params),
                                          dtype=torch.float32, device=self._params[0].device)
        return flatten(self._params, out=self._kept_flat)

    def _lrs(self, optimizer, part: slice) -> torch.Tensor:
        """Each element's group lr over `part` of the flat parameters (built
        for the part only: a shard in memory-efficient mode)."""
        lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
        missing = [p for p in self._params if id(p) not in lr_of]
        if missing:
            raise ValueError("optimizer: expected it to hold every trainable parameter of the "
                             f"module ({len(missing)} missing)")
        pieces, offset = [], 0
        for p in self._params:
            lo, hi = max(offset, part.start), min(offset + p.numel(), part.stop)
            if lo < hi:
                pieces.append(torch.full((hi - lo,), float(lr_of[id(p)])))
            offset += p.numel()
        return torch.cat(pieces) if pieces else torch.zeros(0)

    def _write(self, flat: torch.Tensor) -> None:
        write_back(flat, self._params)

    def perform_slowmo(self, optimizer: torch.optim.Optimizer, fp32_params=None) -> None:
        """Call after optimizer.step(): the LocalSGD average and the slow
        momentum step when due (both counted by this call)."""
        self._check_attached()
        if fp32_params is not None:
            raise ValueError("fp32_params: fp16 master copies are not supported; keep the "
                             "parameters float32 (torch.autocast does)")
        # Fault-tolerant mode: a node-local DataParallel commits the local
        # step at its own step-end agreement; without one it counts here.
        self._slowmo_round(optimizer, commit=self._node_dp is None)

    def _slowmo_round(self, optimizer, commit: bool) -> None:
        due = _C.avgsched_actions(
            self.num_updates, periods=() if self.sgp else (self.localsgd_frequency,),
            after_period=True, slow_every=self.slowmo_frequency if self.slowmo else 0,
            slow_replaces_average=self.slowmo_memory_efficient)
        self._round = (optimizer, commit)     # done again over the survivors if cut short
        # SGP gossips every step: a rank at another step would mix another
        # step's replica into its peers' with no error, so it checks every step.
        if self.sgp or due.average or due.slow_step:
            check_same_step(self._world, self.num_updates, "SlowMoDistributedDataParallel",
                            param_group_settings(optimizer.param_groups))
        if self.sgp:
            if fault_tolerant_mode.enabled():
                self._gossip_undo = (self._keep_flat(), self.ps_weight, self.graph.round)
            self._gossip()
        replica = slow = None    # the new values, applied once complete everywhere
        if due.average:
            replica = self._averaged_replicas()
        if due.slow_step:
            if self.sgp and self.slowmo_sgp_average_params and not self.slowmo_memory_efficient:
                replica = self._averaged_replicas()      # an exact average before the slow step
            slow = self._slow_step(optimizer, replica)
            replica = slow[2]
        # (Redone inside recover(replace=True) over the survivors alone, the
        # rebuild's own agreement covers it: the job's includes the replacements.)
        if fault_tolerant_mode.enabled() and (self.sgp or due.average or due.slow_step) \
                and not fault_tolerant_mode.growing():
            fault_tolerant_mode.agree_all_alive("SlowMo's averaging", "no rank applied it",
                                                self._agreement_comm())
            self._gossip_undo = None
        if slow is not None:
            self._theta, self._u = slow[0], slow[1]
        if replica is not None:
            self._write(replica)
        self._round = None
        self.num_updates += 1
        if commit:
            fault_tolerant_mode.commit_step()

    def _averaged_replicas(self) -> torch.Tensor:
        """The nodes' mean replica, flat: node masters average over the nodes;
        each node's ranks then take their master's."""
        if self.local_rank == 0 and self.logical_world_size > 1:
            flat = mean_over_ranks(self._params, self._masters)
        elif self.local_rank == 0:
            flat = flatten(self._params)          # one node: its replica is the mean
        else:
            # Only a buffer for the master's mean, of the dtype flatten gives it.
            dtype = functools.reduce(torch.promote_types, (p.dtype for p in self._params))
            flat = torch.empty(sum(p.numel() for p in self._params), dtype=dtype,
                               device=self._params[0].device)
        if self.nprocs_per_node > 1:
            broadcast_tensors([flat], self._node)
        return flat

    def _gossip(self) -> None:
        """One SGP round between the node masters (push-sum: the weight y
        travels with the parameters, which hold x / y); each node's ranks
        then take their master's values."""
        if self.local_rank == 0:
            y = self.ps_weight
            flat = torch.cat([self._flat() * y if self.push_sum else self._flat(),
                              torch.tensor([y], dtype=torch.float32)])
            mixed = mix(flat, self.graph, self.mixing, self._masters, check=False)
            self.ps_weight = float(mixed[-1]) if self.push_sum else 1.0
            x = mixed[:-1]
            self._write(x / mixed[-1] if self.push_sum and self.ps_weight != 1.0 else x)
        else:
            self.graph.round += 1
        if self.nprocs_per_node > 1:
            broadcast_tensors([p.data for p in self._params], self._node)

    def _slow_step(self, optimizer, replica: Optional[torch.Tensor]) -> tuple:
        """The new (θ, u, replica) of a slow step from `replica` (the
        averaged replica, if an average just ran; else this rank's)."""
        part = self._shard()
        if self._sharded:
            # Each shard owner gets its shard of the world mean (a reduce-
            # scatter: half an allreduce's bytes), steps it, and every rank
            # gathers the owners' shards of θ.
            counts = self._shard_counts()
            x = torch.empty(part.stop - part.start)
            self._world.reduce_scatter(self._flat(), x, counts, _C.OP_AVG)
        elif self.slowmo_memory_efficient:
            # Fault-tolerant mode: the world mean whole, θ and u stepped whole.
            x = self._flat()
            self._world.allreduce(x, _C.OP_AVG, _C.NO_WIRE, False)
        else:
            x = self._flat() if replica is None else replica.float()
        lr = self._lrs(optimizer, part)
        u = self._u * self.slowmo_momentum + (self._theta - x) / lr
        theta = self._theta - self.slowmo_lr * lr * u
        if self._sharded:
            gathered = torch.empty(sum(counts))
            self._world.allgatherv(theta, gathered, counts)
            return theta, u, gathered
        return theta, u, theta

    # -- fault-tolerant mode (mpidp/fault_tolerance/) -----------------------------------------

    def _continue_on(self, survivors) -> None:
        """Fault-tolerant mode, after a rank was lost (mpidp.recover()): the
        survivors go on (_shrink_to); where replacements joined
        (recover(replace=True)), a perform_slowmo the loss cut short is
        first done again over the survivors alone, then the replacements
        take the lost ranks' places (_grow_to)."""
        if not fault_tolerant_mode.growing():
            self._shrink_to(survivors)
            return
        if self._round is not None:
            self._shrink_to(fault_tolerant_mode.survivors_before_growth(), quiet=True)
        self._grow_to(survivors)

    def _shrink_to(self, survivors, quiet: bool = False) -> None:
        """After a rank was lost (mpidp.recover()): the nodes are made again
        of each node's survivors -- or, where they now hold different numbers
        of ranks, every rank a node of its own from then on -- each keeps its
        replica, θ and u (whole on every rank), and a perform_slowmo the loss
        cut short (applied by none of them) is done again over the survivors.

        With the SGP base, a gossip round the loss cut short is undone first
        (it was agreed by none), the graph is made again over the surviving
        nodes (the same class, the same round), and the push-sum weights are
        renormalised: every survivor's weight becomes 1 with its parameters
        as they are (they hold x / y), so no survivor's estimate is lost and
        the survivors' weights again add up to their number."""
        if self._gossip_undo is not None:
            flat, self.ps_weight, self.graph.round = self._gossip_undo
            self._write(flat)
            self._gossip_undo = None
        handle = communicator(survivors)
        self._claim(self.module, handle)
        self._world = handle.c
        ranks_per_node = collections.Counter(survivors.allgather(self._node_id))
        if not self._one_rank_nodes and len(set(ranks_per_node.values())) > 1:
            if not quiet:       # (growing back, the nodes are made whole again at once)
                warnings.warn("SlowMoDistributedDataParallel: after the loss of ranks the nodes "
                              "hold different numbers of ranks; every rank is a node of its own "
                              "from now on (no node-local gradient averaging)", stacklevel=3)
            self._one_rank_nodes = True
        node = self._split_nodes(survivors)
        self._node_dp_over(node)
        if self.sgp:
            self._regraph()
        for p in self._params:      # the cut-short step's, spent
            p.grad = None
        if self._round is not None:
            self._slowmo_round(*self._round)

    def _node_dp_over(self, node) -> None:
        """The node-local DataParallel over `node` (the same collectives as
        its construction, which a replacement runs), or none for a node of
        one rank."""
        if self.nprocs_per_node == 1:
            if self._node_dp is not None:
                self._node_dp._remove_hooks()
                self._node_dp._released = "its SlowMo's nodes became one rank each"
                self._node_dp = None
        elif self._node_dp is not None:
            self._node_dp._continue_on(node)
        else:                   # whole nodes again (growing back)
            with self._building_parts():
                self._node_dp = DataParallel(self.module, comm=node,
                                             blocking_parameter_updates=True,
                                             broadcast_buffers=False)

    def _grow_to(self, merged) -> None:
        """recover(replace=True), on the survivors: the set-up a replacement's
        construction runs, call for call. Each survivor keeps its replica, θ,
        u and step count; each replacement takes a place a lost rank left in
        its node (the node short of the most ranks as built, the lowest
        first), so the nodes are whole again, and rank 0's θ, u and step
        count. In a node a replacement joined, the node's first rank (a
        survivor, where one is left) gives the node its replica through the
        node-local DataParallel's set-up, and its optimizer state before the
        next step (_take_place); a node of replacements only holds rank 0's
        replica, as the loop's share_state() gives them rank 0's optimizer
        state."""
        own = [p.detach().clone() for p in self._params]
        handle = self._set_up(self.module, merged, settings=self._setup_settings,
                              rebuild=_REBUILD)
        with torch.no_grad():
            for p, mine in zip(self._params, own):
                p.copy_(mine)
        self._world = handle.c
        ids = merged.allgather(self._node_id)
        state = merged.bcast(self._places_and_slow_state(ids) if merged.Get_rank() == 0 else None,
                             root=0)
        self._take_place(state, merged.Get_rank())
        node = self._split_nodes(merged)
        if self._setup_settings["sgp"]:
            if self.sgp:
                self._regraph()
            else:                       # one node was left: gossip again over the nodes
                self.sgp = self._setup_sgp(None, None)
                if self.sgp:
                    self.graph.round = state["round"]
        self._node_dp_over(node)
        for p in self._params:      # the cut-short step's, spent
            p.grad = None

    def _places_and_slow_state(self, ids) -> Dict[str, Any]:
        """On rank 0 where replacements join: each rank's node (`ids`: the
        survivors' nodes, None for a replacement) and the slow state."""
        counts = collections.Counter(i for i in ids if i is not None)
        nodes = []
        for i in ids:
            if i is None:
                i = max(sorted(self._layout), key=lambda n: self._layout[n] - counts[n])
                counts[i] += 1
            nodes.append(i)
        return {"nodes": nodes, "joined": [i is None for i in ids], "layout": self._layout,
                "one_rank_nodes": len(set(counts.values())) > 1,
                "num_updates": self.num_updates, "theta": self._theta, "u": self._u,
                "round": self.graph.round if self.sgp else 0,
                "graph": (type(self.graph), self.graph.peers_per_itr) if self.sgp else None}

    def _take_place(self, state: Dict[str, Any], rank: int) -> None:
        """This rank's node from rank 0's places. Where a replacement joined
        it (and it holds more than this rank), the node's ranks take its
        first rank's optimizer state before their next step: torch's global
        step pre-hook, as the optimizer is not known before (both step
        together, their gradients averaged within the node)."""
        self._node_id, self._layout = state["nodes"][rank], state["layout"]
        self._one_rank_nodes = state["one_rank_nodes"]
        mates = [j for n, j in zip(state["nodes"], state["joined"]) if n == self._node_id]
        if self._node_state_hook is not None:
            self._node_state_hook.remove()
            self._node_state_hook = None
        if not self._one_rank_nodes and len(mates) > 1 and any(mates):
            self._node_state_hook = register_optimizer_step_pre_hook(
                functools.partial(_give_node_optimizer_state, weakref.ref(self)))

    def _take_slow_state(self, state: Dict[str, Any]) -> None:
        """A replacement: rank 0's step count, θ, u and gossip round."""
        self.num_updates = int(state["num_updates"])
        self._theta = None if state["theta"] is None else state["theta"].clone()
        self._u = None if state["u"] is None else state["u"].clone()
        if self.sgp:
            self.graph.round = int(state["round"])

    def _takes_replacements(self) -> bool:
        return True       # _grow_to is a replacement's set-up, call for call

    def _regraph(self) -> None:
        """SGP after a loss: the user's graph class over the surviving nodes
        (or, where it cannot be built over their number, the default
        exponential graph, with a warning), at the same round; push-sum
        weights renormalised to 1; one node left: the gossip stops."""
        if self.logical_world_size == 1:
            warnings.warn("SlowMoDistributedDataParallel: one node is left after the loss of "
                          "ranks; SGP's gossip stops (as with one node from the start)",
                          stacklevel=3)
            self.sgp = False
            return
        node_index = torch.tensor([self._masters.rank if self.local_rank == 0 else 0])
        broadcast_tensors([node_index], self._node)
        old = self.graph
        graph = self._graph_over(int(node_index), type(old), old.peers_per_itr)
        graph.round = old.round
        self.graph, self.mixing = graph, UniformMixing(graph)
        self.ps_weight = 1.0

    def _graph_over(self, worker: int, kind: type, peers_per_itr: int) -> GraphManager:
        """A graph of class `kind` over the nodes now (this node: `worker`),
        after a loss or a growth; where `kind` cannot be built over their
        number, the default exponential graph, with a warning."""
        args = (worker, self.logical_world_size, self.nprocs_per_node, self.local_rank,
                min(peers_per_itr, self.logical_world_size - 1))
        try:
            return kind(*args)
        except ValueError as why:
            warnings.warn(f"SlowMoDistributedDataParallel: {kind.__name__} cannot be built "
                          f"over the {self.logical_world_size} nodes left ({why}); gossiping "
                          "over a DynamicDirectedExponentialGraph from now on", stacklevel=4)
            return DynamicDirectedExponentialGraph(*args)

    # -- checkpoints -----------------------------------------------------------------

    def slowmo_state_dict(self) -> Dict[str, Any]:
        """num_updates, this rank's replica (construction made every replica
        rank 0's, so loading restores it) and its slow parameters and momentum
        (its shard in memory-efficient mode; whole in fault-tolerant mode,
        which any world size can load). Save beside the optimizer's."""
        return {"num_updates": self.num_updates,
                "sgp": {"round": self.graph.round, "ps_weight": self.ps_weight} if self.sgp else None,
                "local": [p.detach().clone() for p in self._params],
                "theta": None if self._theta is None else self._theta.clone(),
                "u": None if self._u is None else self._u.clone()}

    def load_slowmo_state_dict(self, state: Dict[str, Any]) -> None:
        theta, u, local = state["theta"], state["u"], state["local"]
        part = self._shard()
        total = sum(p.numel() for p in self._params)
        if theta is not None and theta.shape == (total,) != (part.stop - part.start,):
            # Whole θ and u (saved in fault-tolerant mode): this rank's shard of them.
            theta, u = theta[part], u[part]
        if (theta is None) != (self._theta is None) or (
                theta is not None and theta.shape != (part.stop - part.start,)):
            raise ValueError("state: the slow buffers do not match this rank's (another world "
                             "size, slowmo_num_shards, slow momentum setting or model?)")
        if len(local) != len(self._params) or any(a.shape != p.shape
                                                  for a, p in zip(local, self._params)):
            raise ValueError("state: its parameters do not match the module's")
        with torch.no_grad():
            for p, x in zip(self._params, local):
                p.copy_(x)
        self.num_updates = int(state["num_updates"])
        sgp = state.get("sgp")
        if (sgp is None) != (not self.sgp):
            raise ValueError("state: saved with another slowmo_base_algorithm (or node count)")
        if sgp is not None:
            self.graph.round, self.ps_weight = int(sgp["round"]), float(sgp["ps_weight"])
        self._theta = None if theta is None else theta.clone()
        self._u = None if u is None else u.clone()

    @property
    def slowmo_buffer_numel(self) -> int:
        """Elements of θ and u this rank holds (2 x its shard; 0 without slow momentum)."""
        return 0 if self._theta is None else self._theta.numel() + self._u.numel()


def _give_node_optimizer_state(slowmo_ref, optimizer, _args, _kwargs) -> None:
    """torch's step pre-hook after a replacement joined a SlowMo node (see
    _take_place): the first optimizer holding the module's parameters to
    step takes the node's first rank's state, on every rank of the node."""
    slowmo = slowmo_ref()
    if slowmo is None or slowmo._node_state_hook is None:
        return
    mine = {id(p) for p in slowmo._params}
    if any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
        slowmo._node_state_hook.remove()
        slowmo._node_state_hook = None
        broadcast_optimizer_state(optimizer, root=0, comm=slowmo._node_mpi)
