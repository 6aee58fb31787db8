"""NoLoCo over MPI (arXiv 2506.10911; the rule of the authors' code): DiLoCo
with no all-reduce at all. Every `sync_every` inner steps the ranks split
into groups at random -- a permutation of the ranks drawn from `seed` and
the sync's number, dealt round-robin into size // group_size groups, so
that a group has group_size ranks, or one more where the size does not
divide (the remainder goes one rank to a group) -- and each rank takes the mean of its group's replicas x̄_g
through the core's peer exchange, one message to each peer of its group.

Every rank keeps its own outer weights θ_r (no two need agree) and outer
optimizer. Its outer gradient is θ_r - x̄_g, and the outer optimizer steps
θ_r with it; the replica restarts from θ_r. With torch's SGD(lr=α,
momentum=β), m ← β m + α (x̄_g - θ_r), θ_r ← θ_r + m: the authors' step,
whose two group means (of x - θ and of θ) add up to x̄_g - θ_r, sent here as
one mean of x (half their bytes). Their configurations: groups of 2,
α = 0.7, β = 0.5.

The rest is DiLoCo's (diloco.py): the inner steps, the settings checked at
set-up and at every sync, checkpoints (θ_r is this rank's own; resume at
more ranks with load_shared_state), and fault tolerance: a sync is agreed
before any rank applies it; one a loss interrupted is done again over the
survivors, grouped by the survivors' own draw; where replacements join,
each survivor keeps its θ_r and a replacement starts from rank 0's.
Buffers (BatchNorm's statistics) stay each replica's own."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from .._runtime.args import check_int
from .._runtime.flat_buffers import flatten, write_back
from .driver import set_up
from .diloco import DiLoCo
from .rank_theta import RankTheta

__all__ = ["NoLoCo"]

# The core's peer exchange reaches at most 64 peers; a group holds up to
# 2 * group_size - 1 ranks.
_MAX_GROUP_SIZE = 32


def groups_of(size: int, group_size: int, seed: int, number: int) -> List[List[int]]:
    """The groups of sync `number` (0, 1, ...) over ranks 0 .. size-1, each
    in ascending rank order: a permutation drawn by torch.randperm from a
    generator seeded with seed + number, its i-th rank in group
    i mod max(1, size // group_size)."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + number)).tolist()
    n = max(1, size // group_size)
    return [sorted(order[j::n]) for j in range(n)]


class _GroupSync(RankTheta):
    """NoLoCo's counterpart of the core's ParamSync (the calls DiLoCo makes
    of it): this rank's θ_r, and the exchange of its replica with its group."""

    def __init__(self, comm, params: Sequence[torch.Tensor]):
        super().__init__(params)
        self._comm = comm
        self.members: Optional[List[int]] = None    # the group of the next send()
        self._work = None
        self._waited = False
        # The flat replica sent and the peers' copies: kept from sync to
        # sync (a group is group_size ranks or one more, so the receive
        # buffers change only in number).
        self._sent = torch.empty(sum(p.numel() for p in self._params), dtype=torch.float32)
        self._buffers: List[torch.Tensor] = []
        self._received: tuple = ()
        self._peers: tuple = ()

    @property
    def pending(self) -> bool:
        return self._work is not None and not self._waited

    def send(self) -> None:
        """Posts the exchange of the replica with the other members of
        `members` (every rank of the communicator posts one)."""
        me = self._comm.rank
        flatten([p.detach() for p in self._params], out=self._sent)
        self._peers = tuple(m for m in self.members if m != me)
        while len(self._buffers) < len(self._peers):
            self._buffers.append(torch.empty_like(self._sent))
        self._received = tuple(self._buffers[:len(self._peers)])
        self._work = self._comm.peer_exchange(self._sent, self._peers, self._received,
                                              self._peers)
        self._waited = False

    def test(self) -> None:
        if self.pending:
            self._work.is_completed()

    def wait(self) -> None:
        if self.pending:
            self._work.wait()
            self._waited = True

    def abandon(self) -> None:
        """Forgets an exchange whose requests recover() ended."""
        self._work, self._waited = None, False

    def outer_gradient(self) -> List[torch.Tensor]:
        """θ_r - the group's mean replica, the members added in rank order
        (so that every member computes the same mean)."""
        self.wait()
        me = self._comm.rank
        total = torch.zeros_like(self._sent)
        for m in self.members:
            total += self._sent if m == me else self._received[self._peers.index(m)]
        total /= len(self.members)
        grads = [torch.empty_like(p) for p in self._params]
        write_back(total, grads)
        self._work, self._received = None, ()
        return [t - g for t, g in zip(self._theta, grads)]


class NoLoCo(DiLoCo):
    """with NoLoCo(model, inner_optimizer, outer_optimizer, sync_every) as noloco:
    train as usual, stepping the inner optimizer(s); the syncs happen after
    their steps (see the module's docstring for the rule).

    inner_optimizer: an optimizer or a list of them that together make one
    inner step. outer_optimizer: this rank's, holding exactly the model's
    trainable parameters (the authors': torch.optim.SGD(lr=0.7,
    momentum=0.5)). group_size: the ranks that average together at a sync
    (2: pairs). seed: the draw of the groups, the same on every rank.
    comm: an mpi4py communicator (None: every rank)."""

    what = "NoLoCo"
    _theta_per_rank = True

    def __init__(self, model: torch.nn.Module,
                 inner_optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
                 outer_optimizer: torch.optim.Optimizer, sync_every: int, comm=None, *,
                 group_size: int = 2, seed: int = 0):
        if check_int("group_size", group_size, 2) > _MAX_GROUP_SIZE:
            raise ValueError(f"group_size: expected 2 .. {_MAX_GROUP_SIZE}, got {group_size}")
        self.group_size = int(group_size)
        self.seed = check_int("seed", seed, 0)
        super().__init__(model, inner_optimizer, outer_optimizer, sync_every, comm,
                         sync_buffers=False)

    def _set_up(self, comm):
        return set_up(self.model, comm, self.what,
                      settings={"sync_every": self.sync_every, "group_size": self.group_size,
                                "seed": self.seed},
                      rebuild="Build a new NoLoCo, its outer optimizer holding the parameters "
                              "trainable now, after such a change")

    def _make_syncs(self) -> List[_GroupSync]:
        return [_GroupSync(self._comm, [p.data for p in frag]) for frag in self._fragments]

    def _send(self, f: int, step: int) -> None:
        # The groups of the sync after inner step `step`, over this
        # communicator's ranks (the survivors', in a recovery's redo).
        groups = groups_of(self._comm.size, self.group_size, self.seed, step // self.sync_every)
        self._syncs[f].members = next(g for g in groups if self._comm.rank in g)
        super()._send(f, step)

    def _outer_gradient(self, f: int) -> List[torch.Tensor]:
        if f in self._received:
            return self._received.pop(f)
        return self._syncs[f].outer_gradient()
