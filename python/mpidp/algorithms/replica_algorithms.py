"""The replica algorithms as mpidp.algorithms, for with_bagua: LocalSGD
(torch's post-local SGD), SlowMo (fairscale's), DiLoCo (torchft's) and
SparseLoCo (its authors' reference), with
their upstream arguments, so that any algorithm of the family can follow any
other mid-training::

    net = mpidp.with_bagua(model, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
    ...                                            # warm up with averaged gradients
    net = mpidp.with_bagua(net, [opt], mpidp.algorithms.DiLoCoAlgorithm(outer, sync_every=50))

Each counts the steps of the first optimizer given to with_bagua (the inner
optimizer) and runs its rule after each of them; the engines are those of
PeriodicModelAverager, SlowMoDistributedDataParallel, DiLoCo and SparseLoCo, which
these drivers hold as parts."""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict, Optional, Sequence

import torch

from .algorithm import Algorithm, _plain
from .._runtime.args import check_int
from .driver import Driver
from .._runtime.mpi import communicator
from .._runtime.params import remove_handles
from .averaging import PeriodicModelAverager
from .data_parallel import DataParallel
from .diloco import DiLoCo
from .slowmo import SlowMoDistributedDataParallel
from .sparseloco import SparseLoCo

__all__ = ["LocalSGDAlgorithm", "SlowMoAlgorithm", "DiLoCoAlgorithm", "SparseLoCoAlgorithm"]


def _first_optimizer(optimizers, who: str) -> torch.optim.Optimizer:
    if not optimizers:
        raise ValueError(f"optimizers: {who} runs after the steps of the first optimizer; pass "
                         "the optimizer that steps the model to with_bagua")
    return optimizers[0]


class _LocalSGDDriver(Driver):
    what = "LocalSGDAlgorithm"

    def __init__(self, module, optimizers, comm, period: int, warmup_steps: int):
        self.module = module
        self.optimizer = _first_optimizer(optimizers, self.what)
        handle = communicator(comm)
        self._claim(module, handle)
        self.params = [p for p in module.parameters() if p.requires_grad]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # period 1: the user asked for it
            self.averager = PeriodicModelAverager(period, warmup_steps, handle.mpi)
        # torch's recipe: gradients averaged every step for the warm-up, by a
        # DataParallel part (the default train_forward and drain use it).
        if warmup_steps > 0:
            with self._building_parts():
                DataParallel(module, comm, blocking_parameter_updates=True)
        self._handles = [self.optimizer.register_step_post_hook(self._after_step)]

    def _after_step(self, _optimizer, _args, _kwargs) -> None:
        self.averager.average_parameters(self.params)
        self._end_warmup_when_due()

    def _end_warmup_when_due(self) -> None:
        if self.averager.step >= self.averager.warmup_steps:
            for part in self._live_parts():
                part.detach("LocalSGDAlgorithm's warm-up ended")

    def _remove_hooks(self) -> None:
        remove_handles(self._handles)

    def algorithm_state(self) -> Dict[str, Any]:
        return {"step": self.averager.step}

    def load_algorithm_state(self, state: Dict[str, Any]) -> None:
        if set(state) != {"step"}:
            raise ValueError(f"state: expected the keys ['step'], got {sorted(state)}")
        self.averager.step = check_int("state['step']", state["step"], 0)
        self._end_warmup_when_due()


class LocalSGDAlgorithm(Algorithm):
    """Local SGD (torch's post-local SGD): every rank steps its own replica
    and the replicas are averaged every `period` steps from step
    `warmup_steps` on (torch's PeriodicModelAverager rule: right after steps
    warmup_steps, warmup_steps + period, ...); during the first warmup_steps
    steps the gradients are averaged every step instead (torch's
    PostLocalSGDState(start_localSGD_iter=warmup_steps))."""

    def __init__(self, period: int, warmup_steps: int = 0):
        self.period = check_int("period", period, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)

    def attach(self, module, optimizers, comm):
        return _LocalSGDDriver(module, optimizers, comm, self.period, self.warmup_steps)


class _SlowMoDriver(Driver):
    what = "SlowMoAlgorithm"

    def __init__(self, module, optimizers, comm, settings: Dict[str, Any]):
        self.module = module
        self.optimizer = _first_optimizer(optimizers, self.what)
        with self._building_parts():
            self.slowmo = SlowMoDistributedDataParallel(module, comm=comm, **settings)
        self._handles = [self.optimizer.register_step_post_hook(self._after_step)]

    def _after_step(self, optimizer, _args, _kwargs) -> None:
        self.slowmo.perform_slowmo(optimizer)

    def _remove_hooks(self) -> None:
        remove_handles(self._handles)

    def algorithm_state(self) -> Dict[str, Any]:
        return self.slowmo.algorithm_state()

    def load_algorithm_state(self, state: Dict[str, Any]) -> None:
        self.slowmo.load_algorithm_state(state)


_SLOWMO_SETTINGS = [name for name in inspect.signature(SlowMoDistributedDataParallel).parameters
                    if name not in ("module", "comm")]


