"""Adapters: the Bagua algorithm classes of the algorithms that have a public
class of their own (DataParallel, PeriodicModelAverager, SlowMo, DiLoCo,
SparseLoCo, MuLoCo, NoLoCo, eager DiLoCo, DES-LOC), for with_bagua, with their
upstream arguments, so that any algorithm of the family can follow any other
mid-training::

    net = mpidp.with_bagua(model, [opt], mpidp.algorithms.GradientAllReduceAlgorithm())
    ...                                            # warm up with averaged gradients
    net = mpidp.with_bagua(net, [opt], mpidp.algorithms.DiLoCoAlgorithm(outer, sync_every=50))

The rule of where an algorithm's Bagua class lives: an algorithm whose only
API is Bagua's (QAdam, the decentralized ones, asynchronous averaging)
keeps its class in its own module (mpidp/algorithms/<algorithm>.py); one
with a public class of its own gets an adapter here, whose driver holds that
class as its part (PartDriver).

Each counts the steps of the first optimizer given to with_bagua (the inner
optimizer) and runs its rule after each of them."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from ..._runtime.args import check_bool, check_int
from ..._runtime.mpi import communicator
from ..._runtime.hook_handles import remove_handles
from ...collectives.model_state import broadcast_optimizer_state
from ..averaging import PeriodicModelAverager
from ..data_parallel import DataParallel
from ..desloc import DESLOC
from ..diloco import DiLoCo
from ..driver import Driver
from ..eager_diloco import EagerDiLoCo
from ..muloco import MuLoCo
from ..noloco import NoLoCo
from ..slowmo import SlowMoDistributedDataParallel
from ..sparseloco import SparseLoCo
from .algorithm import Algorithm, plain_setting

__all__ = ["GradientAllReduceAlgorithm", "ByteGradAlgorithm", "LocalSGDAlgorithm",
           "SlowMoAlgorithm", "DiLoCoAlgorithm", "SparseLoCoAlgorithm", "MuLoCoAlgorithm",
           "NoLoCoAlgorithm", "EagerDiLoCoAlgorithm", "DESLOCAlgorithm", "PartDriver"]


def first_optimizer(optimizers, who: str) -> torch.optim.Optimizer:
    if not optimizers:
        raise ValueError(f"optimizers: {who} runs after the steps of the first optimizer; pass "
                         "the optimizer that steps the model to with_bagua")
    return optimizers[0]


class PartDriver(Driver):
    """An adapter's driver: the algorithm's public class, built by `build()`
    as this driver's part (its hooks, drain and detach are the part's), its
    state the part's; `after_step(part, optimizer)`, where given, runs after
    each step of `optimizer`."""

    def __init__(self, what: str, module, comm, build: Callable[[], Driver],
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 after_step: Optional[Callable[[Driver, torch.optim.Optimizer], None]] = None):
        self.what, self.module, self.comm = what, module, comm
        with self._building_parts():
            self.part = build()
        self._handles = [] if after_step is None else [optimizer.register_step_post_hook(
            lambda opt, _args, _kwargs: after_step(self.part, opt))]

    def _remove_hooks(self) -> None:
        remove_handles(self._handles)     # the part's own go with it, detached as a part

    def _recovers(self) -> bool:
        # Whatever its part does (the part, claimed while it is built, is
        # checked itself).
        part = getattr(self, "part", None)
        return part is None or part._recovers()

    def _takes_replacements(self) -> bool:
        return self.part._takes_replacements()

    def _continue_on(self, comm) -> None:
        """Fault-tolerant mode: the part goes on over the survivors by its
        own rule."""
        self.part._continue_on(comm)
        self.comm = comm

    def algorithm_state(self) -> Dict[str, Any]:
        return self.part.algorithm_state()

    def load_algorithm_state(self, state: Dict[str, Any]) -> None:
        self.part.load_algorithm_state(state)


class GradientDriver(PartDriver):
    """The gradient reducer's algorithms: mpidp.DataParallel as the part,
    with blocking updates (the user's own optimizers step as usual)."""

    def __init__(self, what, module, optimizers, comm, wire_dtype, hierarchical: bool,
                 average: bool):
        super().__init__(what, module, comm, build=lambda: DataParallel(
            module, comm, blocking_parameter_updates=True, wire_dtype=wire_dtype,
            hierarchical=hierarchical))
        self.optimizers = optimizers
        self.dp = self.part
        self.dp.set_average(average)

    # The reducer keeps no state of its own: the messages name this algorithm.
    algorithm_state = Driver.algorithm_state
    load_algorithm_state = Driver.load_algorithm_state

    @contextlib.contextmanager
    def join(self, adopt_optimizer_state: bool = False):
        """DataParallel.join() (uneven inputs); with adopt_optimizer_state
        every rank then also takes the optimizer states of the rank that
        trained longest."""
        check_bool("adopt_optimizer_state", adopt_optimizer_state)
        with self.dp.join():
            yield
        if adopt_optimizer_state:
            for opt in self.optimizers:
                broadcast_optimizer_state(opt, root=self.dp.join_root, comm=self.comm)


class _GradientAlgorithm(Algorithm):
    """The gradient reducer's algorithms, which differ only in their wire
    (_wire_dtype: None for float32) and in their defaults."""

    _wire_dtype = None

    def __init__(self, hierarchical: bool, average: bool):
        check_bool("hierarchical", hierarchical)
        check_bool("average", average)
        self.hierarchical = hierarchical
        self.average = average

    def attach(self, module, optimizers, comm):
        return GradientDriver(type(self).__name__, module, optimizers, comm, self._wire_dtype,
                              self.hierarchical, self.average)


class GradientAllReduceAlgorithm(_GradientAlgorithm):
    """Gradients summed over the ranks every step (averaged with average=True),
    in float32; hierarchical=True sums within each node first (every local rank
    then carries 1/L of the bytes between nodes)."""

    def __init__(self, hierarchical: bool = False, average: bool = True):
        super().__init__(hierarchical, average)


class ByteGradAlgorithm(_GradientAlgorithm):
    """Gradients quantized to 8 bits (min-max blocks of 256, counted from each
    block's minimum) for the sum over the ranks; with hierarchical=True (the
    default, as Bagua's) the node sums in float32 first and only the
    cross-node exchange is quantized.

    average: divide the sum by the number of ranks (True) or keep the sum."""

    _wire_dtype = torch.uint8

    def __init__(self, hierarchical: bool = True, average: bool = True):
        super().__init__(hierarchical, average)


class _LocalSGDDriver(Driver):
    what = "LocalSGDAlgorithm"

    def __init__(self, module, optimizers, comm, period: int, warmup_steps: int):
        self.module = module
        self.optimizer = first_optimizer(optimizers, self.what)
        handle = communicator(comm)
        self._claim(module, handle)
        self.params = [p for p in module.parameters() if p.requires_grad]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # period 1: the user asked for it
            # (A replacement's takes rank 0's step count here.)
            self.averager = PeriodicModelAverager(period, warmup_steps, handle.mpi)
        # Fault-tolerant mode: it goes on through this driver (_continue_on),
        # whose set-up with_bagua's gives a replacement the model.
        self.averager._owned_by_driver = True
        # torch's recipe: gradients averaged every step for the warm-up, by a
        # DataParallel part (the default train_forward and drain use it).
        if self.averager.step < warmup_steps:
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

    def _continue_on(self, comm) -> None:
        """Fault-tolerant mode: the averager goes on over the survivors by its
        rule, then the warm-up's DataParallel, while it lasts, by its own --
        the order of this driver's set-up, which a replacement runs."""
        self._claim(self.module, communicator(comm))    # found again at the next loss
        self.averager._continue_on(comm)
        for part in self._live_parts():
            part._continue_on(comm)

    def _takes_replacements(self) -> bool:
        # with_bagua's set-up gives a replacement rank 0's model and
        # optimizer states, the averager rank 0's step (so whether the
        # warm-up's DataParallel is still on).
        return True

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
        return {k: plain_setting(v) for k, v in self.settings.items()}

    def __repr__(self) -> str:
        return f"SlowMoAlgorithm({', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"

    def attach(self, module, optimizers, comm):
        return PartDriver(
            "SlowMoAlgorithm", module, comm,
            build=lambda: SlowMoDistributedDataParallel(module, comm=comm, **self.settings),
            optimizer=first_optimizer(optimizers, "SlowMoAlgorithm"),
            after_step=lambda slowmo, optimizer: slowmo.perform_slowmo(optimizer))


def _check_outer(outer_optimizer) -> None:
    if not isinstance(outer_optimizer, torch.optim.Optimizer):
        raise TypeError("outer_optimizer: expected a torch.optim.Optimizer, got "
                        f"{type(outer_optimizer).__name__}")


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
        _check_outer(outer_optimizer)
        self.outer_optimizer = outer_optimizer
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.model_fragments = model_fragments
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = fragment_update_alpha
        self.wire_dtype = wire_dtype
        self.sync_buffers = sync_buffers

    def attach(self, module, optimizers, comm):
        inner = first_optimizer(optimizers, "DiLoCoAlgorithm")
        return PartDriver("DiLoCoAlgorithm", module, comm, build=lambda: DiLoCo(
            module, inner, self.outer_optimizer, self.sync_every, comm,
            model_fragments=self.model_fragments, fragment_sync_delay=self.fragment_sync_delay,
            fragment_update_alpha=self.fragment_update_alpha, wire_dtype=self.wire_dtype,
            sync_buffers=self.sync_buffers).__enter__())


def _keyword_settings(cls) -> list:
    return [name for name, p in inspect.signature(cls).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _check_settings(who: str, settings: dict, known: list, of: str) -> None:
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise TypeError(f"{who}: unexpected argument(s) {unknown}; expected {of}'s: {known}")


def _shared_settings(algorithm) -> Dict[str, Any]:
    """sync_every and the keyword settings of an algorithm of the
    SparseLoCo family, as with_bagua compares them across ranks."""
    return {"sync_every": algorithm.sync_every,
            **{k: plain_setting(v) for k, v in algorithm.settings.items()}}


def _repr(algorithm) -> str:
    args = [f"sync_every={algorithm.sync_every}"] + [f"{k}={v!r}"
                                                      for k, v in algorithm.settings.items()]
    return f"{type(algorithm).__name__}({', '.join(args)})"


_SPARSELOCO_SETTINGS = _keyword_settings(SparseLoCo)
_MULOCO_SETTINGS = _keyword_settings(MuLoCo)


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
        _check_settings("SparseLoCoAlgorithm", settings, _SPARSELOCO_SETTINGS, "mpidp.SparseLoCo")
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.settings = dict(settings)

    def shared_settings(self) -> Dict[str, Any]:
        return _shared_settings(self)

    def __repr__(self) -> str:
        return _repr(self)

    def attach(self, module, optimizers, comm):
        inner = first_optimizer(optimizers, "SparseLoCoAlgorithm")
        return PartDriver("SparseLoCoAlgorithm", module, comm,
                          build=lambda: SparseLoCo(module, inner, self.sync_every, comm,
                                                   **self.settings).__enter__())


class _WithOuterOptimizer(Algorithm):
    """The adapter of an algorithm whose class takes the inner optimizers
    (every optimizer given to with_bagua: Muon beside AdamW, say, one inner
    step a step of each), the user's outer optimizer, sync_every and
    keyword settings: `algorithm_class`(module, inner, outer_optimizer,
    sync_every, comm, **settings)."""

    algorithm_class: Any = None

    def __init__(self, outer_optimizer: torch.optim.Optimizer, sync_every: int,
                 settings: Dict[str, Any]):
        _check_outer(outer_optimizer)
        self.outer_optimizer = outer_optimizer
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.settings = settings

    def shared_settings(self) -> Dict[str, Any]:
        # The outer optimizer's settings are compared by the class's own set-up.
        return _shared_settings(self)

    def __repr__(self) -> str:
        return _repr(self)

    def attach(self, module, optimizers, comm):
        who = type(self).__name__
        first_optimizer(optimizers, who)
        inner = list(optimizers) if len(optimizers) > 1 else optimizers[0]
        make = self.algorithm_class
        return PartDriver(who, module, comm,
                          build=lambda: make(module, inner, self.outer_optimizer,
                                             self.sync_every, comm, **self.settings).__enter__())


class MuLoCoAlgorithm(_WithOuterOptimizer):
    """MuLoCo (mpidp.MuLoCo's rule and arguments): the optimizers given to
    with_bagua are the inner ones; `outer_optimizer` holds the model's
    trainable parameters and steps θ̃ every `sync_every` inner steps with
    the mean of the compressed outer gradients. `settings` are
    mpidp.MuLoCo's keyword arguments (error_decay, top_k, chunk_size,
    quantization_bins, quantization_range, sync_buffers, sync_delay)."""

    algorithm_class = MuLoCo

    def __init__(self, outer_optimizer: torch.optim.Optimizer, sync_every: int, **settings):
        _check_settings("MuLoCoAlgorithm", settings, _MULOCO_SETTINGS, "mpidp.MuLoCo")
        super().__init__(outer_optimizer, sync_every, dict(settings))


class NoLoCoAlgorithm(_WithOuterOptimizer):
    """NoLoCo (mpidp.NoLoCo's rule and arguments): the optimizers given to
    with_bagua are the inner ones; `outer_optimizer` is this rank's, holding
    the model's trainable parameters; every `sync_every` inner steps each
    rank averages with a random group (`group_size`, drawn from `seed`)."""

    algorithm_class = NoLoCo

    def __init__(self, outer_optimizer: torch.optim.Optimizer, sync_every: int, *,
                 group_size: int = 2, seed: int = 0):
        super().__init__(outer_optimizer, sync_every,
                         {"group_size": check_int("group_size", group_size, 2),
                          "seed": check_int("seed", seed, 0)})


class EagerDiLoCoAlgorithm(_WithOuterOptimizer):
    """DiLoCo with eager outer updates (mpidp.EagerDiLoCo's rule and
    arguments): the optimizers given to with_bagua are the inner ones;
    `outer_optimizer` is this rank's, holding the model's trainable
    parameters; every `sync_every` inner steps it steps with the last
    round's mean and this rank's fresh outer gradient, while this round's
    all-reduce overlaps the next inner phase. wire_dtype and sync_buffers
    are mpidp.EagerDiLoCo's."""

    algorithm_class = EagerDiLoCo

    def __init__(self, outer_optimizer: torch.optim.Optimizer, sync_every: int, *,
                 wire_dtype: Optional[torch.dtype] = None, sync_buffers: bool = True):
        super().__init__(outer_optimizer, sync_every,
                         {"wire_dtype": wire_dtype,
                          "sync_buffers": check_bool("sync_buffers", sync_buffers)})


class DESLOCAlgorithm(Algorithm):
    """DES-LOC (mpidp.DESLOC's rule and arguments): the first optimizer
    given to with_bagua is the Adam (or AdamW) every rank steps on its own;
    the parameters are averaged every `param_every` steps, Adam's first
    moments every `exp_avg_every` and its second every `exp_avg_sq_every`
    (defaults: 3 and 6 times param_every)."""

    def __init__(self, param_every: int, *, exp_avg_every: Optional[int] = None,
                 exp_avg_sq_every: Optional[int] = None):
        self.param_every = check_int("param_every", param_every, 1)
        self.exp_avg_every = check_int(
            "exp_avg_every", 3 * param_every if exp_avg_every is None else exp_avg_every, 1)
        self.exp_avg_sq_every = check_int(
            "exp_avg_sq_every", 6 * param_every if exp_avg_sq_every is None else exp_avg_sq_every,
            1)

    def shared_settings(self) -> Dict[str, Any]:
        return {"param_every": self.param_every, "exp_avg_every": self.exp_avg_every,
                "exp_avg_sq_every": self.exp_avg_sq_every}

    def __repr__(self) -> str:
        return (f"DESLOCAlgorithm(param_every={self.param_every}, "
                f"exp_avg_every={self.exp_avg_every}, exp_avg_sq_every={self.exp_avg_sq_every})")

    def attach(self, module, optimizers, comm):
        adam = first_optimizer(optimizers, "DESLOCAlgorithm")
        return PartDriver("DESLOCAlgorithm", module, comm, build=lambda: DESLOC(
            module, adam, self.param_every, comm, exp_avg_every=self.exp_avg_every,
            exp_avg_sq_every=self.exp_avg_sq_every).__enter__())

