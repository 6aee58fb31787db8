"""The wire of the error-feedback algorithms (SparseLoCo, MuLoCo, DeMo):
each tensor's fixed-size payload at a fixed offset of a bucket, one
`MPI_Iallgather` per bucket through the core's posting path (every wait has
the process's deadline; node_gather's route instead where the communicator
spans several nodes of several ranks), and a header in front of the first
bucket that lets every rank check, from the same gathered bytes, that the
ranks are at the same step with the same settings and the same shared
weights.

The payload layout and the kernels are the core's (mpidp/efcomp.h); this
module only lays the tensors out and moves the bytes."""

from __future__ import annotations

import struct
from typing import Callable, List, Sequence, Tuple

import torch

from .. import _C
from .._runtime.model_consistency import ranks_at_steps, refuse_different_settings, settings_hash
from .node_gather import NodeRoute

# Bytes of one bucket's payloads per rank before a new bucket starts (each
# bucket's allgather is posted as soon as its payloads are written).
BUCKET_BYTES = 4 << 20
# step (int64), settings hash (uint64), checksum of the shared weights (uint64)
_HEADER = struct.Struct("<qQQ")


class TensorWire:
    """Where one tensor's payload lives: its tiling, k, and bucket and offset."""

    __slots__ = ("tiling", "ntiles", "k", "bytes", "bucket", "offset")

    def __init__(self, shape: Sequence[int], chunk: int, k_of: Callable[[int], int], bins: int):
        self.tiling = _C.ef_tiling(tuple(shape), chunk)
        rows, cols, tile_rows, tile_cols = self.tiling
        self.ntiles = (rows // tile_rows) * (cols // tile_cols)
        self.k = min(max(1, k_of(tile_rows * tile_cols)), tile_rows * tile_cols)
        self.bytes = _C.ef_payload_bytes(self.ntiles, tile_rows * tile_cols, self.k, bins)
        self.bucket = self.offset = 0


class Wire:
    """The buckets of a list of tensors over one communicator (_C.Comm;
    mpi_comm: its mpi4py communicator, whose nodes may give a shorter route
    across them. Collective over it)."""

    def __init__(self, comm, shapes: Sequence[Sequence[int]], chunk: int,
                 k_of: Callable[[int], int], bins: int, what: str, mpi_comm=None):
        self.comm = comm
        self.what = what
        self.tensors = [TensorWire(s, chunk, k_of, bins) for s in shapes]
        sizes = [_HEADER.size]
        for t in self.tensors:
            if sizes[-1] and sizes[-1] + t.bytes > BUCKET_BYTES:
                sizes.append(0)
            t.bucket, t.offset = len(sizes) - 1, sizes[-1]
            sizes[-1] += t.bytes
        self.send = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        self.gathered = [torch.zeros(comm.size * n, dtype=torch.uint8) for n in sizes]
        self.route = NodeRoute.over(mpi_comm)
        self._staged = None if self.route is None else [self.route.staging(n) for n in sizes]
        self._works: List = []      # (bucket, its work), in the order posted

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sends per exchange (payloads and header)."""
        return sum(b.numel() for b in self.send)

    def buckets_of(self, i: int) -> Tuple[torch.Tensor, int]:
        t = self.tensors[i]
        return self.send[t.bucket], t.offset

    def write_header(self, step: int, settings: Sequence[float], weights: Sequence[torch.Tensor]):
        digest = 0
        for c in _C.checksums([w.detach() for w in weights]):  # order-sensitive fold
            digest = ((digest * 0x100000001B3) ^ c) & 0xFFFFFFFFFFFFFFFF
        self._settings = list(settings)
        self.send[0][:_HEADER.size] = torch.frombuffer(
            bytearray(_HEADER.pack(step, settings_hash(list(settings)), digest)), dtype=torch.uint8)

    def post(self, bucket: int) -> None:
        """Posts the allgather of one bucket (its payloads written)."""
        if self.route is None:
            work = self.comm.allgather(self.send[bucket], self.gathered[bucket], True)
        else:
            work = self.route.post(self.send[bucket], self._staged[bucket])
        self._works.append((bucket, work))

    @property
    def in_flight(self) -> bool:
        return bool(self._works)

    def wait(self, setting_names: Sequence[str]) -> None:
        """Completes every posted allgather, then checks the gathered headers:
        every rank raises the same error when the ranks' steps, settings or
        shared weights differ."""
        works, self._works = self._works, []
        for bucket, work in works:
            if self.route is None:
                work.wait()
            else:
                self.route.finish(work, self._staged[bucket], self.gathered[bucket])
        n = self.send[0].numel()
        heads = [_HEADER.unpack(bytes(self.gathered[0][r * n:r * n + _HEADER.size].tolist()))
                 for r in range(self.comm.size)]
        steps = [h[0] for h in heads]
        if len(set(steps)) > 1:
            raise RuntimeError(
                f"{self.what}: the ranks reached this exchange at different steps "
                f"({ranks_at_steps(steps)}), so "
                "it would mix updates of different times. A step some ranks skipped (a "
                "GradScaler that found inf on some ranks only skips their optimizer's step) or a "
                "checkpoint loaded on some ranks only does this; load every rank's state, and "
                "skip a step on every rank or none")
        if len({h[1] for h in heads}) > 1:
            refuse_different_settings(self.comm, self.what,
                                      list(zip(setting_names, self._settings)))
        differ = [r for r, h in enumerate(heads) if h[2] != heads[0][2]]
        if differ:
            raise RuntimeError(
                f"{self.what}: the shared weights differ across ranks: rank(s) {differ} do not "
                "hold rank 0's. Were a model or this algorithm's state loaded on some ranks "
                "only? Load the same checkpoint on every rank (each rank its own error-feedback "
                "state)")

    def gathered_of(self, i: int) -> Tuple[torch.Tensor, int, int]:
        """(gathered bucket, offset of rank 0's payload, stride between ranks)."""
        t = self.tensors[i]
        return self.gathered[t.bucket], t.offset, self.send[t.bucket].numel()
