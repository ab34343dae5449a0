"""The Gemma 2 / Gemma 3 keys of `config.json`: read (each value checked) and written back.

- `query_pre_attn_scalar`: attention scales its scores by its inverse square root (not head_dim's);
- `attn_logit_softcapping` (Gemma 2 only: Gemma 3's attention ignores it, as transformers' does) and
  `final_logit_softcapping`: `tanh(s / c) * c` on the attention scores and on the logits;
- `layer_types`: when a file leaves it out, Gemma 2 alternates sliding and full layers (sliding first) and
  Gemma 3 makes every `sliding_window_pattern`-th layer (6 by default) full, as transformers does;
- Gemma 3's two RoPE bases: `rope_parameters` per layer type (`sliding_attention`, `full_attention`), or
  the older `rope_theta` (full layers, with `rope_scaling`) and `rope_local_base_freq` (sliding layers);
- the activation is spelled `hidden_activation` (`Family.act_key`).

A family without these keys ignores them (they stay in `extra`).
"""

from __future__ import annotations

from typing import Callable, Optional

from . import config_checks as checks
from .config_checks import ConfigError

# `fam` below is a `model_config.Family`, `config` a `model_config.ModelConfig` (not imported: it imports this)

HANDLED = (
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "hidden_activation",
    "rope_local_base_freq",
    "sliding_window_pattern",
    "use_bidirectional_attention",
)


def _cap(value, key: str, source: str) -> Optional[float]:
    return None if value is None else checks.positive_number(value, key, source)


def default_layer_types(fam, d: dict, layers: int, source: str) -> Optional[list]:
    """transformers' `layer_types` for a Gemma file that leaves them out; None for other families."""
    if fam.sliding_pattern is None:
        return None
    pattern = fam.sliding_pattern
    if fam.sliding_pattern_key in d:
        pattern = checks.positive_int(d[fam.sliding_pattern_key], fam.sliding_pattern_key, source)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def read(d: dict, fam, source: str, rope: Callable) -> dict:
    """The ModelConfig fields of a Gemma family's config (`d`: the file with the family's defaults under it;
    `rope`: `model_config._rope`, to read the sliding layers' RoPE as the full layers' is read); {} otherwise."""
    if not fam.gemma_keys:
        return {}
    if checks.boolean(d.get("use_bidirectional_attention"), "use_bidirectional_attention", source):
        raise ConfigError(
            f"{source}: use_bidirectional_attention=true makes a {fam.architecture} an encoder "
            f"(embedding models), which this causal decoder does not run: set it to false."
        )
    scalar = d.get("query_pre_attn_scalar")
    checks.positive_number(scalar, "query_pre_attn_scalar", source)  # kept as written: transformers wants an int
    out = {
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": _cap(d.get("attn_logit_softcapping"), "attn_logit_softcapping", source),
        "final_logit_softcapping": _cap(d.get("final_logit_softcapping"), "final_logit_softcapping", source),
    }
    if fam.per_type_rope:
        params = checks.mapping(d.get("rope_parameters"), "rope_parameters", source)
        local = params.get("sliding_attention")
        if local is None:
            theta = d.get("rope_local_base_freq", fam.defaults.get("rope_local_base_freq", 10000.0))
            local = {"rope_type": "default", "rope_theta": theta}
        theta, scaling = rope({"rope_parameters": local}, f"{source} (rope_parameters.sliding_attention)")
        out["rope_local"] = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    return out


def write(config, out: dict) -> None:
    """Write a Gemma family's own keys into `out` (`ModelConfig.to_dict`'s dict), transformers' spelling."""
    fam = config.family
    if fam.act_key != "hidden_act":
        out.pop("hidden_act", None)
        out[fam.act_key] = config.hidden_act
    if not fam.gemma_keys:
        return
    out["query_pre_attn_scalar"] = config.query_pre_attn_scalar
    out["attn_logit_softcapping"] = config.attn_logit_softcapping
    out["final_logit_softcapping"] = config.final_logit_softcapping
    out["sliding_window"] = config.sliding_window
    out["layer_types"] = config.layer_types or ["full_attention"] * config.num_hidden_layers
    if fam.per_type_rope:
        out["rope_parameters"] = {
            "full_attention": out["rope_parameters"],
            "sliding_attention": dict(config.rope_local),
        }
