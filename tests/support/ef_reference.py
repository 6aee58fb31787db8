"""Float64 simulations of SparseLoCo, MuLoCo and DeMo over R replicas,
written from the rules in docs/error-feedback.md and docs/algorithms.md with
NumPy alone (no mpidp code): the references of test_sparseloco.py,
test_muloco.py and test_demo.py."""

import math

import numpy as np


def tile_side(n: int, chunk: int) -> int:
    if n <= chunk:
        return n
    return next(s for s in range(chunk, 0, -1) if n % s == 0)


def view_2d(shape):
    """(rows, cols) a tensor of `shape` is tiled as."""
    if len(shape) < 2:
        return 1, int(np.prod(shape, dtype=np.int64))
    return shape[0], int(np.prod(shape[1:], dtype=np.int64))


def tiles_of(a: np.ndarray, chunk: int):
    """(tiles as an ntiles x len array, the function that puts them back)."""
    rows, cols = view_2d(a.shape)
    tr, tc = tile_side(rows, chunk), tile_side(cols, chunk)
    shape = a.shape

    def back(t):
        return t.reshape(rows // tr, cols // tc, tr, tc).transpose(0, 2, 1, 3).reshape(shape)

    tiles = a.reshape(rows // tr, tr, cols // tc, tc).transpose(0, 2, 1, 3).reshape(-1, tr * tc)
    return tiles, back, (tr, tc)


def top_k_mask(tiles: np.ndarray, k: int) -> np.ndarray:
    """True at each tile's k largest magnitudes (the lower slot on a tie)."""
    mask = np.zeros(tiles.shape, dtype=bool)
    slots = np.arange(tiles.shape[1])
    for i, tile in enumerate(tiles):
        order = np.lexsort((slots, -np.abs(tile)))
        mask[i, order[:k]] = True
    return mask


def quantize(values: np.ndarray, bins: int, spread: float) -> np.ndarray:
    """What the statistical quantizer's codes decode to."""
    n = values.size
    mu = values.mean() if n else 0.0
    c = values - mu
    sigma = math.sqrt((c * c).sum() / (n - 1)) if n > 1 else 0.0
    step = spread * sigma / bins
    if not step > 0 or not math.isfinite(step):
        step = 1.0
    q = np.clip(np.rint(c / step + bins / 2), 0, bins - 1).astype(int)
    lookup = np.array([c[q == b].mean() if (q == b).any() else 0.0 for b in range(bins)])
    return lookup[q] + mu


def sparse_mean(sent, mean_over_all: bool) -> np.ndarray:
    """sent: per rank (values, mask) of the same shape."""
    total = sum(np.where(m, v, 0.0) for v, m in sent)
    if mean_over_all:
        return total / len(sent)
    count = sum(m.astype(np.int64) for _, m in sent)
    return np.where(count > 0, total / np.maximum(count, 1), 0.0)


class SparseLoCoSim:
    """θ̃ and every rank's error-feedback buffer; round() takes every rank's
    replica and returns the new θ̃ (the replicas restart from it)."""

    def __init__(self, shared, ranks, lr=1.0, error_decay=0.95, top_k=128, chunk_size=64,
                 bins=4, spread=6.0, weight_decay=0.0, mean="chosen"):
        self.shared = [np.array(t, dtype=np.float64) for t in shared]
        self.error = [[np.zeros_like(t) for t in self.shared] for _ in range(ranks)]
        self.lr, self.beta, self.bins, self.spread = lr, error_decay, bins, spread
        self.top_k, self.chunk, self.wd, self.mean = top_k, chunk_size, weight_decay, mean

    def k_of(self, length: int) -> int:
        return min(max(1, round(length * self.top_k / self.chunk ** 2)), length)

    def round(self, replicas, frozen=()):
        """frozen: indices of parameters that take no outer step (θ̃ and their
        error buffers stay; the replicas restart from θ̃)."""
        new = []
        for i, theta in enumerate(self.shared):
            if i in frozen:
                new.append(theta)
                continue
            sent = []
            for r, replica in enumerate(replicas):
                e = self.beta * self.error[r][i] + self.lr * (theta - replica[i])
                tiles, back, _ = tiles_of(e, self.chunk)
                mask = top_k_mask(tiles, self.k_of(tiles.shape[1]))
                values = tiles.copy()
                if self.bins:
                    values[mask] = quantize(tiles[mask], self.bins, self.spread)
                self.error[r][i] = back(np.where(mask, tiles - values, tiles))
                sent.append((back(values), back(mask)))
            new.append(self.outer_step(i, theta, sparse_mean(sent, self.mean == "all")))
        self.shared = new
        return new

    def outer_step(self, i, theta, g):
        """θ̃ of parameter i after the sync whose mean is g."""
        return theta * (1 - self.lr * self.wd) - self.lr * g


class MuLoCoSim(SparseLoCoSim):
    """MuLoCo (docs/algorithms.md): SparseLoCo's compression -- of every
    entry where top_k is None -- with e ← βe + lrΔ (lr: the outer SGD's),
    the mean over every rank, and an outer SGD step with momentum (torch's
    rule: b ← μb + g, from b = g; Nesterov: θ̃ -= lr (g + μb), else lr b)."""

    def __init__(self, shared, ranks, lr=0.8, momentum=0.9, nesterov=True, error_decay=0.9,
                 top_k=None, chunk_size=64, bins=4, spread=6.0):
        super().__init__(shared, ranks, lr=lr, error_decay=error_decay, top_k=top_k or 1,
                         chunk_size=chunk_size, bins=bins, spread=spread, mean="all")
        self.dense, self.momentum, self.nesterov = top_k is None, momentum, nesterov
        self.buf = [None] * len(self.shared)

    def k_of(self, length: int) -> int:
        return length if self.dense else super().k_of(length)

    def outer_step(self, i, theta, g):
        b = self.buf[i]
        self.buf[i] = b = g.copy() if b is None else self.momentum * b + g
        return theta - self.lr * (g + self.momentum * b if self.nesterov else b)


def dct_basis(s: int) -> np.ndarray:
    j, q = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
    a = np.where(q == 0, math.sqrt(1 / s), math.sqrt(2 / s))
    return a * np.cos(np.pi * (2 * j + 1) * q / (2 * s))


class DeMoSim:
    """Every rank's momentum; step() takes the shared parameters and every
    rank's gradients (None: zero) and returns the new parameters."""

    def __init__(self, params, ranks, topk=32, chunk=64, decay=0.999):
        self.delta = [[np.zeros(np.shape(p)) for p in params] for _ in range(ranks)]
        self.topk, self.chunk, self.decay = topk, chunk, decay

    def _transform(self, tiles, sides, inverse):
        fr, fc = dct_basis(sides[0]), dct_basis(sides[1])
        t = tiles.reshape(-1, *sides)
        out = fr @ t @ fc.T if inverse else fr.T @ t @ fc
        return out.reshape(tiles.shape)

    def step(self, params, grads, lr, weight_decay=0.0, frozen=()):
        """frozen: indices of parameters left as they are (momentum too)."""
        new = []
        for i, p in enumerate(params):
            if i in frozen:
                new.append(np.array(p, dtype=np.float64))
                continue
            p = np.array(p, dtype=np.float64) * (1 - lr * weight_decay)
            sent = []
            for r in range(len(grads)):
                g = grads[r][i]
                d = self.decay * self.delta[r][i] + lr * (0.0 if g is None else g)
                tiles, back, sides = tiles_of(d, self.chunk)
                x = self._transform(tiles, sides, False)
                mask = top_k_mask(x, min(self.topk, x.shape[1]))
                kept = np.where(mask, x, 0.0)
                self.delta[r][i] = back(tiles - self._transform(kept, sides, True))
                sent.append((kept, mask))
            q_tiles = self._transform(sparse_mean(sent, False), sides, True)
            new.append(p - lr * np.sign(back(q_tiles)))
        return new
