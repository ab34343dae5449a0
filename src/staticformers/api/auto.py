"""`AutoModelForCausalLM` and the model class it returns: the architecture with loading, saving and generation.

`modeling.CausalLM` is the architecture alone and imports nothing above it. `ModelForCausalLM` adds
what users call on a model the transformers way (`from_pretrained`, `save_pretrained`, `generate`,
`compile_stats`, and PEFT's adapter methods `add_adapter`, `load_adapter`, `set_adapter`,
`disable_adapters`, `enable_adapters`, `active_adapters`, `delete_adapter`, `merge_and_unload`,
`unload`), each delegating to its module: loading (`models/pretrained.py`, or `distributed/sharded_loading.py` for a
model partitioned at load time), saving (the distributed save gathers on rank 0 when the model is
partitioned: `parallel_dims` says so; a model with adapters saves its adapter alone, as transformers
does), generation (`api/generate.py`), adapters (`adapters/lora.py`, `adapters/files.py`,
`adapters/bank.py`). Data flows one way: config -> model -> loading -> engine; nothing below this
module imports it.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from ..adapters import bank as adapter_bank, files as adapter_files, lora as adapters
from ..adapters.lora_config import LoraConfig
from ..models.model_config import ModelConfig, parse_dtype
from ..backends.devices import resolve_device
from ..generation.generation_config import load_generation_config
from ..models.pretrained import finish_loading, load_model, resolve
from ..models.pretrained import save_pretrained as save_checkpoint_folder
from ..backends.memory_check import check_fits
from ..models.decoder import CausalLM
from ..utils.seeds import check_seed
from .quantization import check_device


class ModelForCausalLM(CausalLM):
    """A causal LM as `from_pretrained` returns it (see the module docstring)."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> "ModelForCausalLM":
        return from_pretrained(*args, model_class=cls, **kwargs)

    def save_pretrained(
        self, save_directory: Union[str, os.PathLike], max_shard_size: Union[int, str] = "5GB", **kwargs
    ) -> None:
        """Write a Hugging Face checkpoint (transformers loads it); a model with adapters writes its active
        adapter alone, in PEFT's format (`merge_and_unload()` first for the whole model). A partitioned
        model: every rank calls this, rank 0 writes the gathered weights."""
        if adapters.has_adapters(self):
            if self.parallel_dims is not None:
                from ..distributed.lora_partition import save_adapter_distributed

                save_adapter_distributed(self, save_directory)
            else:
                adapter_files.save_adapter(self, save_directory, kwargs.pop("adapter_name", None))
        elif self.parallel_dims is not None:
            from ..distributed.dcp_checkpoint import save_pretrained_distributed

            save_pretrained_distributed(self, save_directory, max_shard_size=max_shard_size, **kwargs)
        else:
            save_checkpoint_folder(self, save_directory, max_shard_size=max_shard_size, **kwargs)

    def quantize(self, quantization_config) -> list[str]:
        """Quantize this model's weights in place (`QuantizationConfig("int8_weight_only")`, transformers'
        `TorchAoConfig` spelling too); returns the modules quantized. `save_pretrained` then writes a
        compressed-tensors checkpoint that loads quantized."""
        from .quantization import quantize

        return quantize(self, quantization_config)

    def generate(self, *args, **kwargs):
        from .generate import generate

        return generate(self, *args, **kwargs)

    def compile_stats(self) -> list[dict]:
        from ..generation.engines import compile_stats

        return compile_stats(self)

    # ---- adapters (PEFT's names, as transformers' models have them) --------------------------------
    def add_adapter(self, adapter_config: LoraConfig, adapter_name: Optional[str] = None) -> None:
        """A new LoRA adapter on the modules `adapter_config.target_modules` names, active and trainable;
        the base is frozen. A partitioned model: every rank calls it (the adapter follows the partition)."""
        names = adapters.add_adapter(self, adapter_config, adapter_name)
        if self.parallel_dims is not None:
            from ..distributed.lora_partition import partition_adapters

            layers = adapters.lora_modules(self)
            partition_adapters(self, {n: layers[n] for n in names})

    def load_adapter(
        self,
        peft_model_id: Union[str, os.PathLike],
        adapter_name: Optional[str] = None,
        is_trainable: bool = False,
        **kwargs,
    ) -> str:
        """A PEFT adapter folder or Hub id (adapter_config.json + adapter_model.safetensors); loading over an
        adapter of the same name and shapes writes its weights in place. Returns the adapter's name."""
        return adapter_files.load_adapter(self, os.fspath(peft_model_id), adapter_name, is_trainable, **kwargs)

    def set_adapter(self, adapter_name: Union[str, list]) -> None:
        adapters.set_adapter(self, adapter_name)

    def disable_adapters(self) -> None:
        adapters.enable_adapters(self, False)

    def enable_adapters(self) -> None:
        adapters.enable_adapters(self, True)

    def active_adapters(self) -> list[str]:
        return adapters.active_adapters(self)

    def delete_adapter(self, adapter_name: str) -> None:
        adapters.delete_adapter(self, adapter_name)

    def merge_and_unload(
        self, progressbar: bool = False, safe_merge: bool = False, adapter_names: Optional[list] = None
    ) -> "ModelForCausalLM":
        """The active adapters (or `adapter_names`) added into the base weights, every adapter dropped."""
        return adapters.merge_and_unload(self, adapter_names, safe_merge)

    def unload(self) -> "ModelForCausalLM":
        return adapters.unload(self)

    def enable_adapter_batching(self, max_adapters: Optional[int] = None, max_rank: Optional[int] = None):
        """Stacked copies of the adapters so one generation batch mixes rows of different adapters
        (`GenerationRequest(adapter=...)`, `generate(adapter_names=[...])`, the server's `--lora-modules`);
        returns the `AdapterBank` (`bank.load(name, path)` adds an adapter without compiling anything)."""
        return adapter_bank.enable_adapter_batching(self, max_adapters, max_rank)