class SlowMoAlgorithm(Algorithm):
    """SlowMo: `settings` are fairscale's SlowMoDistributedDataParallel
    arguments, with its defaults (nprocs_per_node, slowmo_base_algorithm,
    slowmo_momentum, slowmo_lr, slowmo_frequency, localsgd_frequency, ...);
    perform_slowmo runs after each step of the first optimizer."""

    def __init__(self, **settings):
        unknown = sorted(set(settings) - set(_SLOWMO_SETTINGS))
        if unknown:
            raise TypeError(f"SlowMoAlgorithm: unexpected argument(s) {unknown}; expected "
                            f"SlowMoDistributedDataParallel's: {_SLOWMO_SETTINGS}")
        self.settings = dict(settings)

    def shared_settings(self) -> Dict[str, Any]:
        # Each of SlowMo's arguments on its own, so a difference is named by it.
        return {k: _plain(v) for k, v in self.settings.items()}

    def __repr__(self) -> str:
        return f"SlowMoAlgorithm({', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"

    def attach(self, module, optimizers, comm):
        return _SlowMoDriver(module, optimizers, comm, self.settings)


class _DiLoCoDriver(Driver):
    what = "DiLoCoAlgorithm"

    def __init__(self, module, optimizers, comm, algorithm: "DiLoCoAlgorithm"):
        self.module = module
        inner = _first_optimizer(optimizers, self.what)
        with self._building_parts():
            self.diloco = DiLoCo(module, inner, algorithm.outer_optimizer, algorithm.sync_every,
                                 comm, model_fragments=algorithm.model_fragments,
                                 fragment_sync_delay=algorithm.fragment_sync_delay,
                                 fragment_update_alpha=algorithm.fragment_update_alpha,
                                 wire_dtype=algorithm.wire_dtype,
                                 sync_buffers=algorithm.sync_buffers)
            self.diloco.__enter__()

    def _remove_hooks(self) -> None:
        pass            # DiLoCo's own, detached as a part

    def algorithm_state(self) -> Dict[str, Any]:
        return self.diloco.state_dict()

    def load_algorithm_state(self, state: Dict[str, Any]) -> None:
        self.diloco.load_state_dict(state)


class DiLoCoAlgorithm(Algorithm):
    """DiLoCo and Streaming DiLoCo (torchft's arguments, mpidp.DiLoCo's
    rule): the first optimizer given to with_bagua is the inner one;
    `outer_optimizer` holds the model's trainable parameters and steps them
    every `sync_every` inner steps. model_fragments, fragment_sync_delay,
    fragment_update_alpha, wire_dtype and sync_buffers are mpidp.DiLoCo's
    (Streaming DiLoCo's fragments, the overlap, the mixing, the outer
    gradients' wire and the BatchNorm statistics' average)."""

    def __init__(self, outer_optimizer: torch.optim.Optimizer, sync_every: int, *,
                 model_fragments: Optional[Sequence[torch.nn.Module]] = None,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0,
                 wire_dtype: Optional[torch.dtype] = None, sync_buffers: bool = True):
        if not isinstance(outer_optimizer, torch.optim.Optimizer):
            raise TypeError("outer_optimizer: expected a torch.optim.Optimizer, got "
                            f"{type(outer_optimizer).__name__}")
        self.outer_optimizer = outer_optimizer
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.model_fragments = model_fragments
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = fragment_update_alpha
        self.wire_dtype = wire_dtype
        self.sync_buffers = sync_buffers

    def attach(self, module, optimizers, comm):
        return _DiLoCoDriver(module, optimizers, comm, self)


class _SparseLoCoDriver(Driver):
    what = "SparseLoCoAlgorithm"

    def __init__(self, module, optimizers, comm, algorithm: "SparseLoCoAlgorithm"):
        self.module = module
        inner = _first_optimizer(optimizers, self.what)
        with self._building_parts():
            self.sparseloco = SparseLoCo(module, inner, algorithm.sync_every, comm,
                                         **algorithm.settings)
            self.sparseloco.__enter__()

    def _remove_hooks(self) -> None:
        pass            # SparseLoCo's own, detached as a part

    def algorithm_state(self) -> Dict[str, Any]:
        return self.sparseloco.state_dict()

    def load_algorithm_state(self, state: Dict[str, Any]) -> None:
        self.sparseloco.load_state_dict(state)


_SPARSELOCO_SETTINGS = [name for name, p in inspect.signature(SparseLoCo).parameters.items()
                        if p.kind is inspect.Parameter.KEYWORD_ONLY]


class SparseLoCoAlgorithm(Algorithm):
    """SparseLoCo (mpidp.SparseLoCo's rule and arguments): the first
    optimizer given to with_bagua is the inner one; every `sync_every` inner
    steps the replicas' outer gradients go through the error-feedback
    buffers, as top-k 2-bit codes by default, and every replica restarts
    from the new shared weights. `settings` are mpidp.SparseLoCo's keyword
    arguments (lr, error_decay, top_k, chunk_size, use_quantization,
    quantization_bins, quantization_range, weight_decay, mean,
    sync_buffers)."""

    def __init__(self, sync_every: int, **settings):
        unknown = sorted(set(settings) - set(_SPARSELOCO_SETTINGS))
        if unknown:
            raise TypeError(f"SparseLoCoAlgorithm: unexpected argument(s) {unknown}; expected "
                            f"mpidp.SparseLoCo's: {_SPARSELOCO_SETTINGS}")
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.settings = dict(settings)

    def shared_settings(self) -> Dict[str, Any]:
        return {"sync_every": self.sync_every, **{k: _plain(v) for k, v in self.settings.items()}}

    def __repr__(self) -> str:
        args = [f"sync_every={self.sync_every}"] + [f"{k}={v!r}" for k, v in self.settings.items()]
        return f"SparseLoCoAlgorithm({', '.join(args)})"

    def attach(self, module, optimizers, comm):
        return _SparseLoCoDriver(module, optimizers, comm, self)
