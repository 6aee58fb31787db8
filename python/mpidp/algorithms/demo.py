"""DeMo (decoupled momentum) over MPI: an optimizer that replaces the
gradient allreduce (docs/error-feedback.md gives the rule).

Each rank folds its own gradient into its momentum δ ← βδ + ηg, takes the
DCT of each tile of δ, sends the k strongest coefficients of each tile and
removes them from δ. The ranks' coefficients are gathered, averaged
sparsely in rank order, transformed back, and every rank steps
p ← p - η·sign(Q): the same bits on every rank.

The kernels are the core's (mpidp/efcomp.h); the coefficients travel
through mpidp/_engines/ef_wire.py."""

from __future__ import annotations

import warnings
import weakref
from typing import Dict, List, Tuple

import torch

from .. import _C
from .._runtime import fault_tolerant_mode
from .._runtime.args import check_int, check_real
from .._runtime.model_consistency import frozen_code
from .driver import algorithms_over, set_up
from .._runtime.mpi import communicator
from .._engines.ef_wire import Wire

__all__ = ["DeMo"]

# The DeMo that steps each parameter (the newest built over it), by id(parameter):
# (the parameter, the DeMo), both weakly held (tensors compare elementwise, so
# they cannot be the keys of a WeakKeyDictionary).
_HOLDER: Dict[int, Tuple[weakref.ref, weakref.ref]] = {}


