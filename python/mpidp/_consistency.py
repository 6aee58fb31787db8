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
step counter (LocalSGD's averagers, SlowMo, DiLoCo), the ranks compare their
counters first. A counter that differs (a checkpoint loaded on some ranks
only, an optimizer step taken on some ranks only) would make the ranks'
syncs pair different steps: the averages would mix models of different
times with no error, and the job would hang only at its end.

Both first agree through mpidp's own deadline-bounded collectives (a missing
rank cannot hang them); only once every rank knows about a mismatch are the
details exchanged."""

from __future__ import annotations

import hashlib

import torch

from . import _config as config
from . import _C


def _describe(module) -> list[str]:
    described = [f"{name}: shape {tuple(p.shape)}, {str(p.dtype).replace('torch.', '')}, "
                 f"{p.device.type}, {'trainable' if p.requires_grad else 'frozen'}"
                 for name, p in module.named_parameters()]
    # Buffers travel in the initial broadcast too, so they must match as well.
    described += [f"buffer {name}: shape {tuple(b.shape)}, {str(b.dtype).replace('torch.', '')}, "
                  f"{b.device.type}" for name, b in module.named_buffers()]
    return described


def _ranks_named(c_comm, named) -> list[int]:
    """Every rank learns which ranks any rank named (one small allreduce)."""
    flags = torch.zeros(c_comm.size, dtype=torch.float64)
    for r in named:
        flags[r] = 1.0
    c_comm.allreduce(flags, _C.OP_SUM, _C.NO_WIRE, False)
    return [r for r in range(c_comm.size) if flags[r] > 0]


def _ranks_flagged(c_comm, flagged: bool) -> list[int]:
    """Every rank learns which ranks raised a flag."""
    return _ranks_named(c_comm, [c_comm.rank] if flagged else [])


def first_difference(c_comm, mpi_comm, described: list[str]):
    """None when every rank's `described` (lines) equals rank 0's; else
    (the ranks that differ, the first difference of the first of them), the
    same on every rank. A digest is compared first; the lines travel only
    when some rank differs."""
    digest = hashlib.sha256("\n".join(described).encode()).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.float64).clone()
    root = mine.clone()
    c_comm.bcast(root, 0)
    bad = _ranks_flagged(c_comm, not torch.equal(mine.view(torch.uint8), root.view(torch.uint8)))
    if not bad:
        return None
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
        first = f"{len(described)} entries there, {len(reference)} on rank 0"
    details = mpi_comm.allgather(first if c_comm.rank in bad else None)
    return bad, f"rank {bad[0]}: {details[bad[0]]}"


def check_same_structure(c_comm, mpi_comm, module, who: str, settings: dict | None = None) -> None:
    """module None: the settings only (a model averager has no model)."""
    if c_comm.size == 1:
        return
    described = [f"setting {k} = {v}" for k, v in (settings or {}).items()]
    described += _describe(module) if module is not None else []
    found = first_difference(c_comm, mpi_comm, described)
    if found is None:
        return
    bad, detail = found
    what = "settings" if "'setting " in detail else "models"
    advice = "; every rank must pass the same" if what == "settings" else ""
    raise ValueError(f"{who}: the ranks' {what} differ: rank(s) {bad} do not match rank 0 "
                     f"({detail}){advice}")


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


def check_same_step(c_comm, step: int, who: str) -> None:
    """Every rank of `c_comm` is at `step` of `who`'s schedule, or every rank
    raises the same RuntimeError naming each rank's step. One allreduce of two
    numbers (the largest step and the negated smallest); only when they differ
    are the steps gathered for the message."""
    if c_comm.size == 1:
        return
    bounds = torch.tensor([float(step), -float(step)], dtype=torch.float64)
    c_comm.allreduce(bounds, _C.OP_MAX, _C.NO_WIRE, False)
    if bounds[0] == -bounds[1]:
        return
    steps = torch.zeros(c_comm.size, dtype=torch.float64)
    steps[c_comm.rank] = float(step)
    c_comm.allreduce(steps, _C.OP_SUM, _C.NO_WIRE, False)
    at: dict[int, list[int]] = {}
    for r, s in enumerate(steps.tolist()):
        at.setdefault(int(s), []).append(r)
    listed = "; ".join(f"rank(s) {ranks} at step {s}" for s, ranks in sorted(at.items()))
    raise RuntimeError(
        f"{who}: the ranks reached this sync at different steps ({listed}), so their syncs "
        "would pair different steps and mix models of different times. Were checkpoints "
        "loaded on some ranks only, or steps taken on some ranks only (a GradScaler skips the "
        "step of a rank whose gradients overflowed)? Load the same step's checkpoint on every "
        "rank (each its own state_dict()), and step on every rank")
