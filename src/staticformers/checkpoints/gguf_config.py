"""A GGUF file's metadata turned into the config.json a Hugging Face checkpoint of that model would carry.

Why this exists: a GGUF names its architecture (`general.architecture`) and spells the config under
GGUF's own keys (`llama.block_count`, ...). We rebuild transformers' config dict from them, as transformers'
GGUF loader does (its `GGUF_CONFIG_MAPPING`), for the architectures whose families we run; anything else is
refused in one sentence. `models/model_config.py` then checks the dict as it checks any config.json.

Where the file states something transformers' GGUF loader leaves at its config class's default, we read it
(the model then equals its safetensors checkpoint), and what the format leaves unsaid we fill in as the GGUF
runtime (ggml's, the format's reference runtime) does when it runs the file:
- gemma2: head_dim from `attention.key_length`, the soft caps `attn_logit_softcapping` and
  `final_logit_softcapping` (the GGUF runtime's defaults 50 and 30 when absent), `attention.sliding_window`;
- gemma3: `rope.freq_base` is the full layers' base, with `rope.scaling.type` "linear" and its factor on
  those layers only; the sliding layers rotate with base 10000 unless `rope.freq_base_swa` says otherwise;
  no `attention.sliding_window` (or 0) means every layer is full; `final_logit_softcapping` when present;
- both Gemmas: every `attention.sliding_window_pattern`-th layer is full (the GGUF runtime's default pattern:
  2 for Gemma 2, 6 for Gemma 3; a per-layer list of flags, true = sliding, is read too), and
  `query_pre_attn_scalar`, which GGUF does not carry, is head_dim, or hidden_size / heads for the 27B
  models (46 layers for Gemma 2, 62 for Gemma 3), the GGUF runtime's rule, which every released checkpoint follows;
- phi3: head_dim is hidden_size / heads, `rope.dimension_count` the rotated dims (partial RoPE),
  `rope.scaling.original_context_length`, `attention.sliding_window` (0: none), and LongRoPE from the
  tensors `rope_factors_short.weight` / `rope_factors_long.weight` (its attention factor computed from the
  context lengths, as transformers does; a file whose `rope.scaling.attn_factor` differs gets a warning).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from .gguf_file import GGUFError, GGUFFile

# GGUF architecture -> the transformers class we build for it
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Llama 2/3, SmolLM, and Mistral (GGUF converters write Mistral as llama)
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # the text model (a Gemma 3 GGUF holds no vision tower)
    "phi3": "Phi3ForCausalLM",  # Phi-3, Phi-3.5-mini, Phi-4-mini
}
_MODEL_TYPES = {"gemma3": "gemma3_text"}
logger = logging.getLogger("staticformers")
# Phi-3's LongRoPE factors: tensors the config is read from, not weights
ROPE_FACTOR_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")

# GGUF's key (after "<arch>.") -> config.json's key
_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# per architecture: which key gives head_dim (transformers reads llama's rope.dimension_count, qwen3's key_length)
_HEAD_DIM = {
    "llama": "rope.dimension_count",
    "qwen3": "attention.key_length",
    "gemma2": "attention.key_length",
    "gemma3": "attention.key_length",
}
# the GGUF runtime's Gemma constants: the sliding-layer pattern, and the layer count of the 27B models
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def check_architecture(f: GGUFFile) -> str:
    """The GGUF architecture, refused in one sentence when we run no family for it."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{f.path} holds a {arch!r} model (general.architecture), which staticformers does not load from GGUF "
            f"(it loads {', '.join(sorted(ARCHITECTURES))}): use the model's safetensors checkpoint instead."
        )
    if f.metadata.get(f"{arch}.expert_count"):
        raise GGUFError(
            f"{f.path} holds a mixture of experts ({arch}.expert_count = {f.metadata[f'{arch}.expert_count']}), "
            f"which staticformers does not load from GGUF yet: use the model's safetensors checkpoint instead."
        )
    return arch


def config_dict(f: GGUFFile) -> dict:
    """transformers' config.json for the model in `f` (what its GGUF loader builds, plus what it leaves out:
    the module docstring)."""
    arch = check_architecture(f)
    meta = f.metadata
    config: dict[str, Any] = {"architectures": [ARCHITECTURES[arch]], "model_type": _MODEL_TYPES.get(arch, arch)}
    for key, name in _KEYS.items():
        if f"{arch}.{key}" in meta:
            config[name] = meta[f"{arch}.{key}"]
    head_dim_key = _HEAD_DIM.get(arch)
    if head_dim_key and f"{arch}.{head_dim_key}" in meta:
        config["head_dim"] = meta[f"{arch}.{head_dim_key}"]
    if "vocab_size" not in config and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    config["tie_word_embeddings"] = "output.weight" not in f.tensor_names
    config["attention_bias"] = any(n.endswith(".attn_q.bias") for n in f.tensor_names) and arch != "qwen2"
    for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if key in meta:
            config[name] = meta[key]
    if arch in _GEMMA_PATTERN:
        _gemma(f, arch, config)
    elif arch == "phi3":
        _phi3(f, config)
    return config


def _number(f: GGUFFile, key: str, default=None):
    value = f.metadata.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise GGUFError(
            f"{f.path} has {key} = {str(value)[:40]!r}, which is not a number: the file is "
            f"inconsistent; re-download it."
        )
    return value


def _needed(f: GGUFFile, arch: str, key: str) -> int:
    value = _number(f, f"{arch}.{key}")
    if value is None:
        raise GGUFError(f"{f.path} has no {arch}.{key} key: it is not a complete model GGUF file.")
    return value


