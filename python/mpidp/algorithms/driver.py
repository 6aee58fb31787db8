"""The driver interface: what every training algorithm of mpidp is.

A driver runs one algorithm on one module over one communicator, on the
core's engines (the gradient reducer, parameter syncs, peer exchanges, the
background averager). The public classes (DataParallel, DASO, SlowMo,
DiLoCo, the handles of mpidp.algorithms) keep their upstream names and
arguments and implement this interface; mpidp.with_bagua switches between
any two of them through it alone.

Every driver:
- is set up by `set_up` (one path: the communicator argument checked once,
  the ranks' models and settings compared, the module claimed, rank 0's
  parameters and buffers broadcast, the trainable parameters recorded);
- `drain()`s: finishes the communication it has in flight, so that the
  parameters are what the algorithm's rule says they are now;
- `detach()`es: drains, removes every hook it installed (the module is a plain
  module again) and releases its claim;
- saves and restores its own state (`algorithm_state()` /
  `load_algorithm_state()`; a module's weights and an optimizer's state are
  theirs);
- supports uneven inputs through `join()` or says it does not.

Ownership, one policy for every driver: a module has at most one algorithm
per communicator. A driver that claims a module already claimed by another
live driver over the same MPI communicator takes it over: the older one is
drained and detached, with a warning, and using it afterwards raises
(two algorithms on one communicator would average every gradient or sync
twice). Drivers over different communicators compose -- the user split
the ranks on purpose: DataParallel over mpidp.node_comm() with DiLoCo over
mpidp.cross_node_comm() on one model, whose groups may even hold the same
ranks (one rank per node, a one-rank job) -- and the drivers a driver
builds for itself are its parts, never taken over by it."""

from __future__ import annotations

import abc
import contextlib
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .._runtime import fault_tolerant_groups, fault_tolerant_mode
from .._runtime.model_consistency import check_same_structure
from .._runtime.mpi import Communicator, communicator, is_world
from .._runtime.hook_handles import remove_handles
from .._runtime.model_checks import TrainableAtSetup
from .._runtime.state_broadcast import broadcast_state
__all__ = ["Driver", "InnerStepContext", "InnerStepRounds", "set_up", "wait_pending",
           "continue_on_survivors", "algorithms_over", "WrapperCopy", "reduce_wrapper"]

# The live drivers that claimed each module (weakly held: a dropped driver
# gives its claim up with it).
_CLAIMS: "weakref.WeakKeyDictionary[torch.nn.Module, List[weakref.ref]]" = \
    weakref.WeakKeyDictionary()
# (owner, the drivers built as its parts so far), innermost last.
_BUILDING: List[Tuple["Driver", List["Driver"]]] = []


def set_up(module: Optional[torch.nn.Module], comm, who: str, settings: Dict[str, Any],
           rebuild: str = "", argname: str = "comm", claim_by: Optional["Driver"] = None
           ) -> Tuple[Communicator, Optional[TrainableAtSetup]]:
    """The set-up every driver starts with: `comm` checked once (a
    Communicator: the engines' duplicate and the mpi4py communicator), every
    rank's model structure and `settings` compared (all ranks raise, naming
    the first difference: ranks that differ would post different
    communication and wait until the deadline), the module claimed by
    `claim_by` (an older driver over the same communicator drained and detached
    before anything is broadcast), rank 0's parameters and buffers
    broadcast, and the parameters trainable now recorded (one that starts to
    require grad later is an error at the next step, not a silently local
    one; `rebuild` says how to set the driver up again). With module None
    only the settings are compared."""
    comm = communicator(comm, argname)
    check_same_structure(comm.c, comm.mpi, module, who, settings)
    # A driver built as another's part (SlowMo's node-local DataParallel)
    # agrees and recovers with its owner, over the owner's communicator:
    # also when it is set up again over the survivors (no group of its own,
    # whose duplicate a replacement's construction would not make).
    part = claim_by is not None and claim_by._owner is not None and claim_by._owner() is not None
    if fault_tolerant_mode.enabled() and not is_world(comm.c) and not _BUILDING and not part:
        _join_group(comm, who, argname)
    if module is None:
        return comm, None
    if claim_by is not None:
        claim_by._claim(module, comm)
    broadcast_state(module, comm.c)
    return comm, TrainableAtSetup(module, who, rebuild)


