"""A float64 simulation of NoLoCo over R replicas, written from the rule in
docs/algorithms.md (NumPy; torch only for the groups' draw, which the rule
defines as torch.randperm from a seeded generator): the reference of
tests/algorithms/replicas/test_noloco.py and of NoLoCo's fault-tolerance
tests."""

import numpy as np
import torch


class NoLoCoSim:
    """Every rank's outer weights θ_r and outer SGD momentum (torch's rule:
    b ← μb + g, from b = g; Nesterov: θ -= lr (g + μb), else lr b); round()
    takes every rank's replica (in communicator order) and returns every
    rank's new θ_r (each replica restarts from its own)."""

    def __init__(self, init, ranks, lr=0.7, momentum=0.5, nesterov=False, group_size=2, seed=0):
        self.theta = [[np.array(t, dtype=np.float64) for t in init] for _ in range(ranks)]
        self.buf = [[None] * len(init) for _ in range(ranks)]
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.group_size, self.seed = group_size, seed

    def groups(self, ranks: int, number: int):
        """Sync `number`'s groups: the permutation's i-th rank in group
        i mod max(1, ranks // group_size)."""
        order = torch.randperm(ranks, generator=torch.Generator().manual_seed(self.seed + number))
        n = max(1, ranks // self.group_size)
        return [sorted(order.tolist()[j::n]) for j in range(n)]

    def drop(self, rank: int) -> None:
        """A rank lost: its θ and momentum leave with it."""
        del self.theta[rank], self.buf[rank]

    leave = drop      # a rank a resumed job goes on without

    def join(self) -> None:
        """A replacement (recover(replace=True)): rank 0's θ and momentum."""
        self.theta.append([t.copy() for t in self.theta[0]])
        self.buf.append([None if b is None else b.copy() for b in self.buf[0]])

    def round(self, replicas, number: int):
        for group in self.groups(len(replicas), number):
            means = [sum(replicas[m][i] for m in group) / len(group)
                     for i in range(len(self.theta[0]))]
            for r in group:
                for i, mean in enumerate(means):
                    g = self.theta[r][i] - mean
                    b = self.buf[r][i]
                    self.buf[r][i] = b = g.copy() if b is None else self.momentum * b + g
                    step = g + self.momentum * b if self.nesterov else b
                    self.theta[r][i] = self.theta[r][i] - self.lr * step
        return self.theta
