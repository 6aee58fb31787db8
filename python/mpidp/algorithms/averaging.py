"""Model averaging with torch's names: post-local SGD over MPI.

`PeriodicModelAverager`, `HierarchicalModelAverager` and
`PostLocalSGDOptimizer` behave as torch.distributed's (the same arguments,
the same `step` counter, the same parameters averaged on the same steps, to
the same values), with an mpi4py communicator as `process_group` and
mpidp's allreduce underneath. When to average is the core's averaging
schedule (mpidp/averaging_schedule.h), shared with SlowMo and DiLoCo.

One difference from torch, on purpose: torch averages only the parameters
whose `.grad` is not None, and ranks that disagree on which those are post
allreduces of different sizes (undefined behaviour in MPI). Here the ranks
first compare how many elements each averages and all raise a ValueError
naming the counts instead."""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, Iterable, List, Mapping

import torch

from .. import _C
from .._runtime import fault_tolerant_mode
from .._runtime.args import check_int
from .._runtime.model_consistency import check_same_step, param_group_settings, ranks_range
from ..collectives.means import average_tensors, mean_over_ranks
from .driver import set_up
from .._runtime.mpi import MPI, as_mpi4py, resolve_comm
from .._runtime.state_broadcast import give_replacements

__all__ = ["ModelAverager", "PeriodicModelAverager", "HierarchicalModelAverager",
           "PostLocalSGDOptimizer", "average_parameters", "average_tensors", "mean_over_ranks"]


def _params_to_average(params: Iterable[Any]) -> List[torch.Tensor]:
    """torch's rule: parameters (or optimizer parameter groups' parameters)
    whose .grad is not None."""
    chosen = []
    for item in params:
        if isinstance(item, torch.Tensor):
            group = [item]
        elif isinstance(item, Mapping) and "params" in item:
            group = item["params"]
        else:
            raise TypeError(f"params: expected parameters or optimizer parameter groups, got "
                            f"{type(item).__name__}")
        chosen.extend(p for p in group if p.grad is not None)
    return chosen


def _check_same_count(numel: int, comm: _C.Comm) -> None:
    """All ranks of `comm` average the same number of elements, or all raise."""
    (least, most), = ranks_range(comm, numel)
    if least != most:
        raise ValueError(
            f"params: the ranks average different numbers of elements (from {int(least)} to "
            f"{int(most)}; {numel} on this rank). Parameters whose .grad is None are left "
            "out, as in torch: give every rank the same parameters with gradients (set unused "
            "ones' .grad to zeros), or pass the parameters themselves")


def average_parameters(params: Iterable[Any], process_group=None) -> None:
    """Average `params` (parameters, or optimizer parameter groups) over the
    ranks of `process_group` (an mpi4py communicator; None: all ranks), as
    torch's model_averaging.utils.average_parameters_or_parameter_groups:
    flattened (mixed dtypes are upcast for the sum and cast back), divided by
    the group size, summed. Parameters whose .grad is None are left out."""
    _average(params, resolve_comm(process_group, "process_group"), process_group)


def _average(params: Iterable[Any], comm: _C.Comm, agreement) -> None:
    """average_parameters over `comm`; in fault-tolerant mode taken once the
    ranks of `agreement` (an mpi4py communicator, None: the world) agree
    (means.average_tensors)."""
    chosen = _params_to_average(params)
    if comm.size > 1:
        _check_same_count(sum(p.numel() for p in chosen), comm)
    average_tensors(chosen, comm, agreement)


