"""Collectives whose ranks passed tensors that do not match.

MPI matches a collective's messages by order alone: a broadcast into a larger
receiver, or one of another dtype, exits 0 with the receiver's tail or
reinterpreted bytes, a smaller one gets MPI_ERR_TRUNCATE, and a segmented
algorithm can hang. So before the public collectives post anything, the
ranks agree on what each passed: one small blocking allreduce (MPI_MAX) of
the call's signature and its negation in the core (mpidp/agree.h) -- the
ranks agree exactly when the maximum of every field equals minus the
maximum of its negation -- so the check is one round trip of 2 x 14 int64
per call. Only on a mismatch do the
signatures travel (an allgather) so that every rank raises the same
ValueError naming each group of ranks and what they passed.

The signature holds the call, the dtype, the number of dimensions, the first
six dimensions (the first one left out where ranks may differ in it, as
allgather's rows), a CRC-32 of the whole shape, and the call's settings
(root, op, wire dtype, a CRC of counts or shapes) as integers. The engines' own traffic
(gradient buckets, DASO's sends, gossip inside SlowMo) never comes here: its
sizes were agreed when the wrapper was set up."""

from __future__ import annotations

import zlib

import torch

from .. import _C

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
           torch.int16, torch.int32, torch.int64, torch.bool)
_DIMS = 6
# Fields: call, dtype, ndim, dims[_DIMS], shape crc, then the settings.
_SETTINGS = ("root", "op", "wire", "layout")
_FIELDS = 4 + _DIMS + len(_SETTINGS)
_UNSET = -(1 << 62)   # a setting the call does not have (-1 is a code: no wire dtype)


def signature(call: str, tensor: torch.Tensor, rows_free: bool = False, **settings) -> list:
    """The fields agree() compares (see the module's docstring)."""
    dtype, shape = tensor.dtype, list(tensor.shape)
    if rows_free and shape:
        shape[0] = -1
    dims = (shape + [-2] * _DIMS)[:_DIMS]
    return ([zlib.crc32(call.encode()), _DTYPES.index(dtype) if dtype in _DTYPES else -1,
             len(shape)] + dims + [zlib.crc32(repr(shape).encode())]
            + [int(settings.get(k, _UNSET)) for k in _SETTINGS])


# The calls that check, by the CRC their signatures carry (a rank that called
# another collective is named with it).
_CALLS = {zlib.crc32(c.encode()): c for c in ("allreduce", "broadcast", "allgather",
                                               "reduce_scatter", "broadcast_parameters",
                                               "gossip.mix")}


def _describe(sig: list, names: dict) -> str:
    ndim = sig[2]
    dims = ["*" if d == -1 else str(d) for d in sig[3:3 + min(ndim, _DIMS)]]
    if ndim > _DIMS:
        dims.append("...")
    dtype = str(_DTYPES[sig[1]]).replace("torch.", "") if sig[1] >= 0 else "?"
    text = f"{_CALLS.get(sig[0], 'another call')} of {dtype} [{', '.join(dims)}]"
    for key, value in zip(_SETTINGS, sig[4 + _DIMS:]):
        if value == _UNSET:
            continue
        if key == "layout":
            text += f", layout #{value:08x} (a CRC of the counts or shapes)"
        else:
            text += f", {key} {names.get(key, {}).get(value, value)}"
    return text


def agree(c: "_C.Comm", call: str, tensor: torch.Tensor, *, rows_free: bool = False,
          names: dict | None = None, global_ranks: list | None = None,
          timeout_s: float | None = None, **settings) -> None:
    """Raises ValueError on every rank of `c` unless every rank passed a
    tensor of the same dtype and shape (the first dimension aside with
    `rows_free`) and the same `settings` (ints: root, op, wire, and layout:
    crc_of a list) to the collective `call`. names: {setting: {int: name}}
    for the message; global_ranks: c's ranks in the job's numbering, which
    the message then names (with c's own), for a communicator of a subset;
    timeout_s: a deadline shorter than MPIDP_TIMEOUT (a group's own)."""
    if c.size == 1:
        return
    key = (call, tensor.dtype, tensor.shape, rows_free, tuple(settings.items()))
    sig = _SIGNATURES.get(key)
    if sig is None:
        sig = tuple(signature(call, tensor, rows_free, **settings))
        if len(_SIGNATURES) >= _SIGNATURES_KEPT:
            _SIGNATURES.clear()
        _SIGNATURES[key] = sig
    if not c.agree(sig, timeout_s):
        refuse(c, call, list(sig), names or {}, global_ranks)


# The signatures of recent calls: a training loop repeats a few shapes, and
# building one (two CRCs) costs several times the lookup.
_SIGNATURES: dict = {}
_SIGNATURES_KEPT = 4096


def name_ranks(ranks: list, global_ranks: list | None = None) -> str:
    """"rank(s) [0, 2]", or with `global_ranks` (a subset's ranks in the
    job's numbering) "global rank(s) [3, 5] (group rank(s) [0, 2])"."""
    if not global_ranks:
        return f"rank(s) {ranks}"
    return f"global rank(s) {[global_ranks[r] for r in ranks]} (group rank(s) {ranks})"


def refuse(c: "_C.Comm", call: str, sig: list, names: dict,
           global_ranks: list | None = None) -> None:
    """The ValueError of a collective whose ranks disagree, naming every
    group of ranks and its signature (one allgather; every rank raises)."""
    everyone = torch.empty(c.size * _FIELDS, dtype=torch.int64)
    c.allgather(torch.tensor(sig, dtype=torch.int64), everyone)
    groups: dict = {}
    for r, row in enumerate(everyone.view(c.size, _FIELDS).tolist()):
        groups.setdefault(tuple(row), []).append(r)
    described = "; ".join(f"{name_ranks(ranks, global_ranks)}: {_describe(list(row), names)}"
                          for row, ranks in groups.items())
    raise ValueError(f"mpidp.{call}: the ranks passed tensors or settings that differ, and every "
                     f"rank must pass the same (shape, dtype and settings): {described}")


def crc_of(values) -> int:
    """A setting made of several values (counts, shapes), as one int for agree()."""
    return zlib.crc32(repr(list(values)).encode())
