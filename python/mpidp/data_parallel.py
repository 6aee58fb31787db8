"""DataParallel: Heat-style data parallelism over MPI with a C gradient path."""

from __future__ import annotations

import warnings
from typing import Iterable, List, Sequence, Union

import torch

from . import _C
from ._dtypes import code_of, wire_code
from ._mpi import MPI, resolve_comm
from ._params import broadcast_state, check_module, grad_view
from .optimizer import DataParallelOptimizer

__all__ = ["DataParallel"]

_MB = 1 << 20


def _check_optimizers(optimizer) -> List[DataParallelOptimizer]:
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in items:
        if type(opt).__name__ == "DASO":
            raise TypeError("optimizer: DASO works with mpidp.DataParallelMultiGPU, not "
                            "DataParallel")
        if isinstance(opt, torch.optim.Optimizer):
            raise TypeError("optimizer: expected mpidp.DataParallelOptimizer, got the torch "
                            f"optimizer {type(opt).__name__}; wrap it: "
                            "mpidp.DataParallelOptimizer(torch_optimizer)")
        if not isinstance(opt, DataParallelOptimizer):
            raise TypeError("optimizer: expected a mpidp.DataParallelOptimizer (or a list of "
                            f"them), got {type(opt).__name__}")
    return items


class DataParallel(torch.nn.Module):
    """Data-parallel training of `module` over the ranks of `comm`.

    Every rank holds a full replica; each computes gradients on its own data,
    and backward averages them over all ranks through MPI, bucket by bucket
    while backward is still running. Parameters and buffers start as rank 0's.

    Parameters
    ----------
    module : torch.nn.Module
        The local model.
    comm : mpi4py communicator, optional
        The ranks to train over (default MPI.COMM_WORLD). Heat's communicator
        wrapper is accepted too (its `.handle` is used).
    optimizer : DataParallelOptimizer or a list of them, optional
        Heat's API: the optimizer(s) whose `step()` follows DataParallel's mode.
        With None, gradients are averaged and any optimizer can be stepped.
    blocking_parameter_updates : bool
        True: gradients are averaged before `backward()` returns. False
        (Heat's default): non-blocking mode; not available yet, so it falls
        back to blocking with a warning.
    wire_dtype : torch.bfloat16, torch.float16 or None, keyword-only
        Send float32 gradient buckets compressed to this dtype (halving the
        bytes on the wire; the sum is done in fp32 per element and rounded
        once per hop). None sends gradients in their own dtype.
    bucket_cap_mb, first_bucket_cap_mb : float, keyword-only
        Size caps of the gradient buckets (one allreduce each). The first
        bucket is small so communication starts early in backward.
    """

    def __init__(self, module: torch.nn.Module, comm=MPI.COMM_WORLD,
                 optimizer: Union[DataParallelOptimizer, Sequence[DataParallelOptimizer], None] = None,
                 blocking_parameter_updates: bool = False, *, wire_dtype=None,
                 bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0):
        check_module(module)
        optimizers = _check_optimizers(optimizer)
        if not isinstance(blocking_parameter_updates, bool):
            raise TypeError("blocking_parameter_updates: expected a bool, got "
                            f"{type(blocking_parameter_updates).__name__}")
        for name, value in (("bucket_cap_mb", bucket_cap_mb),
                            ("first_bucket_cap_mb", first_bucket_cap_mb)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: expected a positive number of MiB, got {value!r}")
        wire = wire_code(wire_dtype)
        if wire == code_of(torch.float32, "wire_dtype"):
            wire = -1  # float32 on the wire: no compression
        c_comm = resolve_comm(comm)
        super().__init__()
        self.module = module
        self.comm = comm
        self._c_comm = c_comm
        if not blocking_parameter_updates:
            warnings.warn("DataParallel: non-blocking parameter updates are not available yet; "
                          "using blocking updates", stacklevel=2)
            blocking_parameter_updates = True
        self.blocking_parameter_updates = blocking_parameter_updates
        self.wire_dtype = wire_dtype
        self._wire = wire
        self._dp_optimizers = optimizers
        for opt in optimizers:
            opt.blocking_parameter_updates = blocking_parameter_updates
            opt._model = self

        broadcast_state(module, c_comm)
        self._build_reducer(int(first_bucket_cap_mb * _MB), int(bucket_cap_mb * _MB))

    # -- construction -------------------------------------------------------

    def _build_reducer(self, first_cap: int, cap: int) -> None:
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        for name, p in named:
            if p.device.type != "cpu":
                raise NotImplementedError(f"module: parameter {name!r} is on {p.device}; "
                                          "DataParallel supports CPU parameters in this version")
        self._param_names = [n for n, _ in named]
        params = tuple(p for _, p in named)
        numel = [p.numel() for p in params]
        dtypes = [code_of(p.dtype, f"module: parameter {n!r}") for n, p in named]
        if self._wire != -1:
            for (name, p), code in zip(named, dtypes):
                if code not in (code_of(torch.float32, ""), self._wire):
                    raise ValueError(f"wire_dtype: parameter {name!r} is {p.dtype}; gradients can "
                                     f"be compressed to {self.wire_dtype} from float32 only")
        bucket_of, offset, infos = _C.plan_buckets(numel, dtypes, first_cap, cap)
        by_code = {code_of(p.dtype, "dtype"): p.dtype for p in params}
        self._buckets = tuple(
            torch.zeros(n + k, dtype=by_code[dt], device="cpu") for n, k, dt in infos)
        views = tuple(grad_view(self._buckets[b], off, p)
                      for p, b, off in zip(params, bucket_of, offset))
        engine = torch.autograd.Variable._execution_engine
        self._reducer = _C.Reducer(self._c_comm, params, views, self._buckets, bucket_of, offset,
                                   infos, engine.queue_callback,
                                   self.blocking_parameter_updates, "DataParallel", self._wire)
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._reducer.hook(i))
                              for i, p in enumerate(params)]

    # -- training -------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        if self.training and torch.is_grad_enabled():
            self._reducer.prepare()
        return self.module(*inputs, **kwargs)

    def synchronize(self) -> None:
        """Finish all pending gradient communication."""
        self._reducer.complete()

    def _step_due(self, optimizer: DataParallelOptimizer) -> None:
        optimizer.torch_optimizer.step()

    def _before_zero_grad(self) -> None:
        self._reducer.complete()

    def remove_hooks(self) -> None:
        """Detach DataParallel from the module's parameters (the module keeps working
        as a plain, local torch module)."""
        self.synchronize()
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []

    @property
    def bucket_count(self) -> int:
        return self._reducer.n_buckets
