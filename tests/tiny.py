"""Tiny random checkpoints in Hugging Face format, built by transformers (the oracle) for tests.

Every family the library supports has an entry; tests save one to a temporary folder and load it
with both staticformers and transformers. Nothing is downloaded.
"""

from __future__ import annotations

import os

import torch

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

# name -> (transformers config class name, extra config)
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-untied": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False)),
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3-scaled": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 64})),
    "llama-linear": ("LlamaConfig", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen3-yarn": ("Qwen3Config", dict(head_dim=16, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                                     "factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mistral-window": ("MistralConfig", dict(sliding_window=5)),
    # mixtures of experts: 4 experts, top-2; Qwen3-MoE with a dense layer between two sparse ones
    "qwen3-moe": ("Qwen3MoeConfig", dict(head_dim=16, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, mlp_only_layers=[1], tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # gpt-oss: attention sinks, sliding (window 4) and full layers alternating, YaRN (gpt-oss's truncate=False),
    # biased router and experts, the clamped SwiGLU over interleaved gate/up (weights at std 0.1, so that the
    # tokens, not the biases, decide the routing and the clamp is reached)
    "gpt-oss": ("GptOssConfig", dict(head_dim=16, num_hidden_layers=3, initializer_range=0.1, num_local_experts=4,
                                     num_experts_per_tok=2, intermediate_size=32, sliding_window=4, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                      "original_max_position_embeddings": 64})),
}
MOE_FAMILIES = ("qwen3-moe", "mixtral", "gpt-oss")


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
            if ".mlp.gate.weight" in name or ".mlp.router." in name or ".experts." in name:
                p.mul_(5.0)
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
    build_hf_model(family, vocab_size=len(tok), max_position_embeddings=positions,
                   eos_token_id=tok.eos_token_id).save_pretrained(str(directory))
    return str(directory)
