"""Tiny random checkpoints in Hugging Face format, built by transformers (the oracle) for tests.

Every family the library supports has an entry; tests save one to a temporary folder and load it
with both staticformers and transformers. Nothing is downloaded.
"""

from __future__ import annotations

import os

import torch

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

# name -> (transformers config class name, extra config)
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-untied": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False)),
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3-scaled": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "llama-linear": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ),
    "qwen3-yarn": (
        "Qwen3Config",
        dict(
            head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mistral-window": ("MistralConfig", dict(sliding_window=5)),
    # mixtures of experts: 4 experts, top-2; Qwen3-MoE with a dense layer between two sparse ones
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # Gemma 2: soft-capping on (weights 5x the default scale and small caps, so that both bite), a window of 4
    # on its sliding layers (0 and 2), query_pre_attn_scalar unlike head_dim, untied
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=4,
            query_pre_attn_scalar=24,
            initializer_range=0.1,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=3.0,
            tie_word_embeddings=False,
        ),
    ),
    # Gemma 3 (text): sliding layers 0, 1, 3 (window 5, RoPE base 10000), full layer 2 (base 1e6 with linear
    # scaling), q/k norm, tied
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            sliding_window=5,
            query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            },
        ),
    ),
    # OLMo 2: post-norms only, q/k norm over the whole projection, q/k/v/o biases
    "olmo2": ("Olmo2Config", dict(attention_bias=True, eos_token_id=2)),
    # fused qkv_proj / gate_up_proj on disk; Phi-4-mini's partial rotary (0.75 of head_dim 16) with LongRoPE short and
    # long factors (6 each) switching at 64 positions (attention factor from max_position_embeddings / 64)
    "phi3": ("Phi3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "phi4-longrope": (
        "Phi3Config",
        dict(
            num_hidden_layers=3,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [1.5, 2.5, 4.0, 6.0, 9.0, 14.0],
            },
        ),
    ),
    # GLM-4: interleaved partial RoPE (0.5), q/k/v biases, fused gate_up_proj, norms after attention and MLP
    "glm4": ("Glm4Config", dict(head_dim=16, pad_token_id=0, eos_token_id=[2, 3])),
    # Granite 3: the four multipliers, biases on attention and MLP
    "granite": (
        "GraniteConfig",
        dict(
            embedding_multiplier=4.0,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            logits_scaling=3.0,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    # SmolLM3: layers 1 and 3 without RoPE (sliding over 6 positions there), YaRN on the others
    "smollm3": (
        "SmolLM3Config",
        dict(
            num_hidden_layers=4,
            no_rope_layers=[1, 0, 1, 0],
            use_sliding_window=True,
            sliding_window=6,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 2.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # gpt-oss: attention sinks, sliding (window 4) and full layers alternating, YaRN (gpt-oss's truncate=False),
    # biased router and experts, the clamped SwiGLU over interleaved gate/up (weights at std 0.1, so that the
    # tokens, not the biases, decide the routing and the clamp is reached)
    "gpt-oss": (
        "GptOssConfig",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            initializer_range=0.1,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            sliding_window=4,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # DeepSeek-V3: latent attention (q LoRA, kv LoRA 32, RoPE part 16 interleaved, value heads 24 unlike the key
    # part 32), YaRN with mscale_all_dim, 8 routed experts in 4 groups (2 groups, top-3), a shared expert, layer
    # 0 dense (intermediate_size), a correction bias (randomised by build_hf_model); attention biases on
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=24,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            attention_bias=True,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
    # DeepSeek-V3 without q LoRA (one q_proj), RoPE over the halves, one group, two shared experts' width, every
    # layer sparse, weights not renormalised
    "deepseek-v3-plain": (
        "DeepseekV3Config",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=2,
            first_k_dense_replace=0,
            rope_interleave=False,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        ),
    ),
    # Qwen3.5 (text): layers 0-2 Gated DeltaNet (2 key heads of 16, 4 value heads of 8, kernel 4), layer 3 gated full
    # attention with q/k norm and a quarter of each head rotating; the 1 + w norms
    "qwen3_5": (
        "Qwen3_5TextConfig",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_num_value_heads=4,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3.5-MoE (text): the same hybrid layout, every layer's MLP 4 experts top-2 beside a gated shared expert
    "qwen3_5-moe": (
        "Qwen3_5MoeTextConfig",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_num_value_heads=4,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3-Next: Qwen3.5-MoE's layout with the DeltaNet projections fused (in_proj_qkvz, in_proj_ba; 2 value heads per
    # key head, so the per-group interleaving matters), layer 1's MLP dense (mlp_only_layers), the top-k weights not
    # renormalised, q/k/v/o biases (the gated q_proj's bias too)
    "qwen3-next": (
        "Qwen3NextConfig",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_num_value_heads=4,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
GEMMA_FAMILIES = ("gemma2", "gemma3", "olmo2")
MOE_FAMILIES = (
    "qwen3-moe",
    "mixtral",
    "gpt-oss",
    "deepseek-v3",
    "qwen3_5-moe",
    "qwen3-next",
)  # (deepseek-v3-plain: test_deepseek.py)
DEEPSEEK_FAMILIES = ("deepseek-v3", "deepseek-v3-plain")
LINEAR_FAMILIES = (
    "qwen3_5",
    "qwen3_5-moe",
    "qwen3-next",
)  # hybrids: Gated DeltaNet layers with a recurrent state per request


def hf_config(family: str, **overrides):
    import transformers

    cls_name, extra = FAMILIES[family]
    return getattr(transformers, cls_name)(**{**BASE, **extra, **overrides})


def build_hf_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A transformers model with random weights (biases and gpt-oss's attention sinks randomised too, so they
    are tested; a mixture's router and experts scaled up, so that routing is decisive and a wrong expert
    shows in the logits)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(".sinks"):  # gpt-oss's sink logits, large enough to matter
                p.add_(torch.randn_like(p))
            if (
                (".mlp.gate.weight" in name and family not in DEEPSEEK_FAMILIES)
                or ".mlp.router." in name
                or ".experts." in name
            ):  # (DeepSeek's sigmoid scores would saturate and tie)
                p.mul_(5.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's correction bias, large enough to matter
                b.add_(torch.randn_like(b) * 0.1)
    return model.eval()


def save_tiny(family: str, directory: str, seed: int = 0, dtype=torch.float32, **overrides) -> str:
    """Save a tiny random checkpoint of `family` into `directory` (created) and return the path."""
    os.makedirs(directory, exist_ok=True)
    build_hf_model(family, seed=seed, dtype=dtype, **overrides).save_pretrained(directory)
    return directory


def save_served(family: str, directory, positions: int = 256) -> str:
    """A tiny `family` checkpoint with a Qwen-style tokenizer and chat template (tools included) in
    `directory`: what the server tests serve. Returns the folder."""
    from staticformers import AutoTokenizer
    from tokenizer_fixtures import build_qwen

    build_qwen(directory)
    tok = AutoTokenizer.from_pretrained(str(directory))
    build_hf_model(
        family, vocab_size=len(tok), max_position_embeddings=positions, eos_token_id=tok.eos_token_id
    ).save_pretrained(str(directory))
    return str(directory)
