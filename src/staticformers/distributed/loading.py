"""`from_pretrained(..., distributed_config=...)`: a model partitioned at load time, read shard by shard.

Order, per rank: check the layout, start the process group, build the model on the meta device,
partition it (`parallelize`: tensor parallel, then FSDP2), allocate only this rank's shards
(`to_empty`), then fill them with `torch.distributed.checkpoint.load` through PyTorch's
`HuggingFaceStorageReader` (DCP plans each rank's slices in any layout), whose reading is replaced
by plain row-ranged reads (reader.py: no memory map inflating RSS): no rank ever holds the whole
model. The headers are
checked first so that a checkpoint that does not fit the config gets the same sentences as a
single-process load.
"""

from __future__ import annotations

import logging
import os
import types

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..devices import dist_backend_for
from ..loading import _IGNORED_KEYS, CheckpointError, _names, load_weights
from ..modeling import CausalLM
from .checkpoint import save_pretrained_distributed
from .config import DistributedConfig, started_by_torchrun
from .mesh import build_mesh, init_distributed, local_device
from .parallelize import parallelize

logger = logging.getLogger("staticformers")


def check_headers(model: CausalLM, files: list[str]) -> None:
    """Every weight the model needs is in the files, with the right shape, and nothing extra."""
    from safetensors import safe_open

    expected = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    tied = model.config.tie_word_embeddings
    if tied:
        expected.pop("lm_head.weight", None)
    seen, unexpected = set(), []
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name not in expected:
                    if not (_IGNORED_KEYS.match(name) or (tied and name == "lm_head.weight")):
                        unexpected.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(
                        f"Weight {name} in {os.path.basename(path)} has shape {list(shape)} but config.json implies "
                        f"{list(expected[name])}: the config and the weights come from different models."
                    )
                seen.add(name)
    if unexpected:
        raise CheckpointError(
            f"The checkpoint has {len(unexpected)} weight(s) this {model.config.architecture} does not use: "
            f"{_names(unexpected)}: the config and the weights come from different models."
        )
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(
            f"The checkpoint lacks {len(missing)} weight(s) that {model.config.architecture} needs: {_names(missing)}: "
            f"a shard may be missing or the config may not match the weights."
        )


def read_sharded(model: CausalLM, files: list[str]) -> None:
    """Fill the model's (already allocated, possibly sharded) parameters with their slices of the files."""
    import torch.distributed.checkpoint as dcp

    from .reader import SlicedSafetensorsReader

    state = {k: v for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    folders = {os.path.dirname(os.path.abspath(f)) for f in files}
    if len(folders) != 1:
        raise CheckpointError(f"The checkpoint's shards lie in {len(folders)} folders: put them in one folder.")
    dcp.load(state, storage_reader=SlicedSafetensorsReader(folders.pop(), files))


def load_distributed(config: ModelConfig, files: list[str], dtype: torch.dtype,
                     distributed_config: DistributedConfig, device_map=None) -> CausalLM:
    """The model of `config`, partitioned by `distributed_config` over this torchrun job, weights loaded."""
    if not isinstance(distributed_config, DistributedConfig):
        raise TypeError(f"distributed_config must be a staticformers DistributedConfig, not {type(distributed_config).__name__}.")
    layout = distributed_config.resolved()
    layout.check_model(config)
    device = local_device(device_map)
    if layout.tp_size * layout.dp_size == 1 and not dist.is_initialized() and not started_by_torchrun():
        logger.info("DistributedConfig with one rank outside torchrun: loading the model whole on %s", device)
        with torch.device("meta"):
            model = CausalLM(config)
        load_weights(model, files, device, dtype)
        return model
    init_distributed(device)
    dims = build_mesh(layout, device)
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)
    check_headers(model, files)
    parallelize(model, dims, dist_backend_for(device))
    model.to_empty(device=device)
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.tie_weights()  # to_empty swaps unsharded parameters one module at a time, untying them
    read_sharded(model, files)
    rotary = model.model.rotary_emb
    rotary.inv_freq = torch.empty(0, device=device)
    rotary.reset_parameters()
    # every rank calls save_pretrained (collectives); rank 0 alone writes
    model.save_pretrained = types.MethodType(save_pretrained_distributed, model)
    return model


__all__ = ["load_distributed", "check_headers", "read_sharded"]
