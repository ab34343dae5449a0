"""GGUF tensor names <-> Hugging Face parameter names, and the llama Q/K row order undone.

Why this exists: a GGUF file renames every tensor (`blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight`)
and, for the llama architecture, its converter permutes the rows of q_proj and k_proj from the Hub's
rotate-half order to interleaved pairs. Loading must undo that exactly as transformers' GGUF loader does
(`LlamaTensorProcessor._reverse_permute_weights`); qwen2 and qwen3 files are stored unpermuted.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# tensors some files carry that hold nothing a Hugging Face model loads (llama 3's precomputed RoPE factors)
IGNORED = ("rope_freqs.weight",)


def hf_name(gguf_name: str) -> Optional[str]:
    """The Hugging Face name of a GGUF tensor, or None for one we do not know."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m is None or m.group(2) not in _LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo the GGUF converter's permutation of a q/k projection of `heads` heads (rows, and a bias alike)."""
    dim = weight.shape[0] // heads // 2
    w = weight.reshape(heads, dim, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def restore(arch: str, gguf_name: str, value: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """`value` as the Hugging Face checkpoint holds it: llama's q and k rows back in rotate-half order."""
    if arch != "llama":
        return value
    if ".attn_q." in gguf_name:
        return unpermute(value, heads)
    if ".attn_k." in gguf_name:
        return unpermute(value, kv_heads)
    return value


__all__ = ["IGNORED", "hf_name", "restore", "unpermute"]
