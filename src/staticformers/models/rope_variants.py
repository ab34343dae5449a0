"""Applying RoPE (`apply_rope`: the Llama form, `rotate_half`) and its forms beyond Llama's: partial rotation,
GLM's interleaved pairs, and LongRoPE's two factor sets.

- **Partial rotation** (`partial_rotary_factor`, Phi-3/Phi-4-mini and GLM-4): the cos/sin tables cover
  the first `rotary_dim` dims of a head; those rotate and the rest pass through unchanged.
- **Interleaved pairs** (GLM-4): transformers' `glm4.apply_rotary_pos_emb` rotates adjacent dims
  `(0, 1), (2, 3), ...` with frequencies `f0, f0, f1, f1, ...` (`rotate_pairs`), where the Llama form
  rotates dim `i` with dim `i + rotary_dim / 2`. The tables are built interleaved once per forward
  (`interleave`), from the same cos/sin values transformers computes.
- **LongRoPE** (`rope_type` "longrope", Phi-3-128k and Phi-4-mini): inverse frequencies divided by
  `short_factor` or by `long_factor` per rotated pair, cos/sin scaled by an attention factor
  (`sqrt(1 + ln(factor) / ln(original))`, `factor` defaulting to max / original positions).
  transformers picks the set per forward call from the largest position it sees (long beyond
  `original_max_position_embeddings`), and throws its cache away to recompute the keys with the long
  set when a generation crosses that length. A static-shape engine cannot change factor sets under a
  cache, so the choice is made per compiled shape, from the number of key positions attention covers
  (`uses_long_factors`): the cache's length, or the sequence's without a cache. A plan whose KV
  lengths fit the original context therefore runs the short set everywhere, as transformers does for
  every sequence that fits it; a cache longer than the original context runs the long set from the
  first token, as transformers does for a sequence longer than that once it has crossed it. They
  differ only for a short sequence run in a cache longer than the original context (the long set here,
  the short one in transformers until the crossing).
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def longrope_inv_freq(config, long: bool, device: Optional[torch.device] = None) -> torch.Tensor:
    """LongRoPE's inverse frequencies with the short (or `long`) factors, over `config.rotary_dim` dims."""
    scaling, dim = config.rope_scaling, config.rotary_dim
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (factors * config.rope_theta**shape)


def longrope_attention_factor(config) -> float:
    """The factor LongRoPE applies to cos/sin: `attention_factor`, else transformers' default from `factor`
    (or max_position_embeddings / original_max_position_embeddings)."""
    scaling = config.rope_scaling
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def uses_long_factors(config, key_positions: int) -> bool:
    """Whether attention over `key_positions` keys runs LongRoPE's long factors (module docstring)."""
    scaling = config.rope_scaling or {}
    return scaling.get("rope_type") == "longrope" and key_positions > scaling["original_max_position_embeddings"]


def interleave(table: torch.Tensor) -> torch.Tensor:
    """A cos or sin table `[..., rotary_dim]` in the Llama layout (`f0..fn, f0..fn`) as GLM's pairs
    (`f0, f0, f1, f1, ...`), as transformers' glm4 builds it."""
    return table[..., : table.shape[-1] // 2].repeat_interleave(2, dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GLM's `rotate_half`: `(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)`."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate) -> torch.Tensor:
    """`x`'s first `cos.shape[-1]` dims rotated by `rotate`, the rest passed through (cos/sin broadcast)."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat([rot * cos + rotate(rot) * sin, rest], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [batch, seq, rotary_dim] (fewer dims than a head: only
    those rotate); `interleaved`: GLM's adjacent pairs (`rope_variants`)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if interleaved or cos.shape[-1] != x.shape[-1]:
        return rotate_part(x, cos, sin, rotate_pairs if interleaved else rotate_half)
    return x * cos + rotate_half(x) * sin


__all__ = [
    "rotate_half",
    "apply_rope",
    "longrope_inv_freq",
    "longrope_attention_factor",
    "uses_long_factors",
    "interleave",
    "rotate_pairs",
    "rotate_part",
]
