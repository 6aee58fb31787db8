"""A float64 simulation of DiLoCo with eager outer updates over R replicas,
written from the rule in docs/algorithms.md (NumPy): the reference of
tests/algorithms/replicas/test_eager_diloco.py and of eager DiLoCo's
fault-tolerance tests."""

import numpy as np


class EagerDiLoCoSim:
    """Every rank's θ_r, outer SGD momentum (torch's rule: b ← μb + g, from
    b = g; Nesterov: θ -= lr (g + μb), else lr b) and last outer gradient
    Δ_r, and the last round's mean Ḡ. round() takes every rank's replica
    (in communicator order) and returns every rank's new θ_r, each stepped
    with Ḡ + (Δ_now - Δ_last) / R."""

    def __init__(self, init, ranks, lr=0.7, momentum=0.9, nesterov=True):
        self.theta = [[np.array(t, dtype=np.float64) for t in init] for _ in range(ranks)]
        self.buf = [[None] * len(init) for _ in range(ranks)]
        self.last = [[np.zeros_like(t) for t in self.theta[0]] for _ in range(ranks)]
        self.mean = [np.zeros_like(t) for t in self.theta[0]]
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.frozen = set()      # parameter indices without an outer step

    def drop(self, rank: int) -> None:
        """A rank lost: its θ, momentum and Δ leave with it, and the last
        round's mean is taken again over the survivors."""
        del self.theta[rank], self.buf[rank], self.last[rank]
        n = len(self.last)
        self.mean = [sum(d[i] for d in self.last) / n for i in range(len(self.mean))]

    def leave(self, rank: int) -> None:
        """A rank a resumed job goes on without: its θ, momentum and Δ leave
        with it; the saved mean stays (its all-reduce completed before the
        checkpoint)."""
        del self.theta[rank], self.buf[rank], self.last[rank]

    def join(self) -> None:
        """A replacement (recover(replace=True)): rank 0's θ and momentum, no
        Δ of its own (the mean stays over the ranks that had one)."""
        self.theta.append([t.copy() for t in self.theta[0]])
        self.buf.append([None if b is None else b.copy() for b in self.buf[0]])
        self.last.append([np.zeros_like(t) for t in self.theta[0]])

    def round(self, replicas, number=None):
        """number: the sync's (unused: NoLoCoSim.round's signature)."""
        n = len(replicas)
        now = [[t - x for t, x in zip(self.theta[r], replicas[r])] for r in range(n)]
        for r in range(n):
            for i in range(len(self.mean)):
                if i in self.frozen:
                    continue
                g = self.mean[i] + (now[r][i] - self.last[r][i]) / n
                b = self.buf[r][i]
                self.buf[r][i] = b = g.copy() if b is None else self.momentum * b + g
                step = g + self.momentum * b if self.nesterov else b
                self.theta[r][i] = self.theta[r][i] - self.lr * step
        self.mean = [sum(d[i] for d in now) / n for i in range(len(self.mean))]
        self.last = now
        return self.theta
