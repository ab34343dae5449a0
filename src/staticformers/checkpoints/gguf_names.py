"""GGUF tensor names <-> Hugging Face parameter names, and what GGUF's converter did to the values undone.

Why this exists: a GGUF file renames every tensor (`blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight`),
and its converter changes some values on the way. Loading must undo that exactly as transformers' GGUF loader
does:
- llama: q_proj and k_proj rows permuted from the Hub's rotate-half order to interleaved pairs
  (`LlamaTensorProcessor._reverse_permute_weights`); qwen2, qwen3, gemma2, gemma3 and phi3 files are unpermuted;
- gemma2 / gemma3: every `*norm.weight` stored as 1 + w, since Gemma's RMSNorm scales by 1 + w
  (`Gemma2TensorProcessor`: minus 1); their sandwich norms are named `post_attention_norm` (after attention),
  `ffn_norm` (before the MLP, where llama's `ffn_norm` is `post_attention_layernorm`) and `post_ffw_norm`;
- phi3: q/k/v stored fused as `attn_qkv` (q's rows, then k's, then v's) and gate/up as `ffn_up` (gate's rows,
  then up's), the Hub's own `qkv_proj` / `gate_up_proj`; the model holds the parts split, so such a tensor
  names its parts in row order and loading takes each part's rows.
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
_LAYER: dict[str, tuple[str, ...]] = {
    "attn_norm": ("input_layernorm",),
    "ffn_norm": ("post_attention_layernorm",),
    "attn_q": ("self_attn.q_proj",),
    "attn_k": ("self_attn.k_proj",),
    "attn_v": ("self_attn.v_proj",),
    "attn_output": ("self_attn.o_proj",),
    "attn_q_norm": ("self_attn.q_norm",),
    "attn_k_norm": ("self_attn.k_norm",),
    "ffn_gate": ("mlp.gate_proj",),
    "ffn_up": ("mlp.up_proj",),
    "ffn_down": ("mlp.down_proj",),
}
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_norm": ("post_attention_layernorm",),
    "ffn_norm": ("pre_feedforward_layernorm",),
    "post_ffw_norm": ("post_feedforward_layernorm",),
}
_PHI3_LAYER = {
    **_LAYER,
    "attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "ffn_up": ("mlp.gate_proj", "mlp.up_proj"),
}
_LAYERS: dict[str, dict[str, tuple[str, ...]]] = {"gemma2": _GEMMA_LAYER, "gemma3": _GEMMA_LAYER, "phi3": _PHI3_LAYER}
_NORM_PLUS_ONE = ("gemma2", "gemma3")
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# tensors some files carry that hold nothing a Hugging Face model loads (llama 3's precomputed RoPE factors)
IGNORED = ("rope_freqs.weight",)


def hf_names(gguf_name: str, arch: str = "llama") -> Optional[tuple[str, ...]]:
    """The Hugging Face name(s) of a GGUF tensor of an `arch` file: one, or a fused tensor's parts in row order;
    None for a tensor we do not know."""
    if gguf_name in _GLOBAL:
        return (_GLOBAL[gguf_name],)
    m = _BLOCK.match(gguf_name)
    layer = _LAYERS.get(arch, _LAYER)
    if m is None or m.group(2) not in layer:
        return None
    return tuple(f"model.layers.{m.group(1)}.{part}.{m.group(3)}" for part in layer[m.group(2)])


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo the GGUF converter's permutation of a q/k projection of `heads` heads (rows, and a bias alike)."""
    dim = weight.shape[0] // heads // 2
    w = weight.reshape(heads, dim, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def restore(arch: str, gguf_name: str, value: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """`value` (float32) as the Hugging Face checkpoint holds it: llama's q and k rows back in rotate-half order,
    Gemma's norm weights minus 1."""
    if arch in _NORM_PLUS_ONE and gguf_name.endswith("norm.weight"):
        return value - 1.0
    if arch != "llama":
        return value
    if ".attn_q." in gguf_name:
        return unpermute(value, heads)
    if ".attn_k." in gguf_name:
        return unpermute(value, kv_heads)
    return value


__all__ = ["IGNORED", "hf_names", "restore", "unpermute"]
