"""Checks that the ranks train the same model.

check_same_structure(): at construction, every rank compares a fingerprint of
the settings that must match (wire dtype, bucket caps, mode, DASO's schedule,
MPIDP_CHECK) and of its parameter list (count, names, shapes, dtypes, device
kinds, which are trainable) with rank 0's. A mismatch raises the same clear
error on every rank, naming the first differing setting or parameter and the
ranks concerned, instead of a hang, an MPI_ERR_TRUNCATE or a job that
quietly trains different models.

check_in_sync(): with MPIDP_CHECK=1, every MPIDP_CHECK_EVERY steps (default
100) the parameters are compared bit for bit across ranks through 64-bit
checksums, and drift raises an error that says which parameters differ on
which ranks.

check_same_step(): at each sync of an algorithm whose communication follows a
step counter (LocalSGD's averagers, SlowMo, DiLoCo, QAdam, the decentralized
ones), the ranks first compare their counters and a hash of the optimizer
settings that must match (refuse_different_settings names a difference). A
counter that differs (a checkpoint loaded on some ranks only, an optimizer
step taken on some ranks only) would make the ranks' syncs pair different
steps: the averages would mix models of different times with no error, and
the job would hang only at its end.

Both first agree through mpidp's own deadline-bounded collectives (a missing
rank cannot hang them); only once every rank knows about a mismatch are the
details exchanged."""

from __future__ import annotations

import hashlib
import struct
import zlib

import torch

from . import config
from .. import _C


def _describe(module) -> list[str]:
    described = [f"{name}: shape {tuple(p.shape)}, {str(p.dtype).replace('torch.', '')}, "
                 f"{p.device.type}, {'trainable' if p.requires_grad else 'frozen'}"
                 for name, p in module.named_parameters()]
    # Buffers travel in the initial broadcast too, so they must match as well.
    described += [f"buffer {name}: shape {tuple(b.shape)}, {str(b.dtype).replace('torch.', '')}, "
                  f"{b.device.type}" for name, b in module.named_buffers()]
    return described


def ranks_named(c_comm, named) -> list[int]:
    """Every rank learns which ranks any rank named (one small allreduce)."""
    flags = torch.zeros(c_comm.size, dtype=torch.float64)
    for r in named:
        flags[r] = 1.0
    c_comm.allreduce(flags, _C.OP_SUM, _C.NO_WIRE, False)
    return [r for r in range(c_comm.size) if flags[r] > 0]


def _ranks_flagged(c_comm, flagged: bool) -> list[int]:
    """Every rank learns which ranks raised a flag."""
    return ranks_named(c_comm, [c_comm.rank] if flagged else [])


def check_same_structure(c_comm, mpi_comm, module, who: str, settings: dict | None = None) -> None:
    """module None: the settings only (a model averager has no model)."""
    if c_comm.size == 1:
        return
    described = [f"setting {k} = {v}" for k, v in (settings or {}).items()]
    described += _describe(module) if module is not None else []
    digest = hashlib.sha256("\n".join(described).encode()).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.float64).clone()
    root = mine.clone()
    try:
        c_comm.bcast(root, 0)
        bad = _ranks_flagged(c_comm, not torch.equal(mine.view(torch.uint8), root.view(torch.uint8)))
    except _C.RanksLost:
        raise                       # fault-tolerant mode's: recover() handles it
    except _C.CommError as error:   # MPI_ERR_TRUNCATE, a deadline: the calls did not pair
        raise type(error)(
            f"{who}: its set-up did not meet the other ranks' ({error}). Every rank must "
            "build it at the same point of the program: built on some ranks only, or a "
            "model wrapped more times on some ranks than on others, pairs this set-up with "
            "another rank's training") from error
    if not bad:
        return
    # Every rank knows now, so every rank takes part in the details.
    reference = mpi_comm.bcast(described if c_comm.rank == 0 else None, root=0)
    first = None
    for i in range(max(len(reference), len(described))):
        theirs = reference[i] if i < len(reference) else "(none)"
        ours = described[i] if i < len(described) else "(none)"
        if theirs != ours:
            first = f"entry {i} is {ours!r} there, {theirs!r} on rank 0"
            break
    if first is None:
        first = f"{len(described)} parameters there, {len(reference)} on rank 0"
    details = mpi_comm.allgather(first if c_comm.rank in bad else None)
    what = "settings" if "'setting " in details[bad[0]] else "models"
    advice = "; every rank must pass the same" if what == "settings" else ""
    raise ValueError(f"{who}: the ranks' {what} differ: rank(s) {bad} do not match rank 0 "
                     f"(rank {bad[0]}: {details[bad[0]]}){advice}")


