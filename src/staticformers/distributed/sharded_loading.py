"""`from_pretrained(..., distributed_config=...)`: a model partitioned at load time, read shard by shard.

Order, per rank: check the layout, start the process group, build the model on the meta device,
partition it (`parallelize`: tensor parallel, then FSDP2), allocate only this rank's shards
(`to_empty`), then fill them with `torch.distributed.checkpoint.load` through PyTorch's
`HuggingFaceStorageReader` (DCP plans each rank's slices in any layout), whose reading is replaced
by plain row-ranged reads (reader.py: no memory map inflating RSS; a mixture's per-expert tensors
planned as chunks of its stacked experts): no rank ever holds the whole model. The headers are
checked first so that a checkpoint that does not fit the config gets the same sentences as a
single-process load.

A quantized model (weight-only int8 / fp8: a compressed-tensors checkpoint, or `quantization_config` asked
for at load) is read whole on each rank first (`load_quantized`: the one-process load, quantising if asked),
then tensor parallel shards it by the same plan: a colwise projection's int8 rows and their per-row scales
split together (`Shard(0)` on both), a rowwise one's int8 columns split and its scales replicated (one per
output channel, which every rank computes). So each rank holds the whole model while it loads; data
parallelism (FSDP) and expert parallelism over a quantized model are refused.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from ..models.model_config import ModelConfig
from ..backends.devices import dist_backend_for
from ..checkpoints.compressed_tensors import scheme_of
from ..models.pretrained import CheckpointError, checkpoint_layout, load_weights
from ..models.quantization import prepare_for_checkpoint, quantize_model
from ..models.decoder import CausalLM
from .distributed_config import DistributedConfig, started_by_torchrun
from .mesh import build_mesh, init_distributed, local_device
from .parallelize import parallelize

logger = logging.getLogger("staticformers")


def read_sharded(model: CausalLM, files: list[str], layout=None) -> None:
    """Fill the model's (already allocated, possibly sharded) parameters with their slices of the files
    (`layout`: the files' names -> the parameters' pieces, `loading.checkpoint_layout`; computed if None)."""
    import torch.distributed.checkpoint as dcp

    from .reader import SlicedSafetensorsReader

    state = {
        k: v for k, v in model.state_dict().items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")
    }
    folders = {os.path.dirname(os.path.abspath(f)) for f in files}
    if len(folders) != 1:
        raise CheckpointError(f"The checkpoint's shards lie in {len(folders)} folders: put them in one folder.")
    if layout is None:
        layout = checkpoint_layout(model, files)[0]
    dcp.load(state, storage_reader=SlicedSafetensorsReader(folders.pop(), files, layout))


def load_distributed(
    config: ModelConfig,
    files: list[str],
    dtype: torch.dtype,
    distributed_config: DistributedConfig,
    device_map=None,
    model_class: type = CausalLM,
    quantization=None,
) -> CausalLM:
    """The model of `config` (a `model_class`), partitioned by `distributed_config` over this torchrun job,
    weights loaded. Its `parallel_dims` says how; saving and training read it from there. A quantized
    checkpoint, or `quantization` (a `QuantizationConfig`) asked for, goes through `load_quantized`."""
    if not isinstance(distributed_config, DistributedConfig):
        raise TypeError(
            f"distributed_config must be a staticformers DistributedConfig, not {type(distributed_config).__name__}."
        )
    layout = distributed_config.resolved()
    layout.check_model(config)
    device = local_device(device_map)
    if quantization is not None or scheme_of(config.extra) is not None:
        return load_quantized(config, files, dtype, layout, device, model_class, quantization)
    if layout.tp_size * layout.dp_size == 1 and not dist.is_initialized() and not started_by_torchrun():
        logger.info("DistributedConfig with one rank outside torchrun: loading the model whole on %s", device)
        with torch.device("meta"):
            model = model_class(config)
        load_weights(model, files, device, dtype)
        return model
    init_distributed(device)
    dims = build_mesh(layout, device)
    with torch.device("meta"):
        model = model_class(config).to(dtype)
    layout, where = checkpoint_layout(model, files)  # every header checked before anything is read
    if any(name.endswith("_scales") for name in where if name not in layout):
        raise CheckpointError(
            "This checkpoint stores its experts in MXFP4, which a partitioned load does not read: "
            "load it in one process and save_pretrained() it (dequantised), then load that copy."
        )
    parallelize(model, dims, dist_backend_for(device))
    model.to_empty(device=device)
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.tie_weights()  # to_empty swaps unsharded parameters one module at a time, untying them
    read_sharded(model, files, layout)
    model.model.reset_rope(device)
    return model


def load_quantized(
    config: ModelConfig,
    files: list[str],
    dtype: torch.dtype,
    layout: DistributedConfig,
    device: torch.device,
    model_class: type,
    quantization=None,
) -> CausalLM:
    """A quantized model read whole on this rank (as stored, or quantised as `quantization` asks), then
    sharded by tensor parallel only (see the module docstring): int8 weights and their scales together."""
    if layout.dp_size > 1 or layout.ep_size > 1:
        raise ValueError(
            f"A quantized model composes with tensor parallelism only (here dp_size={layout.dp_size}, "
            f"ep_size={layout.ep_size}): use DistributedConfig(tp_size=N) alone, or load the "
            f"unquantized checkpoint to train with FSDP or expert parallelism."
        )
    with torch.device("meta"):
        model = model_class(config)
    scheme = scheme_of(config.extra)
    if scheme is not None:
        with torch.device("meta"):
            prepare_for_checkpoint(model, scheme)
    load_weights(model, files, device, dtype)
    if quantization is not None:
        quantize_model(model, quantization)
    if layout.tp_size == 1 and not dist.is_initialized() and not started_by_torchrun():
        return model
    init_distributed(device)
    dims = build_mesh(layout, device)
    parallelize(model, dims, dist_backend_for(device))
    return model


__all__ = ["load_distributed", "load_quantized", "read_sharded"]
