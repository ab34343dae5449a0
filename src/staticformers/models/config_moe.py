"""The mixture-of-experts keys of `config.json`: read (each value checked), written back, and which layers route.

Qwen3-MoE spells the expert count `num_experts` and an expert's width `moe_intermediate_size`, and mixes
dense and sparse layers (`decoder_sparse_step`, `mlp_only_layers`); Mixtral spells the count
`num_local_experts`, its experts are `intermediate_size` wide and every layer is sparse. transformers 5
maps one count spelling onto the other (`attribute_map`), so either is read for both families and each
family's own is written (DeepSeek-V3's is `n_routed_experts`, its dense layers the first `first_k_dense_replace`). A dense family ignores these keys (they stay in `extra`, as any key it does not use).
"""

from __future__ import annotations

from typing import Any

from . import config_checks as checks
from .config_checks import ConfigError

# `fam` below is a `config.Family`, `config` a `config.ModelConfig` (not imported: config imports this module)

# the keys this module turns into ModelConfig fields (for a MoE family)
HANDLED = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "swiglu_alpha",
    "swiglu_limit",
    "shared_expert_intermediate_size",
)


def _count(d: dict, raw: dict, fam, source: str) -> int:
    """The expert count in either spelling; the file's own value wins over the family's default."""
    for key in (fam.experts_key, *(k for k in ("num_experts", "num_local_experts") if k != fam.experts_key)):
        if raw.get(key) is not None:
            return checks.positive_int(raw[key], key, source)
    return checks.positive_int(d.get(fam.experts_key), fam.experts_key, source)


def _fraction(value: Any, key: str, source: str) -> float:
    """A finite number of 0 or more (a loss coefficient, a noise level)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        raise ConfigError(f"{source}: {key}={value!r} must be a finite number of 0 or more.")
    return checks.positive_number(value, key, source)


def read(d: dict, raw: dict, fam, layers: int, source: str) -> dict:
    """The ModelConfig fields of a MoE family's config (`d`: the file with the family's defaults under it,
    `raw`: the file alone); {} for a dense family."""
    if fam.mlp != "moe":
        return {}
    experts = _count(d, raw, fam, source)
    top_k = checks.positive_int(d.get("num_experts_per_tok"), "num_experts_per_tok", source)
    if top_k > experts:
        raise ConfigError(
            f"{source}: num_experts_per_tok={top_k} is more than the {experts} experts: each token "
            f"picks at most every expert once."
        )
    width = checks.positive_int(d.get(fam.expert_width_key), fam.expert_width_key, source)
    step = checks.positive_int(d.get("decoder_sparse_step", 1), "decoder_sparse_step", source)
    dense_layers = d.get("mlp_only_layers")
    dense_layers = [] if dense_layers is None else dense_layers
    if not isinstance(dense_layers, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in dense_layers
    ):
        raise ConfigError(
            f"{source}: mlp_only_layers={dense_layers!r} must be a list of layer indices from 0 to {layers - 1}."
        )
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": width,
        "norm_topk_prob": True
        if fam.always_norm_topk
        else checks.boolean(d.get("norm_topk_prob"), "norm_topk_prob", source),
        "decoder_sparse_step": step,
        "mlp_only_layers": list(dense_layers),
        "output_router_logits": checks.boolean(d.get("output_router_logits"), "output_router_logits", source),
        "router_aux_loss_coef": _fraction(d.get("router_aux_loss_coef", 0.001), "router_aux_loss_coef", source),
        "router_jitter_noise": _fraction(d.get("router_jitter_noise", 0.0), "router_jitter_noise", source),
        **_clamped_swiglu(d, fam, source),
        **(
            {
                "shared_expert_intermediate_size": checks.positive_int(
                    d.get("shared_expert_intermediate_size"), "shared_expert_intermediate_size", source
                )
            }
            if fam.gated_shared_expert
            else {}
        ),
    }


def _clamped_swiglu(d: dict, fam, source: str) -> dict:
    """gpt-oss's clamped SwiGLU constants (transformers' defaults 1.702 and 7.0), {} for other activations."""
    if fam.expert_activation != "clamped_swiglu":
        return {}
    return {
        "swiglu_alpha": checks.positive_number(d.get("swiglu_alpha", 1.702), "swiglu_alpha", source),
        "swiglu_limit": checks.positive_number(d.get("swiglu_limit", 7.0), "swiglu_limit", source),
    }


def write(config) -> dict:
    """The family's own spelling of the MoE keys (transformers 5's), {} for a dense family."""
    fam = config.family
    if fam.mlp != "moe":
        return {}
    out = {
        fam.experts_key: config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "output_router_logits": config.output_router_logits,
        "router_aux_loss_coef": config.router_aux_loss_coef,
    }
    if fam.expert_width_key != "intermediate_size":
        out[fam.expert_width_key] = config.moe_intermediate_size
    if fam.expert_activation == "clamped_swiglu":
        out.update(swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)
    elif fam.router == "grouped_sigmoid":  # the dense layers are first_k_dense_replace (`config_mla.py`)
        out["norm_topk_prob"] = config.norm_topk_prob
    elif fam.gated_shared_expert:  # Qwen3.5-MoE: every layer sparse, the top-k always renormalised
        out["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
        if not fam.always_norm_topk:  # Qwen3-Next: Qwen3-MoE's dense layers and renormalisation switch
            out.update(
                norm_topk_prob=config.norm_topk_prob,
                decoder_sparse_step=config.decoder_sparse_step,
                mlp_only_layers=list(config.mlp_only_layers),
            )
    elif fam.always_norm_topk:
        out["router_jitter_noise"] = config.router_jitter_noise
    else:
        out.update(
            norm_topk_prob=config.norm_topk_prob,
            decoder_sparse_step=config.decoder_sparse_step,
            mlp_only_layers=list(config.mlp_only_layers),
        )
    return out


def layer_is_sparse(config, layer: int) -> bool:
    """transformers' rule: a layer routes to experts unless it is in `mlp_only_layers` or among the first
    `first_k_dense_replace` (DeepSeek, `config_mla.py`), and only every `decoder_sparse_step`-th layer (counting
    from 1) does."""
    if config.num_experts <= 0 or layer < config.first_k_dense_replace:
        return False
    return layer not in config.mlp_only_layers and (layer + 1) % config.decoder_sparse_step == 0


def moe_parameters(config) -> int:
    """Parameters of one sparse layer's MLP: the router and every expert's gate, up and down projections
    (and their biases where the family has them), and DeepSeek's shared experts (its router's correction bias
    is a buffer, not a parameter, as in transformers)."""
    if config.num_experts <= 0:
        return 0
    h, e, i, fam = config.hidden_size, config.num_experts, config.moe_intermediate_size, config.family
    shared = 3 * h * i * config.n_shared_experts  # DeepSeek's shared experts: one MLP n_shared_experts wide
    if fam.gated_shared_expert:  # Qwen3.5-MoE's and Qwen3-Next's shared expert and its gate
        shared += 3 * h * config.shared_expert_intermediate_size + h
    return e * h + e * 3 * h * i + e * fam.router_bias + e * (2 * i + h) * fam.expert_bias + shared


__all__ = ["HANDLED", "read", "write", "layer_is_sparse", "moe_parameters"]
