"""from_pretrained / save_pretrained: Hugging Face checkpoints in and out.

Loading builds the model on the meta device (no memory, no random init), then materialises each
tensor once, read from the file (plain reads, no memory map: see safetensors_io) straight into the
target dtype on the target device: peak host memory stays near the model's size, not twice it. Pickle checkpoints
are never unpickled. Every refusal is one sentence naming the file or the weights.

Saving writes config.json in the transformers-5 spelling, safetensors shards with an index above
`max_shard_size`, and generation_config.json when known; transformers loads what we write.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional, Union

import torch
from torch import nn

from .config import ModelConfig, dtype_name, parse_dtype
from .devices import resolve_device
from .hub import CheckpointNotFoundError, is_local, resolve_file
from .modeling import CausalLM
from .safetensors_io import SafetensorsFile, SafetensorsFormatError

logger = logging.getLogger("staticformers")

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
GENERATION_CONFIG = "generation_config.json"

# keys some checkpoints carry that hold nothing we load (old Llama exports saved RoPE buffers)
_IGNORED_KEYS = re.compile(r".*\.rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint whose weights do not fit the model its config describes."""


def _hub_kwargs(revision, cache_dir, local_files_only, token) -> dict:
    return dict(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)


def weight_files(name_or_path: str, **hub) -> list[str]:
    """Local paths of the checkpoint's safetensors files (every shard, in index order)."""
    index = resolve_file(name_or_path, SAFE_INDEX, required=False, **hub)
    if index is not None:
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index ({err!r}): restore it from the source.") from None
        shards = list(dict.fromkeys(weight_map.values()))
        paths = []
        for shard in shards:
            try:
                paths.append(resolve_file(name_or_path, shard, **hub))
            except CheckpointNotFoundError:
                raise CheckpointNotFoundError(
                    f"Shard {shard} listed in {SAFE_INDEX} is missing from {name_or_path}: download the complete checkpoint."
                ) from None
        return paths
    single = resolve_file(name_or_path, SAFE_WEIGHTS, required=False, **hub)
    if single is not None:
        return [single]
    for pickle_name in PICKLE_WEIGHTS:
        if resolve_file(name_or_path, pickle_name, required=False, **hub) is not None:
            raise CheckpointError(
                f"{name_or_path} holds only a pickle checkpoint ({pickle_name}), which staticformers never unpickles: "
                f"convert it to safetensors first (for instance with transformers: load it and save_pretrained(dir, safe_serialization=True))."
            )
    raise CheckpointNotFoundError(f"{name_or_path} has no {SAFE_WEIGHTS} and no {SAFE_INDEX}: it holds no weights we can load.")


def _checkpoint_dtype(files: list[str]) -> Optional[torch.dtype]:
    """The dtype of the first floating tensor in the first shard, read from its header alone."""
    with SafetensorsFile(files[0]) as f:
        for name in f.keys():
            if f.dtype(name).is_floating_point:
                return f.dtype(name)
    return None


def resolve_dtype(dtype, config: ModelConfig, files: list[str]) -> torch.dtype:
    """None or "auto": the checkpoint's own dtype (config.json, else the weights' header)."""
    if dtype is None or dtype == "auto":
        return config.dtype or _checkpoint_dtype(files) or torch.float32
    return parse_dtype(dtype)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._parameters.get(leaf)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad if old is not None else True)


def expected_weights(model: CausalLM) -> dict[str, tuple]:
    """Name -> shape of every weight the checkpoint must hold (a tied lm_head is not stored)."""
    expected = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    return expected