def _join_group(comm: Communicator, who: str, argname: str) -> None:
    """Fault-tolerant mode over a communicator other than the job's: its ranks
    agree on their steps among themselves (mpidp/_runtime/fault_tolerant_groups.py)."""
    if comm.mpi is None:
        raise TypeError(f"{who}: {argname}: in fault-tolerant mode pass the mpi4py communicator "
                        "(this is an mpidp duplicate whose source is unknown, so its ranks' "
                        "survivors could not be found after a loss)")
    fault_tolerant_groups.join(comm.mpi)


def wait_pending(syncs: Iterable[Any]) -> None:
    """Completes every engine operation of `syncs` that is in flight (the
    core's ParamSync and its kin: `.pending`, `.wait()`); None entries are
    skipped."""
    for sync in syncs:
        if sync is not None and sync.pending:
            sync.wait()


def continue_on_survivors(survivors, old_keys) -> None:
    """Fault-tolerant mode, after a communicator shrank to its survivors
    (mpidp/fault_tolerance/recovery.py: the job's world, or a group's):
    every live driver over one of the communicators `old_keys` names
    (py2f) is set up again over
    `survivors` (`_continue_on`), or, where its algorithm cannot go on,
    detached with the reason (using it raises). Several old communicators: a
    recovery that started over (a rank lost during the rebuild) left some
    drivers over the communicator before it and some over that of its first
    round."""
    keys = set(old_keys)
    drivers = {}
    for refs in list(_CLAIMS.values()):
        for driver in (r() for r in refs):
            if driver is None or driver._released is not None or \
                    driver._claimed_key not in keys:
                continue
            # A part goes on through the driver it is a part of.
            while driver._owner is not None and driver._owner() is not None:
                driver = driver._owner()
            drivers[id(driver)] = driver
    for driver in drivers.values():
        try:
            driver._leave_old_world()
            # Growing: a replacement's script builds the driver _builds times
            # (a model wrapped twice), each construction's set-up met here.
            for _ in range(driver._builds if fault_tolerant_mode.growing() else 1):
                if fault_tolerant_mode.growing() and driver._set_up_again is not None:
                    driver._set_up_again(survivors)
                driver._continue_on(survivors)
        except NotImplementedError as why:
            driver._released = (f"a rank was lost and {driver.what} cannot continue on the "
                                f"survivors ({why}); build it again over the survivors")
            driver._remove_hooks()


def refusing_replacements() -> Tuple[List[str], List[str]]:
    """The names of the live drivers that cannot take a replacement (their
    survivors do not repeat the set-up a replacement's construction makes),
    and why, where the reason is not the driver's own (it took its module
    over from a driver that a replacement's script would build first)."""
    names, why = set(), set()
    for refs in list(_CLAIMS.values()):
        for driver in (r() for r in refs):
            if driver is not None and driver._released is None:
                while driver._owner is not None and driver._owner() is not None:
                    driver = driver._owner()
                if not driver._takes_replacements():
                    names.add(driver.what)
                elif driver._took_over is not None:
                    names.add(driver.what)
                    why.add(f"{driver.what} took its model over from {driver._took_over}: a "
                            "replacement runs the script from the top and builds that one "
                            "first, whose set-up no survivor repeats")
    return sorted(names), sorted(why)


def algorithms_over(params: Iterable[torch.Tensor]) -> List[str]:
    """The names of the live drivers whose module holds any of `params`
    (an optimizer that does its own communication refuses to run under
    them)."""
    ids = {id(p) for p in params}
    names = []
    for module, refs in list(_CLAIMS.items()):
        drivers = [r() for r in refs]
        live = [d for d in drivers if d is not None and d._released is None]
        if live and any(id(p) in ids for p in module.parameters()):
            names += [d.what for d in live if d.what not in names]
    return names