def _gemma(f: GGUFFile, arch: str, config: dict) -> None:
    """Gemma 2 / Gemma 3's keys (module docstring)."""
    layers, hidden = _needed(f, arch, "block_count"), _needed(f, arch, "embedding_length")
    heads = _needed(f, arch, "attention.head_count")
    head_dim = config.setdefault("head_dim", hidden // heads)  # the GGUF runtime's default without key_length
    config["query_pre_attn_scalar"] = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    window = _number(f, f"{arch}.attention.sliding_window")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = _number(f, f"{arch}.{key}")
        if cap is not None:
            config[key] = float(cap) if cap > 0 else None
    if arch == "gemma3":
        config.setdefault("final_logit_softcapping", None)
        config["rope_parameters"] = {
            "full_attention": {**_gemma3_full_rope(f), "rope_theta": float(config.pop("rope_theta", 1000000.0))},
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(_number(f, "gemma3.rope.freq_base_swa", 10000.0)),
            },
        }
    if arch == "gemma3" and not window:
        config["sliding_window"] = None
        config["layer_types"] = ["full_attention"] * layers
        return
    if window is not None:
        config["sliding_window"] = window
    config["layer_types"] = _gemma_layer_types(f, arch, layers)


def _gemma3_full_rope(f: GGUFFile) -> dict:
    kind = f.metadata.get("gemma3.rope.scaling.type", "none")
    factor = _number(f, "gemma3.rope.scaling.factor")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return {"rope_type": "default"}
    if kind == "linear" and factor > 0:
        return {"rope_type": "linear", "factor": float(factor)}
    raise GGUFError(
        f"{f.path} states RoPE scaling {kind!r} (gemma3.rope.scaling.type) for Gemma 3, which "
        f"staticformers reads only as 'linear' from GGUF: use the model's safetensors checkpoint instead."
    )


def _gemma_layer_types(f: GGUFFile, arch: str, layers: int) -> list:
    """Sliding or full per layer: the GGUF runtime's pattern (every n-th layer full, 0: none), or the file's flags."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = f.metadata.get(key, _GEMMA_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(
                f"{f.path} lists {len(pattern)} flags in {key} for {layers} layers: the file is "
                f"inconsistent; re-download it."
            )
        return ["sliding_attention" if flag else "full_attention" for flag in pattern]
    pattern = _number(f, key, _GEMMA_PATTERN[arch])
    return ["sliding_attention" if pattern == 0 or (i + 1) % pattern else "full_attention" for i in range(layers)]


def _phi3(f: GGUFFile, config: dict) -> None:
    """Phi-3's keys and LongRoPE factors (module docstring)."""
    hidden, heads = _needed(f, "phi3", "embedding_length"), _needed(f, "phi3", "attention.head_count")
    head_dim = hidden // heads
    rope = {"rope_type": "default", "rope_theta": float(config.pop("rope_theta", 10000.0))}
    dims = _number(f, "phi3.rope.dimension_count")
    if dims is not None and dims != head_dim:
        rope["partial_rotary_factor"] = _fraction(dims, head_dim)
    original = _number(f, "phi3.rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = original
    window = _number(f, "phi3.attention.sliding_window")
    if window:
        config["sliding_window"] = window
    factors = [name for name in ROPE_FACTOR_TENSORS if name in f.tensor_names]
    if factors:
        if len(factors) == 1 or original is None:
            lacks = (
                "phi3.rope.scaling.original_context_length"
                if original is None
                else next(n for n in ROPE_FACTOR_TENSORS if n not in factors)
            )
            raise GGUFError(
                f"{f.path} carries LongRoPE factors ({', '.join(factors)}) but no {lacks}: the file is "
                f"incomplete; re-download it."
            )
        rope.update(
            rope_type="longrope",
            short_factor=_factors(f, ROPE_FACTOR_TENSORS[0]),
            long_factor=_factors(f, ROPE_FACTOR_TENSORS[1]),
        )
        _check_attention_factor(f, config.get("max_position_embeddings"), original)
    config["rope_parameters"] = rope


def _check_attention_factor(f: GGUFFile, positions, original: int) -> None:
    """Warn when the file's `rope.scaling.attn_factor` is not LongRoPE's own (a converter that took the model
    for YaRN writes 0.1 ln(s) + 1): we use LongRoPE's, as transformers does with the safetensors checkpoint."""
    stated = _number(f, "phi3.rope.scaling.attn_factor")
    if stated is None or not positions:
        return
    scale = positions / original
    own = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    if abs(stated - own) > 1e-6 * own:
        logger.warning(
            "%s states rope.scaling.attn_factor = %.6g, not LongRoPE's %.6g for %d / %d positions: the "
            "model scales by %.6g, as its safetensors checkpoint does in transformers.",
            f.path,
            stated,
            own,
            positions,
            original,
            own,
        )


def _fraction(dims: int, head_dim: int) -> float:
    """dims / head_dim, nudged so that int(head_dim * it) is exactly dims (how the rotated dims are counted)."""
    factor = dims / head_dim
    while int(head_dim * factor) < dims:
        factor = math.nextafter(factor, 2.0)
    return factor


def _factors(f: GGUFFile, name: str) -> list:
    return [float(v) for v in f.read(name, torch.float32).reshape(-1).tolist()]


def rope_factor_tensors(arch: str) -> tuple:
    """The tensors `config_dict` reads for `arch` (not weights of the model)."""
    return ROPE_FACTOR_TENSORS if arch == "phi3" else ()


__all__ = ["ARCHITECTURES", "ROPE_FACTOR_TENSORS", "check_architecture", "config_dict", "rope_factor_tensors"]
