"""What a copy of one of mpidp's wrappers is.

copy.deepcopy(net) and torch.save(net) of a DataParallel, DataParallelMultiGPU,
SlowMoDistributedDataParallel or with_bagua module cannot carry its
communicators, buffers in flight and hooks (torch DDP's copies rebuild
themselves on the default process group; a copy that joined the averaging
would be collective on some ranks only). The copy is a WrapperCopy instead:
the copied model in `.module`, with nothing of mpidp on it, usable for
evaluation and inference (an EMA of the wrapper, a snapshot of the best model,
a saved checkpoint loaded elsewhere). A training forward of it raises, naming
the way to train the copy: wrap `copy.module` again."""

from __future__ import annotations

import torch

__all__ = ["WrapperCopy"]


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
