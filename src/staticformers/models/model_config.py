"""`config.json` in either spelling -> one ModelConfig; the table of supported families.

The families (Qwen3, Llama, Qwen2, Mistral, Phi-3, GLM-4, Granite, SmolLM3, Gemma 2, Gemma 3 (text),
OLMo 2, the hybrid Qwen3.5, and the mixtures of experts Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3, Qwen3.5-MoE and
Qwen3-Next) are one decoder with different flags:
q/k RMSNorm, which projections carry a bias, the RoPE variant, tied embeddings, sliding-window attention,
the norms' flavour and placement, gpt-oss's attention sinks, router and expert biases and clamped SwiGLU, and the MLP kind each family declares (`mlp`: "dense", or "moe": some or all
layers route each token to `num_experts_per_tok` of `num_experts` experts, `moe.py`) with its checkpoint
names (`expert_names`: how the Hub spells one expert's tensors, `checkpoints/names.py`). A family is a row
of this table, not a copy of the model. This module is the only place that knows which family sets which
flag, and which defaults each family's `config.json` leaves out (Qwen3 without `head_dim` means 128, not
hidden/heads); the MoE keys are read by `config_moe.py`, Gemma's (`query_pre_attn_scalar`, soft caps, the
sliding layers' RoPE) by `config_gemma.py`, those of partial and per-layer RoPE, LongRoPE and Granite's
multipliers by `config_variants.py`, DeepSeek-V3's latent attention and routing by `config_mla.py`, Qwen3.5's and
Qwen3-Next's linear-attention layers by `config_linear.py`.

Hub checkpoints spell their config the transformers-4 way (`rope_theta`, `rope_scaling`,
`torch_dtype`); transformers 5 writes `rope_parameters` and `dtype`. Both load; we write the
transformers-5 spelling, and keep every key we do not use so that a save round-trips it.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import config_checks as checks
from . import config_gemma, config_linear, config_mla, config_moe
from . import config_variants
from ..checkpoints.names import (
    GLM4_FUSED,
    GPT_OSS_NAMES,
    MIXTRAL_NAMES,
    PHI3_FUSED,
    QWEN3_5_FUSED,
    QWEN3_NEXT_FUSED,
    QWEN_MOE_NAMES,
    ExpertNames,
    FusedNames,
)
from .config_checks import ConfigError

CONFIG_NAME = "config.json"

# RoPE variants the decoder implements (see modeling.rope_inv_freq)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Family:
    """What distinguishes one architecture from the others."""

    architecture: str
    model_type: str
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3)
    qkv_bias_always: bool  # q/k/v carry a bias whatever the config says (Qwen2)
    o_bias_follows_attention_bias: bool  # attention_bias also adds a bias to o_proj (Llama, Qwen3)
    default_head_dim: Optional[int]  # None: hidden_size // num_attention_heads
    sliding_all_layers: bool  # sliding_window, when set, applies to every layer (Mistral)
    defaults: dict
    mlp: str = "dense"  # "dense": one MLP per layer; "moe": routed experts (on the layers config_moe says)
    expert_names: Optional[ExpertNames] = None  # how the Hub names one expert's tensors (MoE families)
    experts_key: str = "num_experts"  # the config.json key of the expert count (Mixtral: num_local_experts)
    expert_width_key: str = "moe_intermediate_size"  # the key of an expert's MLP width (Mixtral: intermediate_size)
    always_norm_topk: bool = False  # the top-k routing weights are always renormalised (Mixtral)
    routing_weights_fp32: bool = False  # routing weights stay float32 when they scale the experts (Mixtral)
    biases: bool = True  # attention_bias may add biases (False: Mixtral's projections never have one)
    sliding_needs_flag: bool = False  # sliding_window applies only with use_sliding_window (Qwen2, Qwen3, Qwen3-MoE)
    # Gemma 2 / Gemma 3 / OLMo 2 (`norm_variants.py`, `config_gemma.py`)
    norm: str = "rms"  # "rms" (Llama's), "offset" (Gemma: 1 + w, in float32), "float_weight" (OLMo 2: w in float32)
    norm_placement: str = "pre"  # "pre": norms before attention and MLP; "sandwich": also after each (Gemma);
    #                              "post": after each only (OLMo 2)
    qk_norm_over: str = "head"  # q/k norm per head ("head") or over the whole projection ("projection", OLMo 2)
    scaled_embedding: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    act_key: str = "hidden_act"  # the config.json key of the MLP's activation (Gemma: hidden_activation)
    gemma_keys: bool = False  # query_pre_attn_scalar, soft-capping (`config_gemma.py`)
    attn_softcap: bool = False  # attn_logit_softcapping applies to attention scores (Gemma 2, not Gemma 3)
    per_type_rope: bool = False  # sliding layers rotate with their own RoPE (Gemma 3: rope_local_base_freq)
    sliding_pattern: Optional[int] = None  # layer_types when the file has none: every n-th layer full (Gemma)
    sliding_pattern_key: Optional[str] = None  # the config.json key that overrides `sliding_pattern`
    fused_names: Optional[FusedNames] = None  # tensors the checkpoints store fused (Phi-3's qkv_proj, gate_up_proj;
    # Gated DeltaNet's in_proj_qkv and conv1d, `linear_attention.py`)
    rope_interleaved: bool = False  # RoPE rotates pairs of adjacent dims (GLM-4), not the two halves
    post_sublayer_norms: bool = False  # RMSNorm on attention's and the MLP's outputs (GLM-4's post_self_attn_layernorm,
    # post_mlp_layernorm)
    multipliers: bool = False  # Granite's embedding / attention / residual multipliers and logits_scaling
    rope_per_layer: bool = False  # no_rope_layers says which layers apply RoPE (SmolLM3)
    # gpt-oss (family math in attention_sinks.py and expert_activations.py)
    attention_sinks: bool = False  # a learned per-head logit joins each softmax as an extra column (`self_attn.sinks`)
    alternating_sliding: bool = False  # without layer_types: sliding on even layers, full on odd ones
    router_bias: bool = False  # the router (`mlp.gate`) carries a bias
    topk_before_softmax: bool = False  # top-k over the router logits, then softmax over the chosen k
    expert_bias: bool = False  # experts carry `gate_up_proj_bias` and `down_proj_bias`
    expert_activation: str = "swiglu"  # "swiglu" (gate rows, then up rows) or "clamped_swiglu" (interleaved)
    # DeepSeek-V3 (config_mla.py)
    attention: str = "mha"  # "mha": heads of keys and values; "mla": a latent per position (`latent_attention.py`)
    router: str = "softmax"  # "softmax" (`moe.route`) or "grouped_sigmoid" (`moe.route_grouped`: DeepSeek's
    #                          group-limited choice with a correction bias, shared experts beside the routed ones)
    # Qwen3.5 (config_linear.py): Gated DeltaNet layers among the full-attention ones, which are gated
    linear_attention: bool = False  # layer_types may name "linear_attention" (`linear_attention.py`)
    gated_attention: bool = False  # q_proj yields each head's query and a gate; the output times sigmoid(gate)
    gated_shared_expert: bool = False  # a `shared_expert` MLP beside the routed ones, times sigmoid(shared_expert_gate)
    fused_linear_projections: bool = (
        False  # Gated DeltaNet's in_proj_qkvz / in_proj_ba (Qwen3-Next, `fused_delta_net.py`)
    )
    ignored_weights: tuple = ()  # name prefixes of file tensors skipped at load, as transformers skips them (`mtp.`)


FAMILIES: dict[str, Family] = {
    "Qwen3ForCausalLM": Family(
        "Qwen3ForCausalLM",
        "qwen3",
        qk_norm=True,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=128,
        sliding_all_layers=False,
        defaults={"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "max_window_layers": 28},
        sliding_needs_flag=True,
    ),
    "LlamaForCausalLM": Family(
        "LlamaForCausalLM",
        "llama",
        qk_norm=False,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=None,
        sliding_all_layers=False,
        defaults={"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "Qwen2ForCausalLM": Family(
        "Qwen2ForCausalLM",
        "qwen2",
        qk_norm=False,
        qkv_bias_always=True,
        o_bias_follows_attention_bias=False,
        default_head_dim=None,
        sliding_all_layers=False,
        defaults={"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "max_window_layers": 28},
        sliding_needs_flag=True,
    ),
    "MistralForCausalLM": Family(
        "MistralForCausalLM",
        "mistral",
        qk_norm=False,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=False,
        default_head_dim=None,
        sliding_all_layers=True,
        defaults={
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "sliding_window": 4096,
        },
    ),
    "Qwen3MoeForCausalLM": Family(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        qk_norm=True,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=None,
        sliding_all_layers=True,
        defaults={
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "intermediate_size": 6144,
            "sliding_window": 4096,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
        },
        mlp="moe",
        expert_names=QWEN_MOE_NAMES,
        sliding_needs_flag=True,
    ),
    "MixtralForCausalLM": Family(
        "MixtralForCausalLM",
        "mixtral",
        qk_norm=False,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=False,
        default_head_dim=None,
        sliding_all_layers=True,
        defaults={
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "sliding_window": None,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
        mlp="moe",
        expert_names=MIXTRAL_NAMES,
        experts_key="num_local_experts",
        expert_width_key="intermediate_size",
        always_norm_topk=True,
        routing_weights_fp32=True,
        biases=False,
    ),
    "Gemma2ForCausalLM": Family(
        "Gemma2ForCausalLM",
        "gemma2",
        qk_norm=False,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=256,
        sliding_all_layers=False,
        defaults={
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
        norm="offset",
        norm_placement="sandwich",
        scaled_embedding=True,
        act_key="hidden_activation",
        gemma_keys=True,
        attn_softcap=True,
        sliding_pattern=2,
    ),
    "Gemma3ForCausalLM": Family(
        "Gemma3ForCausalLM",
        "gemma3_text",
        qk_norm=True,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=256,
        sliding_all_layers=False,
        defaults={
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
        },
        norm="offset",
        norm_placement="sandwich",
        scaled_embedding=True,
        act_key="hidden_activation",
        gemma_keys=True,
        per_type_rope=True,
        sliding_pattern=6,
        sliding_pattern_key="sliding_window_pattern",
    ),
    "Olmo2ForCausalLM": Family(
        "Olmo2ForCausalLM",
        "olmo2",
        qk_norm=True,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=None,
        sliding_all_layers=False,
        defaults={"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "pad_token_id": 1, "eos_token_id": 50279},
        norm="float_weight",
        norm_placement="post",
        qk_norm_over="projection",
    ),
    "Phi3ForCausalLM": Family(
        "Phi3ForCausalLM",
        "phi3",
        qk_norm=False,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=False,
        default_head_dim=None,
        sliding_all_layers=True,
        defaults={"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096},
        biases=False,
        fused_names=PHI3_FUSED,
    ),
    "Glm4ForCausalLM": Family(
        "Glm4ForCausalLM",
        "glm4",
        qk_norm=False,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=False,
        default_head_dim=128,
        sliding_all_layers=False,
        defaults={
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1.5625e-07,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
        },
        fused_names=GLM4_FUSED,
        rope_interleaved=True,
        post_sublayer_norms=True,
    ),
    "GraniteForCausalLM": Family(
        "GraniteForCausalLM",
        "granite",
        qk_norm=False,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=None,
        sliding_all_layers=False,
        defaults={"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
        multipliers=True,
    ),
    "SmolLM3ForCausalLM": Family(
        "SmolLM3ForCausalLM",
        "smollm3",
        qk_norm=False,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=None,
        sliding_all_layers=False,
        defaults={
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "num_key_value_heads": 4,
            "tie_word_embeddings": True,
        },
        sliding_needs_flag=True,
        rope_per_layer=True,
    ),
    "GptOssForCausalLM": Family(
        "GptOssForCausalLM",
        "gpt_oss",
        qk_norm=False,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=64,
        sliding_all_layers=False,
        defaults={
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 150000.0,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
            "sliding_window": 128,
            "attention_bias": True,
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "intermediate_size": 2880,
        },
        mlp="moe",
        expert_names=GPT_OSS_NAMES,
        experts_key="num_local_experts",
        expert_width_key="intermediate_size",
        always_norm_topk=True,
        attention_sinks=True,
        alternating_sliding=True,
        router_bias=True,
        topk_before_softmax=True,
        expert_bias=True,
        expert_activation="clamped_swiglu",
        norm="float_weight",
    ),
    "DeepseekV3ForCausalLM": Family(
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        qk_norm=False,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=None,
        sliding_all_layers=False,
        defaults={
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048,
            "n_shared_experts": 1,
            "n_group": 8,
            "topk_group": 4,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 3,
            "norm_topk_prob": True,
            "rope_interleave": True,
        },
        mlp="moe",
        expert_names=QWEN_MOE_NAMES,
        experts_key="n_routed_experts",
        routing_weights_fp32=True,
        attention="mla",
        router="grouped_sigmoid",
    ),
    "Qwen3_5ForCausalLM": Family(
        "Qwen3_5ForCausalLM",
        "qwen3_5_text",
        qk_norm=True,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=256,
        sliding_all_layers=False,
        defaults={
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "partial_rotary_factor": 0.25,
            "num_key_value_heads": 4,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
        },
        norm="offset",
        linear_attention=True,
        gated_attention=True,
        ignored_weights=("mtp.",),
        fused_names=QWEN3_5_FUSED,
    ),
    "Qwen3_5MoeForCausalLM": Family(
        "Qwen3_5MoeForCausalLM",
        "qwen3_5_moe_text",
        qk_norm=True,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=256,
        sliding_all_layers=False,
        defaults={
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "partial_rotary_factor": 0.25,
            "num_key_value_heads": 2,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "intermediate_size": 512,
        },  # (no dense layer: intermediate_size is never used)
        mlp="moe",
        expert_names=QWEN_MOE_NAMES,
        always_norm_topk=True,
        norm="offset",
        linear_attention=True,
        gated_attention=True,
        gated_shared_expert=True,
        ignored_weights=("mtp.",),
        fused_names=QWEN3_5_FUSED,
    ),
    "Qwen3NextForCausalLM": Family(  # Qwen3.5-MoE's layers with fused DeltaNet projections, Qwen3-MoE's dense layers
        "Qwen3NextForCausalLM",
        "qwen3_next",
        qk_norm=True,
        qkv_bias_always=False,
        o_bias_follows_attention_bias=True,
        default_head_dim=256,
        sliding_all_layers=False,
        defaults={
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "num_key_value_heads": 2,
            "partial_rotary_factor": 0.25,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "intermediate_size": 5632,
            "norm_topk_prob": True,
        },
        mlp="moe",
        expert_names=QWEN_MOE_NAMES,
        norm="offset",
        linear_attention=True,
        gated_attention=True,
        gated_shared_expert=True,
        fused_linear_projections=True,
        ignored_weights=("mtp.",),
        fused_names=QWEN3_NEXT_FUSED,
    ),
}

MODEL_TYPES = {f.model_type: f for f in FAMILIES.values()}
ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")

# keys this module turns into fields; everything else is kept in `extra` and written back unchanged
_HANDLED = {
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "transformers_version",
    *config_moe.HANDLED,
    *config_gemma.HANDLED,
}

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "float": torch.float32,
    "half": torch.float16,
}


def parse_dtype(value: Any, what: str = "dtype") -> Optional[torch.dtype]:
    """ "bfloat16" / "torch.bfloat16" / torch.bfloat16 -> torch.bfloat16; None -> None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.removeprefix("torch.").lower()
        if key in _DTYPES:
            return _DTYPES[key]
    raise ConfigError(f'{what}={value!r} is not a dtype we load: use "auto", "float32", "bfloat16" or "float16".')


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class ModelConfig:
    """One config for every family; field names are transformers' (a dense family's MoE fields stay at
    their defaults: `num_experts` 0)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # transformers' rope_parameters minus rope_theta; None = default
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: Optional[int] = None
    layer_types: Optional[list] = None  # "full_attention" / "sliding_attention" per layer
    use_sliding_window: Optional[bool] = None
    max_window_layers: Optional[int] = None
    dtype: Optional[torch.dtype] = None  # the checkpoint's dtype
    bos_token_id: Any = None
    eos_token_id: Any = None
    pad_token_id: Any = None
    # mixture of experts (config_moe.py reads them; transformers' names, Mixtral's num_local_experts included)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: Optional[int] = None  # an expert's MLP width
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    # Gemma (config_gemma.py): None where the family has no such key
    query_pre_attn_scalar: Optional[float] = None  # attention scale = its ** -0.5 (None: head_dim's)
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    rope_local: Optional[dict] = None  # the sliding layers' RoPE (rope_type, rope_theta, ...) when it differs
    # RoPE variants and Granite's scales (config_variants.py reads them)
    partial_rotary_factor: float = 1.0  # the fraction of each head that rotates
    no_rope_layers: Optional[list] = None  # SmolLM3: 1 where a layer applies RoPE, 0 where not
    embedding_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None  # the attention scale (None: head_dim ** -0.5)
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU (config_moe.py)
    swiglu_limit: float = 7.0
    # DeepSeek-V3 (config_mla.py): latent attention, and its routing
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0  # 0: not a latent-attention model
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE's gated shared expert (config_moe.py)
    # Qwen3.5's Gated DeltaNet layers (config_linear.py): 0 where the family has none
    linear_num_key_heads: int = 0
    linear_key_head_dim: int = 0
    linear_num_value_heads: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    extra: dict = field(default_factory=dict)

    # ---- derived flags -------------------------------------------------------------------------
    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    @property
    def attention_softcap(self) -> Optional[float]:
        """The soft cap on attention scores (Gemma 2), or None."""
        return self.attn_logit_softcapping if self.family.attn_softcap else None

    @property
    def qkv_bias(self) -> bool:
        return self.family.qkv_bias_always or (self.family.biases and self.attention_bias)

    @property
    def o_bias(self) -> bool:
        return self.family.o_bias_follows_attention_bias and self.family.biases and self.attention_bias

    @property
    def latent_attention(self) -> bool:
        """Whether attention keeps a latent per position (DeepSeek's MLA, `latent_attention.py`)."""
        return self.family.attention == "mla"

    @property
    def rope_interleaved(self) -> bool:
        """Whether RoPE rotates adjacent pairs (GLM-4; DeepSeek with `rope_interleave`), not the two halves."""
        return self.family.rope_interleaved or (self.latent_attention and self.rope_interleave)

    def layer_is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is Gated DeltaNet linear attention (Qwen3.5), with a recurrent state per request."""
        return self.layer_types is not None and self.layer_types[layer] == config_linear.LINEAR

    @property
    def has_linear_attention(self) -> bool:
        return any(self.layer_is_linear(i) for i in range(self.num_hidden_layers))

    @property
    def is_moe(self) -> bool:
        """Whether some layer routes tokens to experts."""
        return any(self.layer_is_sparse(i) for i in range(self.num_hidden_layers))

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` is a mixture of experts (transformers' rule: not in `mlp_only_layers`, and
        every `decoder_sparse_step`-th layer), or a dense MLP."""
        return config_moe.layer_is_sparse(self, layer)

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @property
    def rotary_dim(self) -> int:
        """How many dims of each head rotate (the first ones; `partial_rotary_factor`)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates q and k (SmolLM3's `no_rope_layers`: 1 where it does)."""
        return self.no_rope_layers is None or bool(self.no_rope_layers[layer])

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of one layer, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        return self.sliding_window if self.family.sliding_all_layers else None

    @property
    def num_parameters(self) -> int:
        h, i, v, hd = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv) * self.qkv_bias + h * self.o_bias
        attn += ((q + kv) if self.family.qk_norm_over == "projection" else 2 * hd) * self.qk_norm
        if self.family.gated_attention:  # q_proj's gate rows
            attn += h * q + q * self.qkv_bias
        if self.latent_attention:
            attn = config_mla.attention_parameters(self)
        norms = (
            {"pre": 2, "sandwich": 4, "post": 2}[self.family.norm_placement] + 2 * self.family.post_sublayer_norms
        ) * h
        attn += self.num_attention_heads * self.family.attention_sinks
        dense = 3 * h * i + (2 * i + h) * self.mlp_bias
        sparse = config_moe.moe_parameters(self)
        mlps = sum(sparse if self.layer_is_sparse(n) else dense for n in range(self.num_hidden_layers))
        mixers = sum(
            config_linear.linear_parameters(self) if self.layer_is_linear(n) else attn
            for n in range(self.num_hidden_layers)
        )
        return v * h * (1 if self.tie_word_embeddings else 2) + mixers + self.num_hidden_layers * norms + mlps + h

    # ---- reading ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        """Build the config, every value it uses checked first (`config_checks`: one sentence per bad key)."""
        d = dict(raw)
        arch = _architecture(d, source)
        fam = FAMILIES[arch]
        d = {**fam.defaults, **d}  # an explicit null (Mistral's sliding_window) stays null
        if raw.get("rope_scaling") is not None and raw.get("rope_parameters") is None:
            d.pop("rope_parameters", None)  # a family's default RoPE (gpt-oss: YaRN) only when the file names none
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in d or d[key] is None:
                raise ConfigError(f"{source} has no {key!r}: it must be a positive integer.")
            checks.positive_int(d[key], key, source)
        if d.get("max_position_embeddings") is None:
            raise ConfigError(f"{source} has no 'max_position_embeddings': it must be a positive integer.")
        checks.positive_int(d["max_position_embeddings"], "max_position_embeddings", source)
        heads, layers, vocab = d["num_attention_heads"], d["num_hidden_layers"], d["vocab_size"]
        kv_heads = checks.optional_positive_int(d.get("num_key_value_heads"), "num_key_value_heads", source) or heads
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}."
            )
        head_dim = checks.optional_positive_int(d.get("head_dim"), "head_dim", source)
        head_dim = head_dim or fam.default_head_dim or d["hidden_size"] // heads
        if head_dim % 2:
            raise ConfigError(f"{source}: head_dim={head_dim} is odd: rotary embeddings need an even head_dim.")
        if fam.model_type == "phi3":
            d = config_variants.phi3_rope_type(d)
        latent = config_mla.read(d, fam, layers, source)
        if latent:
            head_dim = latent["qk_rope_head_dim"]  # the RoPE tables' width, as transformers sets head_dim
        theta, scaling = _rope(d, source)
        variants = config_variants.read(d, fam, layers, head_dim, source)
        if scaling is not None and scaling["rope_type"] == "longrope":
            rotary = config_variants.rotary_dim(head_dim, variants["partial_rotary_factor"], source)
            scaling = config_variants.longrope(scaling, d, rotary, source)
        sliding = checks.optional_positive_int(d.get("sliding_window"), "sliding_window", source)
        use_sliding = checks.optional_boolean(d.get("use_sliding_window"), "use_sliding_window", source)
        max_window_layers = d.get("max_window_layers")
        if max_window_layers is not None:
            checks.non_negative_int(max_window_layers, "max_window_layers", source)
        layer_types = d.get("layer_types")
        if fam.linear_attention:
            layer_types = config_linear.layer_types(d, layers, source)
        elif layer_types is not None:
            checks.string_list(layer_types, "layer_types", source, LAYER_TYPES, layers)
        if fam.sliding_needs_flag and not use_sliding:
            sliding = None
        if fam.model_type in ("qwen2", "qwen3"):
            if layer_types is None and sliding is not None:
                mwl = max_window_layers if max_window_layers is not None else 28
                layer_types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(layers)]
        if fam.rope_per_layer and layer_types is None:
            layer_types = config_variants.smollm3_layer_types(variants["no_rope_layers"], sliding)
        if fam.alternating_sliding and layer_types is None:
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        if layer_types is None:
            layer_types = config_gemma.default_layer_types(fam, d, layers, source)
        act = checks.string(d.get(fam.act_key, "silu"), fam.act_key, source)
        if act not in ACTIVATIONS:
            raise ConfigError(f"{source}: {fam.act_key}={act!r} is not supported: use one of {', '.join(ACTIVATIONS)}.")
        if fam.mlp == "moe" and act not in ("silu", "swish"):
            raise ConfigError(f'{source}: {fam.act_key}={act!r}: {arch}\'s experts compute SiLU only: use "silu".')
        dtype = d.get("dtype", d.get("torch_dtype"))
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=d["max_position_embeddings"],
            rms_norm_eps=checks.positive_number(d.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=checks.boolean(d.get("tie_word_embeddings"), "tie_word_embeddings", source),
            attention_bias=checks.boolean(d.get("attention_bias"), "attention_bias", source),
            mlp_bias=checks.boolean(d.get("mlp_bias"), "mlp_bias", source),
            hidden_act=act,
            sliding_window=sliding,
            layer_types=layer_types,
            use_sliding_window=use_sliding,
            max_window_layers=max_window_layers,
            dtype=parse_dtype(dtype, f"{source}: dtype") if dtype is not None else None,
            bos_token_id=checks.token_ids(d.get("bos_token_id"), "bos_token_id", source, vocab, allow_list=False),
            eos_token_id=checks.token_ids(d.get("eos_token_id"), "eos_token_id", source, vocab, allow_list=True),
            pad_token_id=checks.token_ids(d.get("pad_token_id"), "pad_token_id", source, vocab, allow_list=False),
            **config_moe.read(d, raw, fam, layers, source),
            **config_gemma.read(d, fam, source, _rope),
            **variants,
            **latent,
            **config_linear.read(d, fam, source),
            extra={
                k: copy.deepcopy(v)
                for k, v in raw.items()
                if k not in _HANDLED
                and k not in config_variants.handled(fam)
                and k not in config_mla.handled(fam)
                and k not in config_linear.handled(fam)
            },
        )

    @classmethod
    def from_json_file(cls, path: str) -> "ModelConfig":
        from ..checkpoints.json_files import read_json_object

        raw = read_json_object(path, "restore the file from the checkpoint's source", ConfigError)
        return cls.from_dict(raw, source=path)

    @classmethod
    def from_pretrained(cls, name_or_path: str, **hub_kwargs) -> "ModelConfig":
        from ..checkpoints.hub import resolve_file

        return cls.from_json_file(resolve_file(name_or_path, CONFIG_NAME, **hub_kwargs))

    # ---- writing -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The transformers-5 spelling (`rope_parameters`, `dtype`)."""
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        if self.partial_rotary_factor != 1.0 or self.model_type in ("phi3", "glm4"):
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        out = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type not in ("qwen2", "mixtral"):
            out["attention_bias"] = self.attention_bias
        if self.model_type in ("llama", "granite", "smollm3"):
            out["mlp_bias"] = self.mlp_bias
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = bool(self.use_sliding_window)
            out["sliding_window"] = self.sliding_window
            out["max_window_layers"] = self.max_window_layers if self.max_window_layers is not None else 28
            out["layer_types"] = self.layer_types or ["full_attention"] * self.num_hidden_layers
        elif self.model_type == "qwen3_moe":
            out["use_sliding_window"] = bool(self.use_sliding_window)
            out["sliding_window"] = self.sliding_window
        elif self.model_type in ("mistral", "mixtral", "phi3"):
            out["sliding_window"] = self.sliding_window
        elif self.model_type == "smollm3":
            out["use_sliding_window"] = bool(self.use_sliding_window)
            out["sliding_window"] = self.sliding_window
            out["layer_types"] = self.layer_types or ["full_attention"] * self.num_hidden_layers
        elif self.family.alternating_sliding:
            out["sliding_window"] = self.sliding_window
            out["layer_types"] = self.layer_types
        elif self.family.linear_attention:
            out["layer_types"] = list(self.layer_types)
        if self.model_type == "phi3":
            out.pop("attention_bias", None)  # Phi-3's projections never carry a bias
        out.update(config_moe.write(self))
        config_gemma.write(self, out)
        out.update(config_variants.write(self))
        out.update(config_mla.write(self))
        out.update(config_linear.write(self))
        if self.dtype is not None:
            out["dtype"] = dtype_name(self.dtype)
        out.update(copy.deepcopy(self.extra))
        return out

    def save_pretrained(self, directory: str) -> None:
        """Write config.json, replacing an older one in one rename (a kill leaves the old or the new)."""
        from ..utils.atomic_files import write_text_atomic

        os.makedirs(directory, exist_ok=True)
        write_text_atomic(
            os.path.join(directory, CONFIG_NAME), json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"
        )


