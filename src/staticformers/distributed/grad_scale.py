"""An identity whose gradient is multiplied by a constant: how a partitioned model's gradients are put on
the scale of one process when a collective averages over a different number of ranks than the loss
was summed over (the Trainer's loss under FSDP2's average, `training/partitioned.py`; experts sharded over
fewer ranks than the other parameters, `expert_parallel.py`)."""

from __future__ import annotations

import torch


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient is multiplied by `factor`."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


__all__ = ["ScaleGrad"]
