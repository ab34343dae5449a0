"""The `config.json` keys of Phi-3, GLM-4, Granite and SmolLM3 beyond the shared decoder's: read (each value
checked) and written back in transformers 5's spelling.

- `partial_rotary_factor` (Phi-3/Phi-4-mini, GLM-4: 0.5 by default): only the first
  `int(head_dim * factor)` dims of each head rotate. transformers 5 keeps it in `rope_parameters`;
  older files have it at the top level; both are read.
- LongRoPE (`rope_type` "longrope", Phi-3/Phi-4-mini): `short_factor` and `long_factor` (one per
  rotated pair), `original_max_position_embeddings` (Phi-3's top-level key wins over the one in
  `rope_parameters`, as in transformers), an optional `factor` and `attention_factor`.
- `no_rope_layers` (SmolLM3): one entry per layer, **1 where the layer applies RoPE** and 0 where it does
  not (transformers' `use_rope = no_rope_layers[i]`); missing, it is built from `no_rope_layer_interval`
  (every 4th layer without RoPE). When `use_sliding_window` is on and `layer_types` is missing, the layers
  without RoPE are the sliding ones (transformers' rule).
- Granite's `embedding_multiplier` (the embeddings times it), `attention_multiplier` (the attention's
  scale instead of `head_dim ** -0.5`), `residual_multiplier` (each sub-layer's output times it before
  the residual sum) and `logits_scaling` (the logits divided by it).

`config.Family` says which family reads which keys; a family that reads none leaves them in `extra`.
"""

from __future__ import annotations

from typing import Any, Optional

from . import config_checks as checks
from .config_checks import ConfigError

# `fam` below is a `config.Family`, `config` a `config.ModelConfig` (not imported: config imports this module)

MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def handled(fam) -> tuple:
    """The keys that become ModelConfig fields for `fam` (any other family keeps them in `extra`). A top-level
    `partial_rotary_factor` or `original_max_position_embeddings` stays in `extra` and is written back as
    it was."""
    return (("no_rope_layers",) if fam.rope_per_layer else ()) + (MULTIPLIERS if fam.multipliers else ())


def _rope_dict(d: dict) -> dict:
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else None
    legacy = d.get("rope_scaling") if isinstance(d.get("rope_scaling"), dict) else None
    return {**(legacy or {}), **(params or {})}


def partial_rotary_factor(d: dict, fam, source: str) -> float:
    """The fraction of each head that rotates: `rope_parameters`' value, else the top-level key, else the
    family's default (1.0 but GLM-4's 0.5)."""
    value = _rope_dict(d).get("partial_rotary_factor")
    if value is None:
        value = d.get("partial_rotary_factor", fam.defaults.get("partial_rotary_factor", 1.0))
    value = checks.positive_number(value, "partial_rotary_factor", source)
    if value > 1:
        raise ConfigError(
            f"{source}: partial_rotary_factor={value} must be at most 1 (the fraction of each head that rotates)."
        )
    return float(value)


def rotary_dim(head_dim: int, factor: float, source: str) -> int:
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ConfigError(
            f"{source}: partial_rotary_factor={factor} of head_dim={head_dim} rotates {dim} dims: it "
            f"must give an even number of at least 2."
        )
    return dim


def longrope(scaling: dict, d: dict, dim: int, source: str) -> dict:
    """LongRoPE's parameters checked, `original_max_position_embeddings` filled in (Phi-3's top-level key
    first, as transformers reads it)."""
    scaling = dict(scaling)
    original = d.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings"))
    if original is None:
        raise ConfigError(
            f"{source}: rope scaling 'longrope' needs 'original_max_position_embeddings' (the pretraining context)."
        )
    scaling["original_max_position_embeddings"] = checks.positive_int(
        original, "original_max_position_embeddings", source
    )
    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if not (
            isinstance(value, list)
            and len(value) == dim // 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value)
        ):
            raise ConfigError(
                f"{source}: rope scaling 'longrope' needs {key!r} as a list of {dim // 2} positive "
                f"numbers (one per rotated pair of dims), not {str(value)[:60]}."
            )
    return scaling


def phi3_rope_type(d: dict) -> dict:
    """`d` with Phi-3's older RoPE type names ("su", and "yarn", which Phi-3 used for LongRoPE) read as
    "longrope", as transformers' Phi3Config does."""
    for key in ("rope_scaling", "rope_parameters"):
        value = d.get(key)
        if isinstance(value, dict) and value.get("rope_type", value.get("type")) in ("su", "yarn"):
            d = {**d, key: {**{k: v for k, v in value.items() if k != "type"}, "rope_type": "longrope"}}
    return d


def no_rope_layers(d: dict, layers: int, source: str) -> list:
    """SmolLM3's per-layer switch, 1 = this layer applies RoPE (see the module docstring)."""
    value = d.get("no_rope_layers")
    if value is None:
        interval = checks.positive_int(d.get("no_rope_layer_interval", 4), "no_rope_layer_interval", source)
        return [int((i + 1) % interval != 0) for i in range(layers)]
    if not (
        isinstance(value, list)
        and len(value) == layers
        and all(v in (0, 1) and not isinstance(v, float) for v in value)
    ):
        raise ConfigError(
            f"{source}: no_rope_layers must list 0 or 1 for each of the {layers} layers (1: the layer "
            f"applies RoPE), not {str(value)[:60]}."
        )
    return [int(v) for v in value]


def smollm3_layer_types(rope_layers: list, sliding: Optional[int]) -> Optional[list]:
    """transformers' default `layer_types` for SmolLM3: sliding where a layer has no RoPE (with a window)."""
    if sliding is None:
        return None
    return ["sliding_attention" if not r else "full_attention" for r in rope_layers]


def multipliers(d: dict, source: str) -> dict:
    out = {}
    for key in MULTIPLIERS:
        value = d.get(key, 1.0)
        out[key] = float(checks.positive_number(value, key, source))
    return out


def read(d: dict, fam, layers: int, head_dim: int, source: str) -> dict:
    """The ModelConfig fields these keys give (defaults for a family that reads none)."""
    out: dict[str, Any] = {"partial_rotary_factor": partial_rotary_factor(d, fam, source)}
    rotary_dim(head_dim, out["partial_rotary_factor"], source)
    if fam.rope_per_layer:
        out["no_rope_layers"] = no_rope_layers(d, layers, source)
    if fam.multipliers:
        out.update(multipliers(d, source))
    return out


def write(config) -> dict:
    """The keys the family's transformers config writes (into `out`'s rope_parameters too)."""
    fam = config.family
    out: dict[str, Any] = {}
    if fam.multipliers:
        out.update({key: getattr(config, key) for key in MULTIPLIERS})
    if fam.rope_per_layer:
        out["no_rope_layers"] = list(config.no_rope_layers)
    return out


__all__ = ["handled", "phi3_rope_type", "read", "write", "longrope", "rotary_dim", "smollm3_layer_types"]