class ModelAverager:
    """The base of the averagers: `process_group` (an mpi4py communicator, or
    None for all ranks) and `step`, the number of average_parameters() calls
    so far (checkpointed by PostLocalSGDOptimizer)."""

    def __init__(self, process_group=None):
        self._comm = resolve_comm(process_group, "process_group")
        self.process_group = process_group if process_group is not None else MPI.COMM_WORLD
        self.step = 0
        # An averaging a lost rank interrupted: (its parameters, its level).
        self._interrupted = None
        self._last_params: list = []    # those of the last average_parameters call
        # Fault-tolerant mode, recover(replace=True): the parameters a
        # replacement takes from rank 0 (a callable; PostLocalSGDOptimizer
        # gives its optimizer's), or this averager's owner gives them (a
        # driver: with_bagua's LocalSGD, whose set-up broadcasts the model).
        self._replica_params = None
        self._owned_by_driver = False
        if fault_tolerant_mode.enabled():
            # Over the job's world or a group's communicator (a group's loss
            # is recovered by recover(comm=process_group), the job's by
            # recover()); the group is joined as the settings are compared.
            fault_tolerant_mode.participate(self)

    def _recovery_comm(self):
        """The communicator recover() sets this averager up again over the
        survivors of (the job's world or a group's)."""
        return self.process_group

    def _continue_on(self, survivors) -> None:
        """Fault-tolerant mode, after a rank was lost (mpidp.recover()): go on
        over the survivors (of the job, or of the group this averager runs
        over), first completing over them the averaging the loss interrupted
        (every survivor's local step was applied, and none took that
        average). Where replacements joined, that was done over the
        survivors alone (_finish_before_growth); the replacements are then
        given rank 0's step count and parameters, as their set-up takes."""
        growing = fault_tolerant_mode.growing()
        self._move_to(survivors, regroup=not growing)
        if growing:     # the replacement's set-up, call for call
            self._check_settings_agree(self._settings)
            self._share_step()
            self._regroup_with_replacements(survivors)
            if self._replica_params is not None:
                give_replacements(self._replica_params(), self._comm, replacement=False)
        # The cut-short step's gradients are spent: a zero_grad() after the
        # step, which the exception skipped, must not find them added to.
        for p in _params_to_average(self._last_params):
            p.grad = None

    def _finish_before_growth(self, survivors) -> None:
        """recover(replace=True): the interrupted averaging, over the
        survivors alone, before the replacements' set-up."""
        self._move_to(survivors)

    def _move_to(self, survivors, regroup: bool = True) -> None:
        self._comm = resolve_comm(survivors)
        self.process_group = survivors
        if regroup:
            self._regroup(survivors)
        if self._interrupted is not None:
            params, level = self._interrupted
            _average(params, self._group(level), self.process_group)
            self._interrupted = None
            self.step += 1
            fault_tolerant_mode.commit_step()

    def _takes_replacements(self) -> bool:
        """recover(replace=True) gives a replacement rank 0's parameters
        through PostLocalSGDOptimizer (or the owning driver's set-up): an
        averager alone knows no model until its first average_parameters."""
        return self._replica_params is not None or self._owned_by_driver

    def _why_no_replacements(self) -> str:
        return (f"{type(self).__name__} alone knows no model to give a replacement: step it "
                "through PostLocalSGDOptimizer, whose optimizer names the parameters")

    def _check_settings_agree(self, settings: Dict[str, Any]) -> None:
        """Every rank of the group built the same averager, or all raise
        (different periods would post mismatched allreduces). A replacement
        then takes rank 0's step count."""
        self._settings = settings
        set_up(None, self.process_group, type(self).__name__, settings, argname="process_group")
        if fault_tolerant_mode.joining():
            self._share_step()

    def _share_step(self) -> None:
        """Rank 0's step count for every rank (the survivors' agree)."""
        comm = as_mpi4py(self.process_group, "process_group")
        self.step = comm.bcast(self.step if comm.Get_rank() == 0 else None, root=0)

    def _schedule(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _group(self, level: int) -> _C.Comm:
        raise NotImplementedError

    def _regroup(self, survivors) -> None:
        """Fault-tolerant mode: the averaging groups made again over the
        survivors (collective over them)."""

    def _regroup_with_replacements(self, merged) -> None:
        """recover(replace=True): the averaging groups over the survivors and
        the replacements (as a replacement's construction makes them)."""
        self._regroup(merged)

    def average_parameters(self, params: Iterable[Any]) -> None:
        """Average `params` (model parameters or optimizer parameter groups)
        if this step is due, then count the step."""
        params = self._last_params = list(params)
        due = _C.avgsched_actions(self.step, **self._schedule())
        if due.average:
            group = self._group(due.level)
            # Until done (fault-tolerant mode: recover() ends it).
            self._interrupted = (params, due.level)
            check_same_step(group, self.step, type(self).__name__, param_group_settings(params))
            # Every level's average is agreed by every rank of process_group:
            # each one averages on the same steps, so a loss anywhere stops
            # them all at the same step, and recover() ends that averaging.
            _average(params, group, self.process_group)
            self._interrupted = None
        self.step += 1
        fault_tolerant_mode.commit_step()


class PeriodicModelAverager(ModelAverager):
    """Averages every `period` steps once `warmup_steps` have passed: on steps
    warmup_steps, warmup_steps + period, ... (torch's PeriodicModelAverager).

    process_group: the ranks that average (an mpi4py communicator; None:
    every rank)."""

    def __init__(self, period: int, warmup_steps: int = 0, process_group=None):
        check_int("period", period, 1)
        check_int("warmup_steps", warmup_steps, 0)
        super().__init__(process_group)
        if period == 1:
            warnings.warn("PeriodicModelAverager: period=1 averages the parameters after every "
                          "step, which costs at least as much as averaging gradients "
                          "(mpidp.DataParallel): use that instead", UserWarning, stacklevel=2)
        self.period = period
        self.warmup_steps = warmup_steps
        self._check_settings_agree({"period": period, "warmup_steps": warmup_steps})

    def _schedule(self) -> Dict[str, Any]:
        return {"warmup_steps": self.warmup_steps, "periods": (self.period,),
                "count_from_warmup": True}

    def _group(self, level: int) -> _C.Comm:
        return self._comm


class HierarchicalModelAverager(ModelAverager):
    """Averages over nested groups (torch's HierarchicalModelAverager):
    `period_group_size_dict` maps periods, ascending, to group sizes; after
    `warmup_steps`, a step divisible by some periods averages over the group
    of the largest of them. Groups are consecutive ranks of `process_group`
    (ranks 0..k-1, k..2k-1, ...), and the last size must be the whole group's."""

    def __init__(self, period_group_size_dict: Mapping[int, int] = None, warmup_steps: int = 0,
                 process_group=None):
        if not isinstance(period_group_size_dict, Mapping):
            raise TypeError("period_group_size_dict: expected a mapping of periods to group sizes "
                            f"(e.g. {{4: 2, 16: 8}}), got {type(period_group_size_dict).__name__}")
        if not period_group_size_dict:
            raise ValueError("period_group_size_dict: expected a non-empty mapping of periods "
                             "to group sizes")
        periods = list(period_group_size_dict)
        sizes = [period_group_size_dict[p] for p in periods]
        for p in periods:
            check_int("period_group_size_dict: a period", p, 1)
        if periods != sorted(set(periods)):
            raise ValueError(f"period_group_size_dict: periods must be ascending, got {periods}")
        check_int("warmup_steps", warmup_steps, 0)
        super().__init__(process_group)
        n_ranks = self._comm.size
        if sizes[-1] != n_ranks:
            raise ValueError(f"period_group_size_dict: the last group size must be the size of "
                             f"process_group ({n_ranks}), got {sizes[-1]}")
        for size in sizes:
            check_int("period_group_size_dict: a group size", size, 1)
            if n_ranks % size:
                raise ValueError(f"period_group_size_dict: group size {size} does not divide "
                                 f"the {n_ranks} ranks of process_group")
        if periods[-1] == 1:
            warnings.warn("HierarchicalModelAverager: a largest period of 1 averages after every "
                          "step, which costs at least as much as averaging gradients "
                          "(mpidp.DataParallel): use that instead", UserWarning, stacklevel=2)
        self.period_group_size_dict = dict(zip(periods, sizes))
        self.warmup_steps = warmup_steps
        self._check_settings_agree({"period_group_size_dict": self.period_group_size_dict,
                                    "warmup_steps": warmup_steps})
        self._periods = tuple(periods)
        # This rank's place among the ranks as built (a replacement takes a
        # lost rank's), and each level's group: the whole process_group
        # (None) or, by its index (place // size), the group of consecutive
        # places. Kept through a loss of ranks: each group goes on with its
        # survivors.
        self._sizes = sizes
        self._place = self._comm.rank
        if fault_tolerant_mode.joining():
            self._regroup_with_replacements(as_mpi4py(self.process_group))
        else:
            self._set_colors()
            self._regroup(as_mpi4py(self.process_group))

    def _set_colors(self) -> None:
        whole = self._sizes[-1]
        self._colors = [None if size == whole else self._place // size for size in self._sizes]

    def _regroup_with_replacements(self, merged) -> None:
        """recover(replace=True), on the survivors and in a replacement's
        construction alike: each replacement takes a place a lost rank left
        (the lowest first, in rank order), so that it averages in the lost
        rank's group at every level."""
        mine = None if fault_tolerant_mode.joining() else self._place
        self._place = fault_tolerant_mode.places_after_growth(
            merged, mine, self._sizes[-1])[merged.Get_rank()]
        self._set_colors()
        self._regroup(merged)

    def _regroup(self, comm) -> None:
        """Each level's group over `comm` (collective: every rank creates every
        level's group, in order)."""
        self._groups = [self._comm if color is None else self._subgroup(comm, color)
                        for color in self._colors]

    @staticmethod
    def _subgroup(comm, color: int) -> _C.Comm:
        """mpidp's communicator over the ranks of `comm` of group `color`."""
        split = comm.Split(color, comm.Get_rank())
        try:
            return _C.Comm(split)
        finally:
            split.Free()

    def _schedule(self) -> Dict[str, Any]:
        return {"warmup_steps": self.warmup_steps, "periods": self._periods}

    def _group(self, level: int) -> _C.Comm:
        return self._groups[level]


def _parameters_of(optim: torch.optim.Optimizer):
    """A callable giving `optim`'s parameters as they are then (its groups
    may change), holding the optimizer weakly."""
    ref = weakref.ref(optim)

    def parameters() -> List[torch.Tensor]:
        optimizer = ref()
        return [] if optimizer is None else \
            [p for g in optimizer.param_groups for p in g["params"]]
    return parameters


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Steps `optim`, then lets `averager` average its parameter groups
    (torch's PostLocalSGDOptimizer). state_dict() adds the averager's step
    under "step"; load_state_dict() restores it (0, with a warning, when the
    state has none)."""

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager):
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"optim: expected a torch.optim.Optimizer, got {type(optim).__name__}")
        if not isinstance(averager, ModelAverager):
            raise TypeError(f"averager: expected an mpidp model averager (PeriodicModelAverager, "
                            f"HierarchicalModelAverager), got {type(averager).__name__}")
        # Not Optimizer.__init__: the wrapped optimizer owns the groups and state.
        self.optim = optim
        self.averager = averager
        if fault_tolerant_mode.enabled():
            # recover(replace=True): a replacement takes rank 0's parameters
            # here, as the survivors' averager gives them (_continue_on).
            averager._replica_params = _parameters_of(optim)
            if fault_tolerant_mode.joining():
                give_replacements(averager._replica_params(), averager._comm, replacement=True)

    @property
    def param_groups(self):
        """The wrapped optimizer's groups, looked up on every use: its
        load_state_dict() replaces the list, and a copy taken here would leave
        LR schedulers adjusting groups the optimizer no longer reads (as
        torch's PostLocalSGDOptimizer does after a reload)."""
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    @property
    def defaults(self):
        return self.optim.defaults

    def __repr__(self) -> str:
        return repr(self.optim)

    def state_dict(self) -> Dict[str, Any]:
        state = self.optim.state_dict()
        state["step"] = self.averager.step
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)
        if "step" in state_dict:
            self.averager.step = state_dict["step"]
        else:
            warnings.warn("PostLocalSGDOptimizer.load_state_dict: the state has no averager step "
                          "counter; starting it at 0", UserWarning, stacklevel=2)
            self.averager.step = 0

    # GradScaler then calls step() every iteration, setting `found_inf` and
    # `grad_scale`, instead of leaving it out on a rank whose gradients
    # overflowed: that rank skips its own update here, but its averager still
    # counts the step and averages with the others when due (torch's
    # PostLocalSGDOptimizer leaves it a step behind, averaging out of turn).
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            loss = None                      # GradScaler: this rank's gradients overflowed
        else:
            self._unscale(getattr(self, "grad_scale", None))
            loss = self.optim.step(closure) if closure is not None else self.optim.step()
        self.averager.average_parameters(params=self.param_groups)
        return loss

    def _unscale(self, grad_scale) -> None:
        """Divides the gradients by GradScaler's scale (None: not scaled, or
        unscaled already by scaler.unscale_), as GradScaler would: times the
        float32 reciprocal computed in float64."""
        if grad_scale is None:
            return
        inv = float(grad_scale.double().reciprocal().float())   # a float32 value, exactly
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            with torch.no_grad():
                torch._foreach_mul_(grads, inv)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)
