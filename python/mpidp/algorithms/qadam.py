"""Bagua's QAdam: `QAdamOptimizer` and `QAdamAlgorithm` (mpidp.algorithms).

For `warmup_steps` steps the optimizer is torch's Adam (its own code) on the
gradients QAdamAlgorithm averages over the ranks. From then on the second
moment v is frozen, each rank updates its first moment with its own gradient,
m_i = b1 m_i + (1 - b1) g_i, the ranks' m are averaged in 8 bits (the
quantized allreduce), and x -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps).

Two quirks of Bagua's implementation are not copied: its step at
t = warmup_steps drops the gradient (here it is an ordinary Adam step), and its
weight decay vanishes after the warm-up (here g_i + weight_decay * x enters the
momentum throughout, as in Adam).

With `hierarchical` (default True, as Bagua's) both averages go node first:
the warm-up's gradients as DataParallel(hierarchical=True) does, and the
momentum by a float32 reduce-scatter within the node, the 8-bit average of
each local rank's slice with its counterparts on the other nodes, and an
allgather within the node -- only the cross-node exchange is quantized, and
each local rank carries 1/L of its bytes. With one rank per node, or one
node, that cannot help: a warning, and the flat 8-bit average over all ranks.

In fault-tolerant mode a step past the warm-up is a transaction: the new
momenta are computed and averaged into buffers, every rank agrees that every
rank lived through the step, and only then are the momenta, step counts and
parameters written (a step a rank's death cut short is applied by none).
"""

from __future__ import annotations

import warnings

import torch

from .._runtime import fault_tolerant_mode
from .bagua.algorithm import Algorithm
from .._runtime.args import check_bool, check_int, check_real
from .._runtime.model_consistency import check_same_step, param_group_settings
from .driver import Driver
from .._runtime.mpi import communicator
from .._runtime.flat_buffers import flatten, write_back
from ..collectives.tensors import allgather, allreduce_agreed, reduce_scatter_agreed
from .data_parallel import DataParallel
from .._runtime.topology import nodes_are_even, useful_hierarchy

__all__ = ["QAdamOptimizer", "QAdamAlgorithm"]


class QAdamOptimizer(torch.optim.Adam):
    """Adam for the warm-up, then Adam with a frozen second moment and an
    8-bit averaged first moment (see the module's docstring). Its step count
    ("qadam_step" in every param group) travels in its state_dict.

    params: the parameters (or param groups) as for torch.optim.Adam; lr,
    betas, eps, weight_decay: Adam's (weight decay keeps applying after the
    warm-up, unlike Bagua's); warmup_steps: steps of plain Adam on averaged
    gradients before the second moment is frozen."""

    def __init__(self, params, lr: float = 1e-3, warmup_steps: int = 100,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        # At least one warm-up step: the frozen second moment comes from it.
        check_int("warmup_steps", warmup_steps, 1)
        check_real("lr", lr, 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"betas: expected a pair of numbers, got {betas!r}")
        for i, beta in enumerate(betas):
            check_real(f"betas[{i}]", beta, 0.0, 1.0, high_open=True)
        check_real("eps", eps, 0.0)
        check_real("weight_decay", weight_decay, 0.0)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.warmup_steps = warmup_steps
        for group in self.param_groups:
            group.setdefault("qadam_step", 0)
        self._handle = None      # the QAdamAlgorithm attached to it (with_bagua)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self.param_groups[0]["qadam_step"] + 1
        if t > self.warmup_steps and self._handle is None:
            raise RuntimeError("QAdamOptimizer: past its warm-up it averages the momentum over the "
                               "ranks: train through mpidp.with_bagua(model, [optimizer], "
                               "mpidp.algorithms.QAdamAlgorithm(optimizer))")
        if t <= self.warmup_steps:
            super().step()
        else:
            self._handle.check_step(t)
            self._compressed_step()
        # Counted once the step is applied (a step cut short by a lost rank is not).
        for group in self.param_groups:
            group["qadam_step"] = t
        if t == self.warmup_steps and self._handle is not None:
            self._handle.end_warmup()    # from now on the gradients stay local
        return loss

    def _compressed_step(self) -> None:
        # (param, its state, its group, its new first moment) of the
        # parameters Adam stepped. In fault-tolerant mode the new moments go
        # into buffers of their own, written into the state once every rank
        # agreed; otherwise they are updated in place (no allocation a step).
        transaction = fault_tolerant_mode.enabled()
        stepped = []
        for group in self.param_groups:
            b1 = group["betas"][0]
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue  # never had a gradient on any rank during the warm-up
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                if group["weight_decay"]:
                    grad = grad.add(p, alpha=group["weight_decay"])
                moment = state["exp_avg"].mul(b1) if transaction else state["exp_avg"].mul_(b1)
                stepped.append((p, state, group, moment.add_(grad, alpha=1 - b1)))
        if stepped:
            momenta = [m for *_, m in stepped]
            write_back(self._handle.average_momentum(flatten(momenta)), momenta)
        # Fault-tolerant mode: applied by every rank (of the job, or of the
        # worker group QAdam runs over) or by none.
        fault_tolerant_mode.step_boundary(self._handle.mpi_comm)
        for p, state, group, moment in stepped:
            state["exp_avg"] = moment
            state["step"] += 1
            b1, b2 = group["betas"]
            t = float(state["step"])
            denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt().add_(group["eps"])
            p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** t))


