"""DataParallelOptimizer: the optimizer side of DataParallel (Heat's API)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["DataParallelOptimizer"]


class DataParallelOptimizer:
    """Wraps a torch optimizer for use with :class:`mpidp.DataParallel`.

    Parameters
    ----------
    torch_optimizer : torch.optim.Optimizer
        The optimizer that updates the local model.
    blocking : bool
        Blocking parameter updates; DataParallel sets this to its own mode.

    With blocking updates `step()` steps the torch optimizer at once. With
    non-blocking updates `step()` only marks the update as due; DataParallel
    applies it layer by layer during the next forward pass, as each layer's
    averaged gradients arrive.
    """

    def __init__(self, torch_optimizer: torch.optim.Optimizer, blocking: bool = False):
        if isinstance(torch_optimizer, DataParallelOptimizer):
            raise TypeError("torch_optimizer: got a DataParallelOptimizer; pass the torch "
                            "optimizer it wraps (its .torch_optimizer)")
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            raise TypeError("torch_optimizer: expected a torch.optim.Optimizer, got "
                            f"{type(torch_optimizer).__name__}")
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking: expected a bool, got {type(blocking).__name__}")
        self.torch_optimizer = torch_optimizer
        self.blocking_parameter_updates = blocking
        # The mpidp.DataParallel that steps this optimizer (set when it is
        # wrapped with one), else None: step() then steps the torch optimizer.
        self.data_parallel = None

    @property
    def update_next(self) -> bool:
        """Heat's flag: a non-blocking step() was called and its update is
        applied during the next forward."""
        return self.data_parallel is not None and self.data_parallel.update_pending

    # Heat's name for the flag that DataParallel overwrites.
    @property
    def blocking(self) -> bool:
        return self.blocking_parameter_updates

    def step(self) -> None:
        """Update the parameters (now if blocking, else during the next forward)."""
        if self.data_parallel is not None:
            self.data_parallel.optimizer_step(self)
        else:
            self.torch_optimizer.step()

    def synchronize(self) -> None:
        """Have the averaged gradients in `.grad` now (Horovod's name), for code
        that reads or edits them before `step()`: gradient clipping, logging
        gradient norms, AMP's ``unscale_``. In non-blocking mode backward only
        starts the averaging and `.grad` holds zeros until the next forward;
        this waits for it, so the step that follows is applied at once, like a
        blocking one. Nothing to do in blocking mode::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

        Reading `param_groups` between backward and step (GradScaler's
        ``unscale_`` and step do) synchronizes too."""
        if self.data_parallel is not None:
            self.data_parallel.synchronize_gradients()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod compatibility: `step()` after `synchronize()` never averages
        again, so this context only marks the intent."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the optimizer's parameters. With non-blocking
        updates it may come before the pending update is applied: DataParallel
        notices, applies the update with the averaged gradients, and leaves
        `.grad` cleared as asked."""
        self.torch_optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        # Whoever reads the groups between backward and step may read the
        # gradients in them (GradScaler.unscale_, hand-written clipping).
        if self.data_parallel is not None:
            self.data_parallel.synchronize_gradients()
        return self.torch_optimizer.param_groups

    @property
    def state(self):
        return self.torch_optimizer.state

    @property
    def defaults(self) -> dict:
        return self.torch_optimizer.defaults

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group on the wrapped optimizer (fine-tuning
        recipes add the layers they unfreeze, schedulers read the groups).
        The tensors added must be parameters DataParallel averages -- trainable
        parameters of the wrapped model when it was set up -- else the next
        step() raises: their gradients would be each rank's own."""
        self.torch_optimizer.add_param_group(param_group)

    def state_dict(self):
        if self.data_parallel is not None:
            self.data_parallel.synchronize()
        return self.torch_optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        if self.data_parallel is not None:
            self.data_parallel.synchronize()
        self.torch_optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        mode = "blocking" if self.blocking_parameter_updates else "non-blocking"
        return f"DataParallelOptimizer({mode}, {self.torch_optimizer!r})"