class DeMo(torch.optim.Optimizer):
    """DeMo(params, lr, compression_decay=0.999, compression_topk=32,
    compression_chunk=64, weight_decay=0.0, comm=None): the reference's
    arguments and defaults. Use it on the plain model, without
    DataParallel or any other gradient average: DeMo's own exchange is the
    only communication (it refuses to step parameters that an mpidp
    algorithm also averages).

    compression_topk coefficients of each compression_chunk x
    compression_chunk tile are sent per step (1-D tensors: tiles of
    compression_chunk). weight_decay is decoupled (p ← p(1 - lr·wd) before
    the update). Parameters whose gradient is None this step count as zero
    gradients (their momentum still decays), so every rank sends the same
    layout; a frozen parameter (requires_grad False) is left where it is,
    momentum included, as torch's optimizers leave it (every rank must
    freeze the same ones: checked at every step). After each step,
    `data_transmit` and `data_receive` hold the bytes this rank sent and
    received (every rank's payload, its own included, as the reference
    counts). Every step checks, from the
    gathered bytes, that the ranks are at the same step with the same
    settings and parameters.

    Parameters must be contiguous float32 CPU tensors; every rank builds
    DeMo over the same parameters in the same order, and they start from
    rank 0's values (broadcast here). A second DeMo over the same
    parameters takes them over, with a warning; the first one's step()
    then raises."""

    def __init__(self, params, lr: float, compression_decay: float = 0.999,
                 compression_topk: int = 32, compression_chunk: int = 64,
                 weight_decay: float = 0.0, comm=None):
        check_real("lr", lr, 0.0, None)
        check_real("compression_decay", compression_decay, 0.0, 1.0, high_open=True)
        check_int("compression_topk", compression_topk, 1)
        check_int("compression_chunk", compression_chunk, 1)
        if compression_chunk > _C.EF_MAX_CHUNK:
            raise ValueError(f"compression_chunk: expected 1 .. {_C.EF_MAX_CHUNK}, got "
                             f"{compression_chunk!r}")
        check_real("weight_decay", weight_decay, 0.0, None)
        super().__init__(params, {"lr": float(lr), "weight_decay": float(weight_decay)})
        self.compression_decay = float(compression_decay)
        self.compression_topk = compression_topk
        self.compression_chunk = compression_chunk
        self._params = [p for g in self.param_groups for p in g["params"]]
        for p in self._params:
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                raise TypeError(f"params: DeMo steps contiguous float32 CPU parameters, got "
                                f"{p.dtype} on {p.device}")
        self._set_up(comm)
        if fault_tolerant_mode.enabled():
            fault_tolerant_mode.participate(self)
        # Fault-tolerant mode: the momenta and step count before the step
        # under way, put back where a rank's loss cuts it short.
        self._before_step = None
        self._kept_deltas: Dict[torch.Tensor, torch.Tensor] = {}   # its buffers, kept across steps
        self._wire = self._make_wire()
        self._bases: Dict[int, torch.Tensor] = {}
        for t in self._wire.tensors:
            for side in t.tiling[2:]:
                if side not in self._bases:
                    self._bases[side] = torch.empty(side * side)
                    _C.ef_dct_basis(self._bases[side], side)
        self._scratch = torch.empty(max((p.numel() for p in self._params), default=0))
        self._replaced = False
        self._hold(self._params)
        self.demo_step = 0
        self.data_transmit = 0
        self.data_receive = 0
        if fault_tolerant_mode.joining():     # a replacement: rank 0's step count
            self.demo_step = self._communicator.mpi.bcast(None, root=0)

    def _set_up(self, comm) -> None:
        """The ranks' settings compared, and rank 0's parameters for every rank."""
        settings = {"compression_decay": self.compression_decay,
                    "compression_topk": self.compression_topk,
                    "compression_chunk": self.compression_chunk,
                    "shapes": [tuple(p.shape) for p in self._params]}
        self._communicator, _ = set_up(None, comm, "DeMo", settings)
        self._comm = self._communicator.c
        with torch.no_grad():
            for p in self._params:
                self._comm.bcast(p.data, 0)

    def _make_wire(self) -> Wire:
        topk = self.compression_topk
        return Wire(self._comm, [p.shape for p in self._params], self.compression_chunk,
                    lambda length: topk, 0, "DeMo", self._communicator.mpi)

    def _takes_replacements(self) -> bool:
        return True       # its momentum at zero, the rest rank 0's (_continue_on)

    def _recovery_comm(self):
        """The communicator recover() sets DeMo up again over the survivors of
        (the job's world or a group's)."""
        return self._communicator.mpi

    def _continue_on(self, survivors) -> None:
        """Fault-tolerant mode, after a rank was lost (mpidp.recover()): the
        exchanges go on over the survivors. A step the loss cut short was
        applied by none of them (its agreement comes before any parameter
        moves): each survivor's momentum and step count go back to before
        it, so the loop's redo of the step is that step over the survivors.
        The lost rank's momentum leaves with it; the parameters, equal on
        every survivor, stay. Where replacements joined (recover(replace=
        True)), the survivors repeat the set-up they run (rank 0's
        parameters, equal anyway) and send them the step count; a
        replacement's momentum starts at zero."""
        if fault_tolerant_mode.growing():
            self._set_up(survivors)
        else:
            self._communicator = communicator(survivors)
            self._comm = self._communicator.c
        self._wire = self._make_wire()    # recover() ended the old one's requests
        if self._before_step is not None:
            self.demo_step, deltas = self._before_step
            for p, delta in deltas.items():
                if delta is None:       # its first step was the one cut short
                    self.state[p].pop("delta", None)
                else:
                    self.state[p]["delta"].copy_(delta)
            self._before_step = None
        for p in self._params:             # the cut-short step's, spent
            p.grad = None
        if fault_tolerant_mode.growing():
            self._communicator.mpi.bcast(self.demo_step, root=0)

    def _settings(self) -> List[float]:
        return [self.compression_decay, float(self.compression_topk), frozen_code(self._params)] + [
            v for g in self.param_groups for v in (float(g["lr"]), float(g["weight_decay"]))]

    def _setting_names(self) -> List[str]:
        return ["compression_decay", "compression_topk", "frozen parameters"] + [
            f"param group {j}: {k}" for j in range(len(self.param_groups))
            for k in ("lr", "weight_decay")]

    def _hold(self, params) -> None:
        """One DeMo per parameter, as one algorithm per module: two would both
        step it. The newer takes the parameters over, with a warning, and the
        older raises at its next step."""
        for key in [k for k, (param, _) in _HOLDER.items() if param() is None]:
            del _HOLDER[key]             # parameters gone
        older = {}
        for p in params:
            param, holder = (r() for r in _HOLDER.get(id(p), (lambda: None, lambda: None)))
            if param is p and holder is not None and holder is not self and not holder._replaced:
                older[id(holder)] = holder
        for h in older.values():
            h._replaced = True
            warnings.warn("DeMo: these parameters were already stepped by another DeMo; that one "
                          "is replaced (its step() raises), so that each parameter has one "
                          "optimizer", UserWarning, stacklevel=3)
        for p in params:
            _HOLDER[id(p)] = (weakref.ref(p), weakref.ref(self))

    def _refuse_other_averaging(self) -> None:
        if self._replaced:
            raise RuntimeError("DeMo: a newer DeMo over the same parameters replaced this one; "
                               "step that one")
        others = algorithms_over(self._params)
        if others:
            raise RuntimeError(
                f"DeMo: these parameters are also averaged by {', '.join(others)}; DeMo replaces "
                "the gradient allreduce (its exchange of momentum components is the only "
                "communication), and an average beside it would change its rule. Build the "
                "optimizer over the plain model, without DataParallel or another algorithm")

    def _keep_before_step(self) -> None:
        """Fault-tolerant mode: the step count and every momentum before this
        step, copied into buffers kept across steps (no allocation per step)."""
        kept, sources, buffers = {}, [], []
        for p in self._params:
            if not p.requires_grad:
                continue
            delta = self.state[p].get("delta")
            if delta is not None:
                buffer = self._kept_deltas.get(p)
                if buffer is None or buffer.shape != delta.shape:
                    buffer = self._kept_deltas[p] = torch.empty_like(delta)
                sources.append(delta)
                buffers.append(buffer)
                delta = buffer
            kept[p] = delta
        if buffers:      # one call for every momentum (a loop of copy_ cost 1.7x as much)
            torch._foreach_copy_(buffers, sources)
        self._before_step = (self.demo_step, kept)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_other_averaging()
        wire = self._wire
        if fault_tolerant_mode.enabled():
            self._keep_before_step()
        self.demo_step += 1
        wire.write_header(self.demo_step, self._settings(), self._params)
        i = 0
        last_bucket = 0
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                t = wire.tensors[i]
                if t.bucket != last_bucket:  # the previous bucket is complete: send it
                    wire.post(last_bucket)
                    last_bucket = t.bucket
                bucket, offset = wire.buckets_of(i)
                if not p.requires_grad:
                    # Frozen: left where it is, its momentum untouched (torch's
                    # optimizers skip it alike); it sends zeros, so that every
                    # rank's payload keeps one layout (the scratch, zeroed, as
                    # its momentum: the decode below reuses it afterwards).
                    zeros = self._scratch[:p.numel()].view_as(p).zero_()
                    _C.ef_demo_compress(zeros, None, t.tiling, self.compression_decay, lr, t.k,
                                        self._bases[t.tiling[2]], self._bases[t.tiling[3]],
                                        bucket, offset)
                    i += 1
                    continue
                state = self.state[p]
                if "delta" not in state:
                    state["delta"] = torch.zeros_like(p)
                grad = p.grad
                if grad is not None and grad.is_sparse:
                    grad = grad.to_dense()
                if grad is not None and (grad.dtype != torch.float32 or not grad.is_contiguous()):
                    grad = grad.to(torch.float32).contiguous()
                _C.ef_demo_compress(state["delta"], grad, t.tiling, self.compression_decay, lr,
                                    t.k, self._bases[t.tiling[2]], self._bases[t.tiling[3]],
                                    bucket, offset)
                i += 1
        wire.post(last_bucket)
        wire.wait(self._setting_names())
        if fault_tolerant_mode.enabled():
            fault_tolerant_mode.agree_all_alive("DeMo step", "no rank applied it",
                                                self._communicator.mpi)
        i = 0
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                t = wire.tensors[i]
                if not p.requires_grad:
                    i += 1
                    continue
                q = self._scratch[:p.numel()].view_as(p)
                gathered, offset, stride = wire.gathered_of(i)
                _C.ef_demo_decode(q, gathered, offset, stride, self._comm.size, t.tiling, t.k,
                                  self._bases[t.tiling[2]], self._bases[t.tiling[3]])
                if wd:   # decoupled: p(1 - lr·wd) - lr·sign(Q)
                    p.mul_(1.0 - lr * wd)
                p.sub_(q.sign_(), alpha=lr)
                i += 1
        self.data_transmit = wire.bytes_sent
        self.data_receive = wire.bytes_sent * self._comm.size
        self._before_step = None
        fault_tolerant_mode.commit_step()
        return loss

    def state_dict(self):
        out = super().state_dict()
        out["demo_step"] = self.demo_step
        return out

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        step = state_dict.pop("demo_step", None)
        super().load_state_dict(state_dict)
        if step is not None:
            self.demo_step = check_int("state_dict['demo_step']", step, 0)

    def add_param_group(self, param_group) -> None:
        if getattr(self, "_wire", None) is not None:
            raise RuntimeError("DeMo: its parameters are fixed at construction (every rank sends "
                               "the same layout); build a new DeMo with every parameter")
        super().add_param_group(param_group)