def check_checkpoint(model: CausalLM, files: list[str]) -> dict[str, str]:
    """Check from the headers alone that the files hold every weight the model needs, with the right
    shapes, once each and nothing else; return which file holds each weight.

    Run before any tensor is read, so a checkpoint that does not fit loses nothing and gets one sentence.
    """
    expected = expected_weights(model)
    tied = model.config.tie_word_embeddings
    where: dict[str, str] = {}
    unexpected: list[str] = []
    for path in files:
        try:
            handle = SafetensorsFile(path)
        except SafetensorsFormatError as err:
            raise CheckpointError(str(err)) from None
        with handle as f:
            for name in f.keys():
                if name not in expected:
                    if not (_IGNORED_KEYS.match(name) or (tied and name == "lm_head.weight")):
                        unexpected.append(name)
                    continue
                if name in where:
                    raise CheckpointError(f"Weight {name} appears in more than one shard ({path} is the second).")
                if f.shape(name) != expected[name]:
                    raise CheckpointError(
                        f"Weight {name} in {os.path.basename(path)} has shape {list(f.shape(name))} but config.json "
                        f"implies {list(expected[name])}: the config and the weights come from different models."
                    )
                where[name] = path
    if unexpected:
        raise CheckpointError(
            f"The checkpoint has {len(unexpected)} weight(s) this {model.config.architecture} does not use: "
            f"{_names(unexpected)}: the config and the weights come from different models."
        )
    missing = sorted(set(expected) - set(where))
    if missing:
        raise CheckpointError(
            f"The checkpoint lacks {len(missing)} weight(s) that {model.config.architecture} needs: {_names(missing)}: "
            f"a shard may be missing or the config may not match the weights."
        )
    return where


def load_weights(model: CausalLM, files: list[str], device: torch.device, dtype: torch.dtype) -> None:
    """Fill a meta-device model from safetensors files, one tensor at a time, after checking them all."""
    where = check_checkpoint(model, files)
    for path in files:
        with SafetensorsFile(path) as f:
            for name in f.keys():
                if where.get(name) == path:
                    floating = f.dtype(name).is_floating_point
                    _set_tensor(model, name, f.read(name, dtype=dtype if floating else None, device=device))
    model.tie_weights()
    model.model.rotary_emb.reset_parameters(device)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


_KNOWN_IGNORED_KWARGS = {"trust_remote_code", "attn_implementation", "low_cpu_mem_usage", "use_safetensors"}


def from_pretrained(
    pretrained_model_name_or_path: Union[str, os.PathLike],
    *,
    dtype: Union[str, torch.dtype, None] = None,
    device_map: Union[str, int, torch.device, None] = None,
    revision: Optional[str] = None,
    cache_dir: Optional[str] = None,
    local_files_only: bool = False,
    token: Optional[str] = None,
    config: Optional[ModelConfig] = None,
    torch_dtype: Union[str, torch.dtype, None] = None,
    distributed_config=None,
    **kwargs,
) -> CausalLM:
    """Load a causal LM from a folder or Hub id (see the module docstring).

    `dtype`: None or "auto" keeps the checkpoint's dtype; "bfloat16", torch.float32, ... convert.
    `device_map`: "auto" (Neuron first), "neuron", "cuda:N", "cpu", an index or a torch.device;
    None loads on the CPU, as transformers does.
    """
    unknown = set(kwargs) - _KNOWN_IGNORED_KWARGS
    if unknown:
        raise TypeError(
            f"from_pretrained() got argument(s) it does not know: {', '.join(sorted(unknown))}; "
            f"see help(staticformers.AutoModelForCausalLM.from_pretrained)."
        )
    if torch_dtype is not None:
        if dtype is not None:
            raise ValueError("Pass dtype or its old name torch_dtype, not both.")
        dtype = torch_dtype
    path = os.fspath(pretrained_model_name_or_path)
    hub = _hub_kwargs(revision, cache_dir, local_files_only, token)
    if config is None:
        config = ModelConfig.from_pretrained(path, **hub)
    files = weight_files(path, **hub)
    target_dtype = resolve_dtype(dtype, config, files)
    device = resolve_device(device_map) if device_map is not None else torch.device("cpu")
    if distributed_config is not None:
        from .distributed.loading import load_distributed

        model = load_distributed(config, files, target_dtype, distributed_config, device_map)
    else:
        with torch.device("meta"):
            model = CausalLM(config)
        load_weights(model, files, device, target_dtype)
    model.config.dtype = target_dtype
    model.name_or_path = path
    model.generation_config = load_generation_config(path, **hub)
    model.eval()
    return model


