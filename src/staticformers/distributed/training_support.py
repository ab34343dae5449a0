"""What a training loop (the Trainer, or a hand-written one) needs from a partitioned model.

The Trainer keeps device detection, data sampling, loss reduction and gradient clipping as
overridable pieces; these are the distributed versions it calls when `model.parallel_dims` is set:

- `data_parallel_info`: (rank, size) of the data shard; ranks that differ only in tp share a shard.
- `distributed_sampler`: a deterministic `DistributedSampler` over those shards.
- `reduce_mean`: a loss or metric averaged over the data-parallel ranks (for logging).
- `clip_grad_norm_`: clipping that is correct when gradients live on different meshes (2-D
  TP x FSDP weights beside 1-D FSDP-only weights, ARCHITECTURE.md): the norm is computed per
  (mesh, placements) group with DTensor, combined, and the gradients' local shards are scaled.
"""

from __future__ import annotations

import math
from typing import Iterable, Union

import torch
import torch.distributed as dist
from torch import nn


def parallel_dims(model: nn.Module):
    """The model's ParallelDims (its declared `parallel_dims`), or None for a single-process model."""
    return model.parallel_dims


def is_distributed(model: nn.Module) -> bool:
    return parallel_dims(model) is not None


def data_parallel_info(model: nn.Module) -> tuple[int, int]:
    """(dp_rank, dp_size): which distinct batch shard this rank trains on, and how many there are."""
    dims = parallel_dims(model)
    if dims is None:
        return 0, 1
    return dims.dp_rank, dims.dp


def distributed_sampler(dataset, model: nn.Module, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
    """A DistributedSampler over the data-parallel shards (same rows for every tp rank of a shard)."""
    from torch.utils.data import DistributedSampler

    rank, size = data_parallel_info(model)
    return DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)


def reduce_mean(value: Union[torch.Tensor, float], model: nn.Module) -> torch.Tensor:
    """`value` averaged over the data-parallel ranks (a detached copy; unchanged on one process)."""
    dims = parallel_dims(model)
    t = torch.as_tensor(value, dtype=torch.float32).detach().clone()
    if dims is None or dims.dp == 1:
        return t
    device = next(iter(model.parameters())).device
    t = t.to(device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=dims.dp_group())
    return t / dims.dp


def reduce_sum(value: Union[torch.Tensor, int, float], model: nn.Module) -> torch.Tensor:
    """`value` summed over the data-parallel ranks (for instance the number of label tokens in a step)."""
    dims = parallel_dims(model)
    t = torch.as_tensor(value).detach().clone()
    if dims is None or dims.dp == 1:
        return t
    t = t.to(next(iter(model.parameters())).device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=dims.dp_group())
    return t


def _group_key(grad: torch.Tensor):
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor):
        return (grad.device_mesh, tuple(grad.placements))
    return None


@torch.no_grad()
def grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm of possibly sharded parameters, as a plain tensor on every rank."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(_group_key(p.grad), []).append(p.grad)
    norm_type = float(norm_type)
    parts = []
    for grads in groups.values():
        norms = torch._foreach_norm(grads, norm_type)
        total = torch.linalg.vector_norm(torch.stack(list(norms)), norm_type)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        parts.append(total.float())
    if not parts:
        return torch.tensor(0.0)
    device = parts[0].device
    stacked = torch.stack([p.to(device) for p in parts])
    return stacked.max() if math.isinf(norm_type) else torch.linalg.vector_norm(stacked, norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a TP x FSDP model: returns the total norm before clipping."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    locals_ = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    if locals_:
        torch._foreach_mul_(locals_, coef.to(locals_[0].device))
    return total


__all__ = [
    "parallel_dims",
    "is_distributed",
    "data_parallel_info",
    "distributed_sampler",
    "reduce_mean",
    "reduce_sum",
    "grad_norm",
    "clip_grad_norm_",
]
