"""Horovod's ElasticSampler: each rank's share of the samples not yet
processed this epoch, re-split whenever the world changes."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler

from ... import _basics


class ElasticSampler(Sampler):
    """Like DistributedSampler over the current Horovod world, skipping the
    samples recorded as processed (record_batch / record_indices) since the
    epoch began; after a reset every rank gets a share of what is left.

    dataset: anything with len(); shuffle: a permutation seeded by
    seed + epoch, the same on every rank."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """A new epoch: nothing processed, a new permutation."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """The batch_idx-th batch of this rank's iteration was processed."""
        self.record_indices(self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size])

    def record_indices(self, indices) -> None:
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list:
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Split what is left of this epoch over the current world."""
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        remaining = [i for i in order if i not in self.processed_indices]
        size = _basics.size() if _basics.is_initialized() else 1
        rank = _basics.rank() if _basics.is_initialized() else 0
        self.num_replicas, self.rank = size, rank
        self.num_samples = math.ceil(len(remaining) / size) if remaining else 0
        total = self.num_samples * size
        padded = remaining + remaining[:total - len(remaining)]
        self.indices = padded[rank:total:size]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
