"""from_pretrained(path, gguf_file=...): a model built from a GGUF file, its tensors dequantised to the asked dtype.

Why this exists apart from `pretrained.py`: a GGUF is one file holding config and weights under GGUF's
names, with quantized blocks, so neither the config nor the weights go through the safetensors path. This
module rebuilds the config (`checkpoints/gguf_config.py`), checks every tensor's name and shape before
reading any (a mismatch loses nothing and gets one sentence), then fills a meta-device model one
dequantised tensor at a time (`checkpoints/gguf_file.py`, `checkpoints/gguf_names.py`). A tensor stored
fused (Phi-3's `attn_qkv`, `ffn_up`) is read once and its parts' rows go to the model's split projections.
"""

from __future__ import annotations

import logging
import os
from typing import Union

import torch
from torch import nn

from ..checkpoints.gguf_config import config_dict, rope_factor_tensors
from ..checkpoints.gguf_file import GGUFError, GGUFFile, open_gguf
from ..checkpoints.gguf_names import IGNORED, hf_names, restore
from ..checkpoints.hub import resolve_file
from .decoder import CausalLM
from .model_config import ModelConfig, parse_dtype

logger = logging.getLogger("staticformers")
_FLOAT_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


def gguf_path(name_or_path: str, gguf_file: Union[str, os.PathLike], **hub) -> str:
    """The local path of `gguf_file`: itself when it is a path to a file, else a file in the folder or Hub repo."""
    gguf_file = os.fspath(gguf_file)
    if os.path.isfile(gguf_file):
        return gguf_file
    return resolve_file(name_or_path, gguf_file, **hub)


def read_config(f: GGUFFile) -> ModelConfig:
    return ModelConfig.from_dict(config_dict(f), source=f"{os.path.basename(f.path)} (GGUF metadata)")


def gguf_dtype(dtype, f: GGUFFile) -> torch.dtype:
    """None or "auto": the file's float type (its embedding's, when F16 or BF16), else float32."""
    if dtype is None or dtype == "auto":
        embed = "token_embd.weight"
        return _FLOAT_TYPES.get(f.tensor_type(embed), torch.float32) if embed in f.tensor_names else torch.float32
    return parse_dtype(dtype)


def _layout(model: CausalLM, f: GGUFFile) -> dict[str, list[tuple[str, int, int]]]:
    """GGUF name -> [(parameter name, first row, end row) per part] for every tensor (one part unless the file
    stores it fused), checked against the model (names, shapes, nothing missing)."""
    expected = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    base = os.path.basename(f.path)
    arch = f.architecture
    skipped = set(IGNORED) | set(rope_factor_tensors(arch))
    layout, unknown = {}, []
    for name in f.tensor_names:
        if name in skipped:
            continue
        targets = hf_names(name, arch)
        if targets is None or any(t not in expected for t in targets):
            unknown.append(name)
            continue
        shapes = [expected[t] for t in targets]
        implied = (sum(s[0] for s in shapes), *shapes[0][1:]) if len(shapes) > 1 else shapes[0]
        if f.shape(name) != implied or any(s[1:] != shapes[0][1:] for s in shapes):
            what = targets[0] if len(targets) == 1 else " + ".join(targets)
            raise GGUFError(
                f"Tensor {name} in {base} has shape {list(f.shape(name))} but the file's metadata implies "
                f"{list(implied)} for {what}: the file is inconsistent; re-download it."
            )
        parts, start = [], 0
        for target, shape in zip(targets, shapes):
            parts.append((target, start, start + shape[0]))
            start += shape[0]
        layout[name] = parts
    if unknown:
        raise GGUFError(
            f"{base} holds {len(unknown)} tensor(s) this {model.config.architecture} does not use "
            f"({', '.join(unknown[:6])}): staticformers cannot load this GGUF variant; use the model's "
            f"safetensors checkpoint instead."
        )
    missing = sorted(set(expected) - {t for parts in layout.values() for t, _, _ in parts})
    if missing:
        raise GGUFError(
            f"{base} lacks {len(missing)} tensor(s) that {model.config.architecture} needs "
            f"({', '.join(missing[:6])}): the file is incomplete; re-download it."
        )
    return layout


def load_gguf_weights(model: CausalLM, f: GGUFFile, device: torch.device, dtype: torch.dtype) -> None:
    """Fill a meta-device model from `f`, each tensor dequantised to float32, restored (llama's q/k order,
    Gemma's norms) and converted to `dtype` on `device`, after every name and shape is checked."""
    f.check_types()
    layout = _layout(model, f)
    if "rope_freqs.weight" in f.tensor_names:
        logger.warning(
            "%s carries rope_freqs.weight (Llama 3.1+'s RoPE scaling), which its metadata does not "
            "describe: the model runs plain RoPE, as transformers' GGUF loader does; for the scaled RoPE, "
            "load the model's safetensors checkpoint.",
            os.path.basename(f.path),
        )
    cfg = model.config
    arch = f.architecture
    for name, parts in layout.items():
        value = restore(arch, name, f.read(name, torch.float32), cfg.num_attention_heads, cfg.num_key_value_heads)
        if not torch.isfinite(value).all():
            raise GGUFError(
                f"Tensor {name} in {os.path.basename(f.path)} holds non-finite values: the file is "
                f"corrupt; re-download it."
            )
        for target, start, end in parts:
            part = value if len(parts) == 1 else value[start:end]
            module_name, _, leaf = target.rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters[leaf] = nn.Parameter(part.to(device=device, dtype=dtype).contiguous())
    model.tie_weights()
    model.model.reset_rope(device)


def load_gguf_model(
    f: GGUFFile, config: ModelConfig, device: torch.device, dtype: torch.dtype, model_class: type = CausalLM
) -> CausalLM:
    with torch.device("meta"):
        model = model_class(config)
    load_gguf_weights(model, f, device, dtype)
    return model


def open_model_file(name_or_path: str, gguf_file, **hub) -> GGUFFile:
    """The GGUF file `gguf_file` names, opened, with its architecture checked before anything else."""
    return open_gguf(gguf_path(name_or_path, gguf_file, **hub), required_keys=("general.architecture",))


__all__ = ["gguf_path", "read_config", "gguf_dtype", "load_gguf_weights", "load_gguf_model", "open_model_file"]