class _QAdamHandle(Driver):
    what = "QAdamAlgorithm"

    def __init__(self, module, optimizer: QAdamOptimizer, comm, hierarchical: bool):
        self.module, self.opt, self.comm = module, optimizer, comm
        handle = communicator(comm)
        self._c_comm, self.mpi_comm = handle.c, handle.mpi
        warming_up = optimizer.param_groups[0]["qadam_step"] < optimizer.warmup_steps
        # (node, cross-node) communicators of the momentum's average; in the
        # warm-up DataParallel warns where the hierarchy cannot help.
        self.hierarchy = useful_hierarchy(comm, "QAdamAlgorithm", "averaging the momentum flat",
                                          warn=not warming_up, stacklevel=4) \
            if hierarchical else None
        self.dp = None
        self._claim(module, handle)
        if warming_up:
            with self._building_parts():
                self.dp = DataParallel(module, comm, blocking_parameter_updates=True,
                                       hierarchical=hierarchical)
        optimizer._handle = self

    def check_step(self, t: int) -> None:
        """Every rank takes its t-th step with the same settings: a rank that
        loaded another step's optimizer state alone (or whose lr differs)
        would average its momentum with the others' and apply it with its own
        step count, second moment or lr, and the models would drift apart with
        no error."""
        check_same_step(self._c_comm, t, "QAdamOptimizer",
                        param_group_settings(self.opt.param_groups))

    def average_momentum(self, flat: torch.Tensor) -> torch.Tensor:
        """The ranks' mean of `flat` (every rank's momenta, concatenated),
        8-bit quantized across the nodes (see the module's docstring)."""
        if self.hierarchy is None:
            allreduce_agreed(flat, op="avg", comm=self.comm, wire_dtype=torch.uint8)
            return flat
        node, cross = self.hierarchy
        part = reduce_scatter_agreed(flat, op="avg", comm=node)
        allreduce_agreed(part, op="avg", comm=cross, wire_dtype=torch.uint8)
        return allgather(part, comm=node)

    def _takes_replacements(self) -> bool:
        # A replacement's with_bagua set-up gives it rank 0's optimizer state
        # first, so it builds the warm-up's DataParallel exactly where the
        # survivors still have theirs.
        return True

    def _continue_on(self, comm) -> None:
        """Fault-tolerant mode, after a rank was lost (mpidp.recover()): the
        step in flight was applied by no survivor, so the replicas and their
        averaged momenta are equal; the averages go on over the survivors --
        flat, with a warning, where their nodes now hold different numbers of
        ranks."""
        if self.dp is not None:
            self.dp._continue_on(comm)
        # Claimed after its part, which is kept (a claim first would be
        # taken over by the part's over the same communicator).
        handle = communicator(comm)
        self._claim(self.module, handle)
        self.comm, self._c_comm, self.mpi_comm = comm, handle.c, handle.mpi
        if self.hierarchy is not None:
            # Growing back: the launch's size again, and the replacement's
            # set-up (matched call for call) asks nothing of the nodes.
            if fault_tolerant_mode.growing() or nodes_are_even(comm):
                self.hierarchy = useful_hierarchy(comm, "QAdamAlgorithm",
                                                  "averaging the momentum flat", stacklevel=3)
            else:
                warnings.warn("QAdamAlgorithm: after the loss of ranks the nodes hold different "
                              "numbers of ranks; averaging the momentum flat from now on",
                              stacklevel=3)
                self.hierarchy = None
        for p in self.module.parameters():     # the cut-short step's
            p.grad = None

    def end_warmup(self) -> None:
        if self.dp is not None:
            self.dp.remove_hooks()
            self.dp = None

    def _remove_hooks(self) -> None:
        self.end_warmup()
        if self.opt._handle is self:
            self.opt._handle = None
    # The step count is the optimizer's (its state_dict): no algorithm state.


class QAdamAlgorithm(Algorithm):
    """QAdam (see the module's docstring); `q_adam_optimizer` must be the
    QAdamOptimizer that steps the wrapped module.

    hierarchical: average the momentum within each node in float32 first, and
    only across nodes in 8 bits (each local rank carries a slice)."""

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True):
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise TypeError("q_adam_optimizer: expected an mpidp.algorithms.QAdamOptimizer, got "
                            f"{type(q_adam_optimizer).__name__}")
        check_bool("hierarchical", hierarchical)
        self.optimizer = q_adam_optimizer
        self.hierarchical = hierarchical

    def attach(self, module, optimizers, comm):
        if not any(o is self.optimizer for o in optimizers):
            raise ValueError("optimizers: expected them to include the QAdamAlgorithm's "
                             "q_adam_optimizer")
        return _QAdamHandle(module, self.optimizer, comm, self.hierarchical)