def check_every() -> int:
    """Steps between drift checks; 0 when MPIDP_CHECK is off."""
    return config.get("MPIDP_CHECK_EVERY") if config.get("MPIDP_CHECK") else 0


def _differs_from_root(c_comm, tensors) -> torch.Tensor:
    """Per tensor (any dtype), 1.0 where this rank's bytes differ from rank 0's
    (64-bit checksums, one broadcast)."""
    sums = _C.checksums([t.detach().cpu().contiguous() for t in tensors])
    mine = torch.tensor([s - (1 << 64) if s >= (1 << 63) else s for s in sums], dtype=torch.int64)
    root = mine.clone()
    c_comm.bcast(root.view(torch.float64), 0)
    return (mine != root).to(torch.float64)


def ranks_differing(c_comm, tensors) -> list[int]:
    """The ranks whose tensors are not bit for bit rank 0's (every rank gets
    the same list)."""
    if c_comm.size == 1:
        return []
    return _ranks_flagged(c_comm, bool(_differs_from_root(c_comm, tensors).any()))


def check_in_sync(c_comm, named_params, who: str, when: str) -> None:
    if c_comm.size == 1:
        return
    names = [n for n, _ in named_params]
    differs = _differs_from_root(c_comm, [p for _, p in named_params])
    bad = _ranks_flagged(c_comm, bool(differs.any()))
    if not bad:
        return
    # How many ranks differ, per parameter.
    c_comm.allreduce(differs, _C.OP_SUM, _C.NO_WIRE, False)
    drifted = [names[i] for i in range(len(names)) if differs[i] > 0]
    listed = ", ".join(repr(n) for n in drifted[:5]) + (" ..." if len(drifted) > 5 else "")
    raise RuntimeError(f"{who}: parameters drifted apart across ranks {when}: {listed} differ "
                       f"from rank 0's on rank(s) {bad} (MPIDP_CHECK)")


def numbers_of(mapping) -> list:
    """The (key, number) items of a param group or a parameter's optimizer
    state, sorted by key ("params" and non-numbers left out)."""
    return [(k, float(v)) for k, v in sorted(mapping.items())
            if k != "params" and isinstance(v, (bool, int, float))]


def param_group_settings(groups) -> list:
    """(name, number) settings of an optimizer's param groups (lr, momentum,
    ...); items of `groups` that are not dicts (parameters) have none."""
    return [(f"param group {j}: {k}", v) for j, g in enumerate(groups) if isinstance(g, dict)
            for k, v in numbers_of(g)]


def settings_hash(values) -> int:
    """A 32-bit hash of a list of numbers (the values of some settings)."""
    return zlib.crc32(struct.pack(f"{len(values)}d", *values))


def frozen_code(params) -> float:
    """A number naming which of `params` are frozen now (requires_grad
    False), compared across ranks as a setting: the replica algorithms leave
    a frozen parameter where it is, so ranks that froze different ones would
    drift apart silently. (A crc32 is exact in a float64.)"""
    return float(zlib.crc32(bytes(not p.requires_grad for p in params)))


