"""Horovod's SyncBatchNorm: batch statistics over every rank's batch.

The per-channel sums travel through the differentiable allreduce (Sum), so
autograd gives each rank's input the gradient of the sum of every rank's
loss, as torch's and Horovod's SyncBatchNorm do. The statistics are summed
in float64 (a sum of squares in float32 loses the variance of large
activations). Works on CPU and GPU tensors, unlike torch.nn.SyncBatchNorm."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .. import _basics
from .mpi_ops import Sum, allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the batches of every Horovod rank (eval
    mode, or one rank: the ordinary BatchNorm)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training or _basics.size() == 1:
            return super().forward(input)
        c = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        x = input.double()
        local = torch.cat([x.sum(dims), (x * x).sum(dims),
                           x.new_tensor([input.numel() // c])])
        total = allreduce(local, op=Sum, name=None)
        n = total[-1]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                     else self.momentum)
                unbiased = var.detach() * (n / (n - 1))
                self.running_mean.mul_(1 - m).add_(mean.detach().to(self.running_mean.dtype), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        out = out.to(input.dtype)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out
