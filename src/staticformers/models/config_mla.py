"""DeepSeek-V3's `config.json` keys beyond the shared decoder's: multi-head latent attention and the routing of its
mixture of experts. Read (each value checked) and written back in transformers 5's spelling.

- **Multi-head latent attention** (`latent_attention.py`): `q_lora_rank` (None: one `q_proj`; else the query
  goes through `q_a_proj`, a norm and `q_b_proj`), `kv_lora_rank` (the latent's width), `qk_nope_head_dim` and
  `qk_rope_head_dim` (the parts of a query/key head without and with RoPE), `v_head_dim`, and
  `rope_interleave` (RoPE over adjacent pairs, DeepSeek's layout; the default). transformers sets `head_dim`
  to `qk_rope_head_dim` (the RoPE tables' width), and so do we.
- **Routing** (`moe.route_grouped`; the expert count and widths are `config_moe.py`'s): `n_routed_experts` experts, `num_experts_per_tok` of them per token,
  chosen among the best `topk_group` of `n_group` groups by sigmoid scores plus a learned correction bias;
  their weights renormalised (`norm_topk_prob`) and multiplied by `routed_scaling_factor`.
  `n_shared_experts` experts' worth of one MLP run on every token beside them. The first
  `first_k_dense_replace` layers have a dense MLP of `intermediate_size` instead.

`config.Family.attention == "mla"` says which family reads these keys; any other keeps them in `extra`.
"""

from __future__ import annotations

from typing import Any

from . import config_checks as checks
from .config_checks import ConfigError

# `fam` below is a `config.Family`, `config` a `config.ModelConfig` (not imported: config imports this module)

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")
ROUTING_KEYS = ("n_group", "topk_group", "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace")


def handled(fam) -> tuple:
    """The keys that become ModelConfig fields for `fam`."""
    return (MLA_KEYS if fam.attention == "mla" else ()) + (ROUTING_KEYS if fam.router == "grouped_sigmoid" else ())


def read(d: dict, fam, layers: int, source: str) -> dict:
    """The ModelConfig fields of a latent-attention family (`d`: the file over the family's defaults), {} otherwise."""
    if fam.attention != "mla":
        return {}
    out: dict[str, Any] = {
        "q_lora_rank": checks.optional_positive_int(d.get("q_lora_rank"), "q_lora_rank", source),
        "kv_lora_rank": checks.positive_int(d.get("kv_lora_rank"), "kv_lora_rank", source),
        "qk_nope_head_dim": checks.positive_int(d.get("qk_nope_head_dim"), "qk_nope_head_dim", source),
        "qk_rope_head_dim": checks.positive_int(d.get("qk_rope_head_dim"), "qk_rope_head_dim", source),
        "v_head_dim": checks.positive_int(d.get("v_head_dim"), "v_head_dim", source),
        "rope_interleave": checks.boolean(d.get("rope_interleave", True), "rope_interleave", source, default=True),
    }
    if out["qk_rope_head_dim"] % 2:
        raise ConfigError(
            f"{source}: qk_rope_head_dim={out['qk_rope_head_dim']} is odd: rotary embeddings need an "
            f"even number of dims."
        )
    if fam.router == "grouped_sigmoid":
        out.update(_routing(d, layers, source))
    return out


def _routing(d: dict, layers: int, source: str) -> dict:
    groups = checks.positive_int(d.get("n_group", 1), "n_group", source)
    top_groups = checks.positive_int(d.get("topk_group", 1), "topk_group", source)
    experts = checks.positive_int(d.get("n_routed_experts", d.get("num_local_experts")), "n_routed_experts", source)
    top_k = checks.positive_int(d.get("num_experts_per_tok"), "num_experts_per_tok", source)
    if experts % groups:
        raise ConfigError(
            f"{source}: n_routed_experts={experts} is not a multiple of n_group={groups}: each group "
            f"holds the same number of experts."
        )
    if top_groups > groups:
        raise ConfigError(f"{source}: topk_group={top_groups} is more than n_group={groups}.")
    if experts // groups < 2:
        raise ConfigError(
            f"{source}: n_group={groups} leaves fewer than 2 experts per group: a group is scored by "
            f"its best two experts."
        )
    if top_k > top_groups * (experts // groups):
        raise ConfigError(
            f"{source}: num_experts_per_tok={top_k} is more than the {top_groups * (experts // groups)} "
            f"experts of the topk_group={top_groups} groups a token may use."
        )
    first_dense = checks.non_negative_int(d.get("first_k_dense_replace", 0), "first_k_dense_replace", source)
    if first_dense > layers:
        raise ConfigError(f"{source}: first_k_dense_replace={first_dense} is more than the {layers} layers.")
    return {
        "n_group": groups,
        "topk_group": top_groups,
        "routed_scaling_factor": checks.positive_number(
            d.get("routed_scaling_factor", 1.0), "routed_scaling_factor", source
        ),
        "n_shared_experts": checks.non_negative_int(d.get("n_shared_experts", 0) or 0, "n_shared_experts", source),
        "first_k_dense_replace": first_dense,
    }


def write(config) -> dict:
    """The family's own spelling of these keys, {} for another family."""
    fam = config.family
    if fam.attention != "mla":
        return {}
    out = {key: getattr(config, key) for key in MLA_KEYS}
    if fam.router == "grouped_sigmoid":
        out.update({key: getattr(config, key) for key in ROUTING_KEYS})
    return out


def attention_parameters(config) -> int:
    """Parameters of one latent-attention layer (projections, their biases, the two norms)."""
    h, heads = config.hidden_size, config.num_attention_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    r, rope, v, bias = config.kv_lora_rank, config.qk_rope_head_dim, config.v_head_dim, config.attention_bias
    if config.q_lora_rank is None:
        q = h * heads * qk
    else:
        q = h * config.q_lora_rank + config.q_lora_rank * bias + config.q_lora_rank + config.q_lora_rank * heads * qk
    kv = h * (r + rope) + (r + rope) * bias + r + r * heads * (config.qk_nope_head_dim + v)
    return q + kv + heads * v * h + h * bias


__all__ = ["MLA_KEYS", "ROUTING_KEYS", "handled", "read", "write", "attention_parameters"]