def _refuse_without_fault_tolerance(*drivers: "Driver") -> None:
    """In fault-tolerant mode, a driver that cannot go on after a rank is
    lost is refused when it is set up, not found out at the first failure.
    Every algorithm mpidp ships goes on (its driver has a _continue_on); this
    stops a driver of the program's own (a Bagua Algorithm subclass's) that
    has none."""
    if not fault_tolerant_mode.enabled():
        return
    for driver in drivers:
        if driver is not None and not driver._recovers():
            raise NotImplementedError(
                f"{driver.what}: fault-tolerant mode (MPIDP_FAULT_TOLERANCE) needs each "
                f"algorithm's driver to go on over the survivors after a loss, and "
                f"{driver.what}'s has no recovery (_continue_on(survivors)); give it one, use "
                "an algorithm of mpidp's (docs/fault-tolerance.md says how each recovers), or "
                "run without MPIDP_FAULT_TOLERANCE")


class Driver(abc.ABC):
    """One algorithm on one module over one communicator (see the module's
    docstring). Subclasses set `what` and `module`, implement _remove_hooks
    and, where they hold engines or state of their own, drain,
    algorithm_state and load_algorithm_state; they are set up by _set_up
    (or set_up, then _claim where they attach later, as DiLoCo's context)
    before they install hooks, and build the drivers they run inside
    _building_parts."""

    #: The algorithm's name in messages (the public class's name).
    what = "algorithm"
    # Why this driver no longer works (taken over, detached), else None.
    _released: Optional[str] = None
    _parts: Tuple["Driver", ...] = ()
    _owner: Optional[weakref.ref] = None     # the driver this one is a part of
    _claimed_mpi = None      # the mpi4py communicator of its claim (None: the world)
    # Set-up a wrapper ran before building this driver (with_bagua's checks
    # and optimizer broadcast), run again over the new world where
    # replacements join, ahead of _continue_on: a replacement's script runs it.
    _set_up_again: Optional[Callable[[Any], None]] = None
    # How many times a replacement's script builds this driver: once, plus
    # once per driver of its class it took its module over from while the
    # job was being built (a model wrapped twice). The survivors of a growing
    # recovery repeat its set-up as many times.
    _builds = 1
    # What it took its module over from after the job was built, or of
    # another class: a replacement's script would build that one first.
    _took_over: Optional[str] = None

    # -- the interface -----------------------------------------------------------

    def drain(self) -> None:
        """Finish the communication in flight; the parameters are then what
        the algorithm's rule makes them at this step. (By default: drain the
        parts still attached; a driver with engines of its own overrides it.)"""
        for part in self._live_parts():
            part.drain()

    @abc.abstractmethod
    def _remove_hooks(self) -> None:
        """Remove every hook this driver installed (called once, by detach)."""

    def detach(self, reason: str = "detach() detached it from its module") -> None:
        """Drain, remove every hook (the module is a plain module again) and
        give the module up; later use raises, naming `reason`."""
        if self._released is not None:
            return
        self.drain()
        self._remove_hooks()
        for part in self._parts:
            part.detach(reason)
        self._released = reason

    def algorithm_state(self) -> Dict[str, Any]:
        """The algorithm's own state (nothing by default)."""
        return {}

    def load_algorithm_state(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError(f"state: {self.what} keeps no state of its own, got keys "
                             f"{sorted(state)}")

    def join(self, *args, **kwargs):
        """Uneven inputs: algorithms that support them override this."""
        raise NotImplementedError(
            f"join: {self.what} does not support uneven inputs; give every rank the same "
            "number of batches (e.g. DistributedSampler(..., drop_last=True))")

    def _continue_on(self, comm) -> None:
        """Fault-tolerant mode: go on over `comm`, the survivors of the
        communicator this driver ran on, after the step in flight was
        discarded everywhere. Algorithms that support it override this."""
        raise NotImplementedError(f"{self.what} has no recovery (_continue_on): a program's own "
                                  "driver must go on over the survivors to run in fault-tolerant "
                                  "mode")

    def _recovers(self) -> bool:
        """Whether this driver goes on over the survivors (_continue_on)."""
        return type(self)._continue_on is not Driver._continue_on

    def _agreement_comm(self):
        """The mpi4py communicator whose ranks agree on this driver's steps in
        fault-tolerant mode: that of the driver it is a part of, where it is
        one (SlowMo's node-local DataParallel agrees with every rank SlowMo
        runs over: the job's, or a worker group's), else its own. (The
        outermost claim: a wrapper that claims nothing itself, as
        with_bagua's module, passes it on.)"""
        comm, driver = self._claimed_mpi, self
        while driver._owner is not None and driver._owner() is not None:
            driver = driver._owner()
            if driver._claimed_mpi is not None:
                comm = driver._claimed_mpi
        return comm

    def _leave_old_world(self) -> None:
        """Fault-tolerant mode, first in a recovery: end what still runs over
        the old communicators on its own (a background thread), before any
        set-up over the new ones -- its failure, raised later, would revoke
        them. (By default there is nothing.)"""

    def _takes_replacements(self) -> bool:
        """Whether recover(replace=True) can grow its job back: its
        _continue_on repeats the set-up a replacement's construction makes
        (else the two sides' collectives cross and the job ends at the
        deadline). Those that do, tested, say so."""
        return False

    def train_forward(self, *inputs, **kwargs):
        """The module's forward under this algorithm (with_bagua calls it):
        through the first attached part that is a module wrapper (a warm-up's
        DataParallel, SlowMo's wrapper), else the module's own."""
        self._check_attached()
        for part in self._live_parts():
            if isinstance(part, torch.nn.Module):
                return part.train_forward(*inputs, **kwargs)
        return self.module(*inputs, **kwargs)

    # -- for the subclasses --------------------------------------------------------

    def _set_up(self, module: torch.nn.Module, comm, settings: Dict[str, Any], rebuild: str,
                argname: str = "comm") -> Communicator:
        """set_up for this driver: claims `module` and keeps the trainable
        parameters' record as self._trainable_at_setup."""
        comm, self._trainable_at_setup = set_up(module, comm, self.what, settings, rebuild,
                                                argname, claim_by=self)
        return comm

    @contextlib.contextmanager
    def _building_parts(self):
        """Drivers created inside (this driver's own engines, e.g. SlowMo's
        node-local DataParallel) are its parts: their claims do not take the
        module over from it, and detaching it detaches them."""
        _BUILDING.append((self, []))
        try:
            yield
        finally:
            _, built = _BUILDING.pop()
            self._parts += tuple(built)

    def _live_parts(self) -> List["Driver"]:
        return [part for part in self._parts if part._released is None]

    def _check_attached(self) -> None:
        if self._released is not None:
            raise RuntimeError(f"{self.what}: this {self.what} is detached: {self._released}")

    def _claim(self, module: torch.nn.Module, comm: Communicator) -> None:
        """Make this driver `module`'s algorithm over `comm`, taking the
        module over from a live driver over the same communicator (not its owner,
        when it is built as one's part, nor one of its own parts)."""
        self._released = None
        owner = _BUILDING[-1][0] if _BUILDING else None
        _refuse_without_fault_tolerance(owner, self)
        if owner is not None:
            _BUILDING[-1][1].append(self)
            self._owner = weakref.ref(owner)
        key = comm.key
        self._claimed_key = key
        self._claimed_mpi = comm.mpi
        kept = []
        for ref in _CLAIMS.get(module, ()):
            other = ref()
            if other is None or other._released is not None or other is self:
                continue
            if other is owner or other in self._parts or key is None \
                    or other._claimed_key != key:
                kept.append(ref)
                continue
            # A part taken over takes its whole driver with it.
            while other._owner is not None and other._owner() is not None:
                other = other._owner()
            if owner is None:
                self._count_takeover(other)
            other.detach(f"a newer {self.what} of the same module over the same communicator "
                         "replaced it; use that one")
            growth = ""
            if self._took_over is not None and fault_tolerant_mode.enabled():
                growth = (f"; in fault-tolerant mode recover(replace=True) will refuse to grow "
                          f"the job back, as a replacement's script would build "
                          f"{self._took_over} first: build the algorithm you train with once, "
                          "before training, or go on with recover() alone")
            warnings.warn(f"{self.what}: this module was already wrapped by another {other.what} "
                          "over the same communicator; that one is detached (its hooks removed, "
                          "using it raises), so that the module has one algorithm per "
                          f"communicator{growth}",
                          UserWarning, stacklevel=3)
        _CLAIMS[module] = kept + [weakref.ref(self)]

    def _count_takeover(self, other: "Driver") -> None:
        """This driver took its module over from `other`: a replacement's
        script builds both (_builds), or, where `other` is of another class
        or was built after training began, cannot be met (_took_over)."""
        if type(other) is not type(self):
            self._took_over = f"a {other.what}"
        elif fault_tolerant_mode.building():
            self._builds, self._took_over = other._builds + 1, other._took_over
        else:
            self._took_over = f"another {other.what} after training began"

    def _unclaim(self, module: torch.nn.Module) -> None:
        """Give `module` up without being detached (a context left: DiLoCo)."""
        _CLAIMS[module] = [r for r in _CLAIMS.get(module, ()) if r() is not self and r() is not None]


def check_inner_optimizers(inner_optimizer) -> List[torch.optim.Optimizer]:
    """`inner_optimizer` as a list: one optimizer, or a list or tuple of
    them that together make one inner step (torch.optim.Muon for the
    matrices beside AdamW for the rest)."""
    many = isinstance(inner_optimizer, (list, tuple))
    opts = list(inner_optimizer) if many else [inner_optimizer]
    if not opts:
        raise ValueError("inner_optimizer: expected an optimizer or a non-empty list of them")
    for i, opt in enumerate(opts):
        if not isinstance(opt, torch.optim.Optimizer):
            where = f"inner_optimizer[{i}]" if many else "inner_optimizer"
            raise TypeError(f"{where}: expected a torch.optim.Optimizer, got {type(opt).__name__}")
    if len({id(p) for o in opts for g in o.param_groups for p in g["params"]}) != \
            sum(len(g["params"]) for o in opts for g in o.param_groups):
        raise ValueError("inner_optimizer: the optimizers share parameters (each parameter "
                         "must be stepped by one of them)")
    return opts


class InnerStepContext(Driver):
    """A driver that runs as a context around an inner optimizer (DiLoCo,
    SparseLoCo, MuLoCo): entering claims `self.model` over
    `self._communicator` and hooks the step of `self.inner_optimizer` (one
    optimizer, or a list that makes one inner step together: the round runs
    once each has stepped) to `_after_inner_step`, and whatever
    `_more_hooks()` returns; leaving removes them and gives the model up
    (detaching leaves too). Its algorithm state is its state_dict().
    Subclasses start `self._handles` empty."""

    def __enter__(self):
        if self._handles:
            raise RuntimeError(f"{self.what}: already entered")
        # Another algorithm of the model over the same communicator is
        # detached: both would sync every turn.
        self._claim(self.model, self._communicator)
        opts = check_inner_optimizers(self.inner_optimizer)
        if len(opts) == 1:
            self._handles.append(opts[0].register_step_post_hook(self._after_inner_step))
        else:
            stepped: set = set()
            self._handles += [opt.register_step_post_hook(self._one_of_the_inner_steps(
                i, len(opts), stepped)) for i, opt in enumerate(opts)]
        # Fault-tolerant mode: a sync that a recovery left to redo is redone
        # before the next forward (first among the forward hooks).
        if fault_tolerant_mode.enabled():
            self._handles.append(self.model.register_forward_pre_hook(
                lambda *_: self._catch_up()))
        self._handles += self._more_hooks()
        return self

    def __exit__(self, *exc) -> None:
        remove_handles(self._handles)
        self._unclaim(self.model)

    def _more_hooks(self) -> list:
        """Hooks beyond the inner step's, installed on entering (none)."""
        return []

    def _one_of_the_inner_steps(self, i: int, n: int, stepped: set):
        """The step hook of inner_optimizer[i] of n: the round runs once
        every one has stepped. One that steps again first is an error: a
        step skipped by some optimizers only (a GradScaler that found inf in
        one optimizer's gradients) would otherwise shift the rounds."""
        def hook(optimizer, args, kwargs):
            if i in stepped:
                missing = min(set(range(n)) - stepped)
                stepped.clear()
                raise RuntimeError(
                    f"{self.what}: inner_optimizer[{i}] stepped again before "
                    f"inner_optimizer[{missing}] stepped: step every inner optimizer once per "
                    "inner step (a GradScaler skips the step of an optimizer whose gradients "
                    "hold inf or NaN: skip the whole step then)")
            stepped.add(i)
            if len(stepped) == n:
                stepped.clear()
                self._after_inner_step(optimizer, args, kwargs)
        return hook

    def _after_inner_step(self, optimizer, args, kwargs) -> None:
        raise NotImplementedError

    def _catch_up(self) -> None:
        """Fault-tolerant mode: redo what the last recovery left to redo (a
        sync the loss interrupted), in the order this rank's hooks would have
        run it. Not inside recover() itself: the survivors may have been a
        step apart when the rank died (inner steps do not wait for each
        other), so each one's redo meets the others' hooks in the steps
        after it. Nothing by default."""

    def _remove_hooks(self) -> None:
        self.__exit__(None, None, None)

    def algorithm_state(self) -> Dict[str, Any]:
        return self.state_dict()

    def load_algorithm_state(self, state: Dict[str, Any]) -> None:
        self.load_state_dict(state)


class InnerStepRounds(InnerStepContext):
    """An inner-step context whose rule is a round after each inner step,
    numbered by the step (DiLoCo's sends and turns, DES-LOC's averages):
    `_round(step)`. In fault-tolerant mode a round that a loss cut short is
    redone: the subclass's recovery appends its step to `_redo_steps`, and
    _catch_up runs them before the next forward or round. Subclasses set
    `step` (0), `_round_open` (False) and `_redo_steps` ([])."""

    def _after_inner_step(self, optimizer, args, kwargs) -> None:
        self._trainable_at_setup.check()
        self._catch_up()      # where no forward came since a recovery
        self._round_open = True
        self._round(self.step)
        self._round_open = False
        self.step += 1
        fault_tolerant_mode.commit_step()

    def _round(self, step: int) -> None:
        """What the rule does after inner step `step` (0-based)."""
        raise NotImplementedError

    def _catch_up(self) -> None:
        while self._redo_steps:
            self._round(self._redo_steps[0])
            self._redo_steps.pop(0)


# -- what a copy of a wrapper is -------------------------------------------------------------
#
# copy.deepcopy(net) and torch.save(net) of a DataParallel, DataParallelMultiGPU,
# SlowMoDistributedDataParallel or with_bagua module cannot carry its
# communicators, buffers in flight and hooks (torch DDP's copies rebuild
# themselves on the default process group; a copy that joined the averaging
# would be collective on some ranks only). The copy is a WrapperCopy instead:
# the copied model in `.module`, with nothing of mpidp on it, usable for
# evaluation and inference (an EMA of the wrapper, a snapshot of the best model,
# a saved checkpoint loaded elsewhere). A training forward of it raises, naming
# the way to train the copy: wrap `copy.module` again.

class WrapperCopy(torch.nn.Module):
    """A copy of the wrapper named `copy_of`, holding the copied model in
    `.module`; forward runs that model, outside training (eval() or
    torch.no_grad())."""

    def __init__(self, copy_of: str, module: torch.nn.Module, training: bool = True):
        super().__init__()
        self.copy_of = copy_of
        self.module = module
        self.train(training)

    def forward(self, *inputs, **kwargs):
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(
                f"this is a copy of a mpidp.{self.copy_of} (copy.deepcopy, or torch.save and "
                "torch.load), which does not communicate: a training forward of it would train "
                "this rank's copy alone. Use it in eval() or under torch.no_grad(), or train the "
                f"copy by wrapping its model again: mpidp.{self.copy_of}(copy.module, ...)")
        return self.module(*inputs, **kwargs)

    def extra_repr(self) -> str:
        return f"copy_of={self.copy_of!r}"


def reduce_wrapper(wrapper: torch.nn.Module, model: torch.nn.Module):
    """The __reduce_ex__ of a wrapper of `model`: it pickles and copies as a
    WrapperCopy of `model`."""
    return WrapperCopy, (type(wrapper).__name__, model, wrapper.training)