def load_generation_config(path: str, **hub):
    """generation_config.json as a GenerationConfig, or None when the checkpoint has none."""
    gen_file = resolve_file(path, GENERATION_CONFIG, required=False, **hub)
    if gen_file is None:
        return None
    from .generation.config import GenerationConfig

    return GenerationConfig.from_json_file(gen_file)


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_size(size: Union[int, str]) -> int:
    """5GB -> 5 * 10**9 bytes, 2GiB -> 2 * 2**30, an int is bytes."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(str(size))
    if not m:
        raise ValueError(f"max_shard_size={size!r} is not a size: use an int of bytes or a string like \"5GB\" or \"500MB\".")
    number, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(number * scale)


def export_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The weights as transformers names them (tied lm_head left out), contiguous, on the CPU."""
    out = {}
    for name, tensor in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if hasattr(tensor, "full_tensor"):  # a DTensor from tensor parallel / FSDP
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def save_pretrained(model: CausalLM, save_directory: Union[str, os.PathLike], max_shard_size: Union[int, str] = "5GB",
                    state_dict: Optional[dict] = None, safe_serialization: bool = True, **kwargs) -> None:
    """Write config.json, the safetensors weights (sharded above `max_shard_size`) and generation_config.json."""
    from .safetensors_io import save_file

    if not safe_serialization:
        raise ValueError("staticformers saves safetensors only: drop safe_serialization=False.")
    directory = os.fspath(save_directory)
    if os.path.isfile(directory):
        raise ValueError(f"{directory} is a file: save_pretrained needs a folder path.")
    os.makedirs(directory, exist_ok=True)
    tensors = state_dict if state_dict is not None else export_state_dict(model)
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in os.listdir(directory):
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", stale):
            os.remove(os.path.join(directory, stale))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, SAFE_WEIGHTS), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(directory, fname), metadata={"format": "pt"})
            for name, tensor in shard.items():
                weight_map[name] = fname
                total += tensor.numel() * tensor.element_size()
        with open(os.path.join(directory, SAFE_INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    model.config.dtype = next(iter(tensors.values())).dtype if tensors else model.config.dtype
    model.config.save_pretrained(directory)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)


class AutoModelForCausalLM:
    """transformers' entry point: `AutoModelForCausalLM.from_pretrained(path, dtype=..., device_map=...)`."""

    def __init__(self, *args, **kwargs):
        raise TypeError("Use AutoModelForCausalLM.from_pretrained(path) or AutoModelForCausalLM.from_config(config).")

    @staticmethod
    def from_pretrained(pretrained_model_name_or_path, *args, **kwargs) -> CausalLM:
        if args:
            raise TypeError("from_pretrained takes the path or Hub id as its only positional argument; pass the rest by name.")
        return from_pretrained(pretrained_model_name_or_path, **kwargs)

    @staticmethod
    def from_config(config: Union[ModelConfig, dict], dtype=None, seed: Optional[int] = None, **kwargs) -> CausalLM:
        if isinstance(config, dict):
            config = ModelConfig.from_dict(config, source="from_config(dict)")
        if kwargs:
            raise TypeError(f"from_config() got argument(s) it does not know: {', '.join(sorted(kwargs))}.")
        return CausalLM.from_config(config, dtype=parse_dtype(dtype) if dtype not in (None, "auto") else None, seed=seed)


__all__ = ["AutoModelForCausalLM", "from_pretrained", "save_pretrained", "load_weights", "check_checkpoint", "weight_files",
           "export_state_dict", "dtype_name", "is_local"]
