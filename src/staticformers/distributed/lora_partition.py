"""LoRA adapters on a model partitioned by `DistributedConfig`: tensor parallel and FSDP2 for their weights.

Why this exists: `add_adapter` on a model loaded with `distributed_config` creates full-size adapter
weights (the same values on every rank: rank 0's are broadcast), which must then follow the
partition the base already has. In the order `parallelize.py` applies, after the fact:

1. tensor parallel, from the base's style in the family's plan (`LoraLinear.tensor_parallel_plan`): a
   column-wise base (q/k/v, gate/up) gets B split like itself (`ColwiseParallel`: each rank adds its
   own output columns) and A whole; a row-wise base (o/down) gets A split over its input columns
   (`RowwiseParallel`: the rank-r partial products are all-reduced) and B whole. DTensor sums the
   gradient of A's replicated output over the tp ranks itself;
2. FSDP2: each decoder layer's new adapter modules are sharded as one group over the data-parallel
   mesh (`fully_shard` on the list), with the base's mixed precision and offload settings.

Both happen before the first forward (FSDP2's root then finds every group). Saving gathers each
adapter weight (`full_tensor`, every rank) and rank 0 writes PEFT's files.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..adapters.files import adapter_tensors, save_adapter, saved_adapter
from ..adapters.lora import LoraLinear
from .parallelize import _matches, fsdp_kwargs, resolve_tp_plan

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def _layer_of(name: str) -> str:
    """The decoder layer a module belongs to ("model.layers.3")."""
    parts = name.split(".")
    return ".".join(parts[:3])


def partition_adapters(model: nn.Module, layers: dict[str, LoraLinear]) -> None:
    """Give the new adapters of `layers` (name -> LoraLinear) the model's partition (see the module docstring)."""
    dims = model.parallel_dims
    if dist.is_initialized():
        with torch.no_grad():
            for layer in layers.values():
                for p in list(layer.lora_A.parameters()) + list(layer.lora_B.parameters()):
                    if not hasattr(p, "device_mesh"):  # a new (full, local) weight
                        dist.broadcast(p.data, src=0)
    new = {
        name: [
            (part, n)
            for part in ("lora_A", "lora_B")
            for n in getattr(layer, part)
            if not hasattr(getattr(layer, part)[n].weight, "device_mesh")
        ]
        for name, layer in layers.items()
    }
    if dims.tp > 1:
        chosen = _matches(resolve_tp_plan(model.config, dims.config), model)
        for name, layer in layers.items():
            style = chosen.get(name)
            for relative, part_style in layer.tensor_parallel_plan(style).items():
                part, _, adapter = relative.partition(".")
                if part in ("lora_A", "lora_B") and (part, adapter) in new[name] and part_style in _STYLES:
                    parallelize_module(getattr(layer, part)[adapter], dims.tp_mesh, _STYLES[part_style]())
    if dims.dp > 1:
        from torch.distributed.fsdp import fully_shard

        kwargs = fsdp_kwargs(model, dims)
        groups: dict[str, list] = {}
        for name, layer in layers.items():
            groups.setdefault(_layer_of(name), []).extend(getattr(layer, part)[n] for part, n in new[name])
        for modules in groups.values():
            if modules:
                sharded = fully_shard(modules, **kwargs)
                if dist.get_backend() == "gloo":  # no PREMUL_SUM on gloo (parallelize.apply_fsdp)
                    first = sharded[0] if isinstance(sharded, list) else sharded
                    first.set_force_sum_reduction_for_comms(True)


def save_adapter_distributed(model: nn.Module, directory: str) -> None:
    """Every rank calls this: the active adapter's weights are gathered, rank 0 writes PEFT's files."""
    name = saved_adapter(model)
    weights = adapter_tensors(model, name)  # full_tensor() on every rank, in the same order
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_adapter(model, directory, name, weights=weights)
    if dist.is_initialized():
        dist.barrier()


__all__ = ["partition_adapters", "save_adapter_distributed"]
