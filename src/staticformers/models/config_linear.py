"""The `config.json` keys of the hybrid families (Qwen3.5's text model, Qwen3-Next): which layers are Gated DeltaNet
linear attention, and that layer's shapes. Read (each value checked) and written back in transformers 5's spelling.

- `layer_types`: "linear_attention" or "full_attention" per layer; without it every `full_attention_interval`-th
  layer (default 4) is full attention, the others linear (transformers' rule).
- `linear_num_key_heads` / `linear_key_head_dim`: the query and key heads of a linear layer;
  `linear_num_value_heads` / `linear_value_head_dim`: its value heads (a multiple of the key heads, each key
  head serving consecutive value heads); `linear_conv_kernel_dim`: the causal convolution's width.
- The full-attention layers are gated (`q_proj` yields each head's query and a gate) and rotate a part of each
  head (`partial_rotary_factor`, 0.25 by default, read by `config_variants.py`).

The last layer must be full attention (Qwen3.5's and Qwen3-Next's are): a prefill sends each prompt's last
token through the last layer as a decode step does (`compilation/regions.py`), which a recurrent state would
count twice. `config.Family.linear_attention` says which family reads these keys; any other keeps them in
`extra`.
"""

from __future__ import annotations

from . import config_checks as checks
from .config_checks import ConfigError

# `fam` below is a `config.Family`, `config` a `config.ModelConfig` (not imported: config imports this module)

KEYS = (
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_num_value_heads",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
LINEAR, FULL = "linear_attention", "full_attention"


def handled(fam) -> tuple:
    """The keys that become ModelConfig fields for `fam`."""
    return KEYS if fam.linear_attention else ()


def layer_types(d: dict, layers: int, source: str) -> list:
    """The file's `layer_types`, or transformers' default from `full_attention_interval`; checked."""
    types = d.get("layer_types")
    if types is None:
        interval = checks.positive_int(d.get("full_attention_interval", 4), "full_attention_interval", source)
        types = [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
    checks.string_list(types, "layer_types", source, (LINEAR, FULL), layers)
    if types[-1] != FULL:
        raise ConfigError(
            f"{source}: layer_types ends with a {types[-1]!r} layer: staticformers runs hybrid models "
            f"whose last layer is full attention (as Qwen3.5's and Qwen3-Next's are)."
        )
    return list(types)


def read(d: dict, fam, source: str) -> dict:
    """The ModelConfig fields of a hybrid family (`d`: the file over the family's defaults), {} otherwise."""
    if not fam.linear_attention:
        return {}
    out = {key: checks.positive_int(d.get(key), key, source) for key in KEYS}
    if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
        raise ConfigError(
            f"{source}: linear_num_value_heads={out['linear_num_value_heads']} is not a multiple of "
            f"linear_num_key_heads={out['linear_num_key_heads']}: each key head serves as many value "
            f"heads."
        )
    return out


def write(config) -> dict:
    """The family's own spelling of these keys, {} for another family."""
    return {key: getattr(config, key) for key in KEYS} if config.family.linear_attention else {}


def linear_parameters(config) -> int:
    """Parameters of one Gated DeltaNet layer: the four input projections (Qwen3-Next's two fused ones hold the
    same rows), the convolution, dt_bias and A_log, the gated norm and the output projection."""
    h = config.hidden_size
    key, value = (
        config.linear_num_key_heads * config.linear_key_head_dim,
        config.linear_num_value_heads * config.linear_value_head_dim,
    )
    conv = 2 * key + value
    heads = config.linear_num_value_heads
    return (
        h * conv
        + h * value
        + 2 * h * heads
        + conv * config.linear_conv_kernel_dim
        + 2 * heads
        + config.linear_value_head_dim
        + value * h
    )


def state_shapes(config, tp: int = 1) -> tuple[tuple, tuple]:
    """One request's (conv state `[channels, kernel - 1]`, recurrent state `[value heads, key dim, value dim]`) on
    one rank of a model split `tp` ways by tensor parallel (each rank computes `1 / tp` of the key heads and the
    value heads they serve, `distributed/parallelize.py`; `tp` divides the key heads, `DistributedConfig` checks)."""
    key_heads, value_heads = config.linear_num_key_heads // tp, config.linear_num_value_heads // tp
    key, value = key_heads * config.linear_key_head_dim, value_heads * config.linear_value_head_dim
    return (
        (2 * key + value, config.linear_conv_kernel_dim - 1),
        (value_heads, config.linear_key_head_dim, config.linear_value_head_dim),
    )


__all__ = ["KEYS", "LINEAR", "FULL", "handled", "layer_types", "read", "write", "linear_parameters", "state_shapes"]