def refuse_different_settings(c_comm, who: str, settings) -> None:
    """Collective: returns when every rank's (name, number) `settings` (its
    optimizers' param-group settings) equal rank 0's, else raises the same
    RuntimeError on every rank naming the first difference. Called once a
    cheap comparison found a difference: every rank's numbers travel."""
    n = len(settings)
    counts = torch.zeros(c_comm.size, dtype=torch.float64)
    counts[c_comm.rank] = n
    c_comm.allreduce(counts, _C.OP_SUM, _C.NO_WIRE, False)
    advice = ("so the ranks would update their models differently. Step LR schedulers on every "
              "rank (ReduceLROnPlateau: give it a metric averaged over the ranks, e.g. "
              "mpidp.allreduce_scalar(val_loss)) and set the same hyperparameters on every rank")
    if any(c != n for c in counts.tolist()):
        bad = [r for r, c in enumerate(counts.tolist()) if c != counts[0]]
        raise RuntimeError(f"{who}: the optimizers' param groups differ across ranks: rank(s) "
                           f"{bad} hold another number of settings than rank 0, {advice}")
    table = torch.zeros(c_comm.size, n, dtype=torch.float64)
    table[c_comm.rank] = torch.tensor([float(v) for _, v in settings], dtype=torch.float64)
    c_comm.allreduce(table, _C.OP_SUM, _C.NO_WIRE, False)
    bad = [r for r in range(c_comm.size) if not torch.equal(table[r], table[0])]
    if not bad:
        return
    col = int((table[bad[0]] != table[0]).nonzero()[0])
    raise RuntimeError(f"{who}: the optimizers' settings differ across ranks: rank(s) {bad} do "
                       f"not match rank 0 ({settings[col][0]} = {table[bad[0], col].item()!r} on "
                       f"rank {bad[0]}, {table[0, col].item()!r} on rank 0), {advice}")


def ranks_range(c_comm, *values: float) -> list:
    """(smallest, largest) of each value over the ranks of `c_comm`, in one
    allreduce (the maximum of each value and of its negation): the ranks
    agree on a value when its two ends are equal."""
    both = torch.tensor([v for x in values for v in (float(x), -float(x))], dtype=torch.float64)
    if c_comm.size > 1:
        c_comm.allreduce(both, _C.OP_MAX, _C.NO_WIRE, False)
    return [(-both[2 * i + 1].item(), both[2 * i].item()) for i in range(len(values))]


def ranks_at_steps(steps) -> str:
    """"rank(s) [..] at step s; ..." for each rank's step, in rank order."""
    at: dict[int, list[int]] = {}
    for r, s in enumerate(steps):
        at.setdefault(s, []).append(r)
    return "; ".join(f"rank(s) {ranks} at step {s}" for s, ranks in sorted(at.items()))


def check_same_step(c_comm, step: int, who: str, settings=()) -> None:
    """Every rank of `c_comm` is at `step` of `who`'s schedule and holds the
    same (name, number) optimizer `settings`, or every rank raises the same
    RuntimeError naming each rank's step or the first setting that differs.
    One allreduce of four numbers (the largest step and hash of the
    settings, and the negated smallest); only when they differ do the
    details travel."""
    if c_comm.size == 1:
        return
    steps, hashes = ranks_range(c_comm, step, settings_hash([v for _, v in settings]))
    if steps[0] == steps[1]:
        if hashes[0] != hashes[1]:
            refuse_different_settings(c_comm, who, settings)
        return
    steps = torch.zeros(c_comm.size, dtype=torch.float64)
    steps[c_comm.rank] = float(step)
    c_comm.allreduce(steps, _C.OP_SUM, _C.NO_WIRE, False)
    raise RuntimeError(
        f"{who}: the ranks reached this sync at different steps "
        f"({ranks_at_steps(int(s) for s in steps.tolist())}), so their syncs "
        "would pair different steps and mix models of different times. Were checkpoints "
        "loaded on some ranks only, or steps taken on some ranks only (a GradScaler skips the "
        "step of a rank whose gradients overflowed)? Load the same step's checkpoint on every "
        "rank (each its own state_dict()), and step on every rank")
