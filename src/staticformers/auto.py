"""`AutoModelForCausalLM` and the model class it returns: the architecture with loading, saving and generation.

`modeling.CausalLM` is the architecture alone and imports nothing above it. `ModelForCausalLM` adds
what users call on a model the transformers way (`from_pretrained`, `save_pretrained`, `generate`,
`compile_stats`), each delegating to its module: loading (`loading.py`, or `distributed/loading.py`
for a model partitioned at load time), saving (the distributed save gathers on rank 0 when the model
is partitioned: `parallel_dims` says so), generation (`generation/api.py`). Data flows one way:
config -> model -> loading -> engine; nothing below this module imports it.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from .config import ModelConfig, parse_dtype
from .devices import resolve_device
from .loading import finish_loading, load_model, resolve
from .loading import save_pretrained as save_checkpoint_folder
from .memory_check import check_fits
from .modeling import CausalLM
from .seeds import check_seed


class ModelForCausalLM(CausalLM):
    """A causal LM as `from_pretrained` returns it (see the module docstring)."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> "ModelForCausalLM":
        return from_pretrained(*args, model_class=cls, **kwargs)

    def save_pretrained(self, save_directory: Union[str, os.PathLike], max_shard_size: Union[int, str] = "5GB",
                        **kwargs) -> None:
        """Write a Hugging Face checkpoint (transformers loads it). A partitioned model: every rank calls
        this, rank 0 writes the gathered weights."""
        if self.parallel_dims is not None:
            from .distributed.checkpoint import save_pretrained_distributed

            save_pretrained_distributed(self, save_directory, max_shard_size=max_shard_size, **kwargs)
        else:
            save_checkpoint_folder(self, save_directory, max_shard_size=max_shard_size, **kwargs)

    def generate(self, *args, **kwargs):
        from .generation.api import generate

        return generate(self, *args, **kwargs)

    def compile_stats(self) -> list[dict]:
        from .generation.api import compile_stats

        return compile_stats(self)


def from_pretrained(
    pretrained_model_name_or_path: Union[str, os.PathLike],
    *,
    device_map: Union[str, int, torch.device, None] = None,
    distributed_config=None,
    model_class: type = ModelForCausalLM,
    **kwargs,
) -> ModelForCausalLM:
    """Load a causal LM from a folder or Hub id (`loading.py`).

    `dtype`: None or "auto" keeps the checkpoint's dtype; "bfloat16", torch.float32, ... convert.
    `device_map`: "auto" (Neuron first), "neuron", "cuda:N", "cpu", an index or a torch.device;
    None loads on the CPU, as transformers does. `distributed_config`: partition the model over the
    torchrun job while it loads (`distributed/loading.py`).
    """
    resolved = resolve(pretrained_model_name_or_path, **kwargs)
    if distributed_config is not None:
        from .distributed.loading import load_distributed

        model = load_distributed(resolved.config, resolved.files, resolved.dtype, distributed_config, device_map,
                                 model_class=model_class)
    else:
        device = resolve_device(device_map) if device_map is not None else torch.device("cpu")
        model = load_model(resolved, device, model_class)
    return finish_loading(model, resolved)


class AutoModelForCausalLM:
    """transformers' entry point: `AutoModelForCausalLM.from_pretrained(path, dtype=..., device_map=...)`."""

    def __init__(self, *args, **kwargs):
        raise TypeError("Use AutoModelForCausalLM.from_pretrained(path) or AutoModelForCausalLM.from_config(config).")

    @staticmethod
    def from_pretrained(pretrained_model_name_or_path, *args, **kwargs) -> ModelForCausalLM:
        if args:
            raise TypeError("from_pretrained takes the path or Hub id as its only positional argument; pass the rest by name.")
        return from_pretrained(pretrained_model_name_or_path, **kwargs)

    @staticmethod
    def from_config(config: Union[ModelConfig, dict], dtype=None, seed: Optional[int] = None, **kwargs) -> ModelForCausalLM:
        if isinstance(config, dict):
            config = ModelConfig.from_dict(config, source="from_config(dict)")
        if kwargs:
            raise TypeError(f"from_config() got argument(s) it does not know: {', '.join(sorted(kwargs))}.")
        if seed is not None:
            check_seed(seed)
        width = parse_dtype(dtype).itemsize if dtype not in (None, "auto") else 4
        check_fits(config.num_parameters * width, "cpu", f"A model of {config.num_parameters:,} parameters",
                   "check vocab_size, hidden_size, intermediate_size and num_hidden_layers")
        return ModelForCausalLM.from_config(config, dtype=parse_dtype(dtype) if dtype not in (None, "auto") else None,
                                            seed=seed)


__all__ = ["AutoModelForCausalLM", "ModelForCausalLM", "from_pretrained"]