def from_pretrained(
    pretrained_model_name_or_path: Union[str, os.PathLike],
    *,
    device_map: Union[str, int, torch.device, None] = None,
    distributed_config=None,
    model_class: type = ModelForCausalLM,
    **kwargs,
) -> ModelForCausalLM:
    """Load a causal LM from a folder or Hub id (`models/pretrained.py`).

    `dtype`: None or "auto" keeps the checkpoint's dtype; "bfloat16", torch.float32, ... convert.
    `device_map`: "auto" (Neuron first), "neuron", "cuda:N", "cpu", an index or a torch.device;
    None loads on the CPU, as transformers does. `distributed_config`: partition the model over the
    torchrun job while it loads (`distributed/sharded_loading.py`). `quantization_config`: weight-only int8
    (`QuantizationConfig("int8_weight_only")`, or transformers' `TorchAoConfig` spelling) applied as it loads
    (`api/quantization.py`); a compressed-tensors checkpoint loads quantized without it. `gguf_file`: a
    GGUF file in the folder or Hub repo (or its path), dequantised to `dtype` (`models/gguf_loading.py`).
    """
    path = os.fspath(pretrained_model_name_or_path)
    if adapter_files.is_adapter_folder(path) and not os.path.isfile(os.path.join(path, "config.json")):
        return _with_adapter(path, device_map, distributed_config, model_class, kwargs)
    resolved = resolve(pretrained_model_name_or_path, **kwargs)
    if resolved.quantization is not None:
        check_device(
            resolved.quantization, resolve_device(device_map) if device_map is not None else torch.device("cpu")
        )
    if distributed_config is not None:
        from ..distributed.sharded_loading import load_distributed

        if resolved.gguf is not None:
            raise ValueError(
                "A GGUF file (gguf_file=) with distributed_config is not supported: load it without "
                "distributed_config, save_pretrained it to a folder, and load that folder partitioned."
            )
        if resolved.quantization is not None and "quantization_config" in resolved.config.extra:
            raise ValueError(f"{path} is quantized already; load it without quantization_config.")
        model = load_distributed(
            resolved.config,
            resolved.files,
            resolved.dtype,
            distributed_config,
            device_map,
            model_class=model_class,
            quantization=resolved.quantization,
        )
    else:
        device = resolve_device(device_map) if device_map is not None else torch.device("cpu")
        model = load_model(resolved, device, model_class)
    model = finish_loading(model, resolved)
    model.generation_config = load_generation_config(resolved.path, **resolved.hub)
    return model


def _with_adapter(path: str, device_map, distributed_config, model_class: type, kwargs: dict) -> ModelForCausalLM:
    """A PEFT adapter folder given to from_pretrained: its base model (`base_model_name_or_path` in its
    adapter_config.json) with the adapter loaded, as transformers does."""
    base = adapter_files.read_config(path).base_model_name_or_path
    if not base:
        raise ValueError(
            f"{path} is an adapter folder whose adapter_config.json names no base model "
            f"(base_model_name_or_path): load the base model, then model.load_adapter({path!r})."
        )
    if distributed_config is not None:
        raise ValueError(
            "An adapter folder with distributed_config is not supported: load the base model with "
            "distributed_config and add the adapter to it."
        )
    model = from_pretrained(base, device_map=device_map, model_class=model_class, **kwargs)
    model.load_adapter(path)
    return model


class AutoModelForCausalLM:
    """transformers' entry point: `AutoModelForCausalLM.from_pretrained(path, dtype=..., device_map=...)`."""

    def __init__(self, *args, **kwargs):
        raise TypeError("Use AutoModelForCausalLM.from_pretrained(path) or AutoModelForCausalLM.from_config(config).")

    @staticmethod
    def from_pretrained(pretrained_model_name_or_path, *args, **kwargs) -> ModelForCausalLM:
        if args:
            raise TypeError(
                "from_pretrained takes the path or Hub id as its only positional argument; pass the rest by name."
            )
        return from_pretrained(pretrained_model_name_or_path, **kwargs)

    @staticmethod
    def from_config(
        config: Union[ModelConfig, dict], dtype=None, seed: Optional[int] = None, **kwargs
    ) -> ModelForCausalLM:
        if isinstance(config, dict):
            config = ModelConfig.from_dict(config, source="from_config(dict)")
        if kwargs:
            raise TypeError(f"from_config() got argument(s) it does not know: {', '.join(sorted(kwargs))}.")
        if seed is not None:
            check_seed(seed)
        width = parse_dtype(dtype).itemsize if dtype not in (None, "auto") else 4
        check_fits(
            config.num_parameters * width,
            "cpu",
            f"A model of {config.num_parameters:,} parameters",
            "check vocab_size, hidden_size, intermediate_size and num_hidden_layers",
        )
        return ModelForCausalLM.from_config(
            config, dtype=parse_dtype(dtype) if dtype not in (None, "auto") else None, seed=seed
        )


__all__ = ["AutoModelForCausalLM", "ModelForCausalLM", "from_pretrained"]