def _architecture(d: dict, source: str) -> str:
    archs = d.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(
            f'{source}: architectures={archs!r} must be a list of class names such as ["Qwen3ForCausalLM"].'
        )
    if d.get("model_type") is not None:
        checks.string(d["model_type"], "model_type", source)
    supported = ", ".join(FAMILIES)
    for arch in archs:
        if arch in FAMILIES:
            return arch
    if not archs and d.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[d["model_type"]].architecture
    named = ", ".join(archs) if archs else f"model_type {d.get('model_type')!r}"
    raise ConfigError(f"{source} describes {named}, which staticformers does not support: supported are {supported}.")


def _rope(d: dict, source: str) -> tuple[float, Optional[dict]]:
    """(rope_theta, scaling dict or None) from either spelling, every value checked."""
    params = checks.mapping(d.get("rope_parameters"), "rope_parameters", source)
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type form; these families use one
    params = dict(params)
    legacy = checks.mapping(d.get("rope_scaling"), "rope_scaling", source)
    if legacy:
        params = {**dict(legacy), **params}
    theta = params.pop("rope_theta", d.get("rope_theta", 10000.0))
    theta = checks.positive_number(theta, "rope_theta", source, above=1.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    params.pop("type", None)
    params.pop("partial_rotary_factor", None)  # config_variants.py reads it
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{source}: RoPE scaling {rope_type!r} is not supported yet: supported are {', '.join(ROPE_TYPES)}."
        )
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if "factor" not in params and rope_type != "longrope":  # LongRoPE's defaults to max / original positions
        raise ConfigError(f"{source}: rope scaling {rope_type!r} needs a 'factor'.")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise ConfigError(f"{source}: rope scaling 'llama3' needs {key!r}.")
    checks.rope_parameters(params, rope_type, source)
    return theta, params


class AutoConfig:
    """`AutoConfig.from_pretrained(path)` as in transformers, returning a ModelConfig."""

    @staticmethod
    def from_pretrained(name_or_path: str, **hub_kwargs) -> ModelConfig:
        return ModelConfig.from_pretrained(name_or_path, **hub_kwargs)

    @staticmethod
    def for_model(model_type: str, **kwargs) -> ModelConfig:
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported: supported are {', '.join(MODEL_TYPES)}.")
        return ModelConfig.from_dict(
            {"model_type": model_type, **kwargs}, source=f"AutoConfig.for_model({model_type!r})"
        )
