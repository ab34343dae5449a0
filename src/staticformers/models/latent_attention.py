"""Multi-head latent attention (DeepSeek-V2/V3's MLA): a cache of one latent per position, the up-projections
absorbed into the query and the output.

transformers' DeepSeek-V3 attention projects each token to a latent `c` (`kv_a_proj_with_mqa`, then
`kv_a_layernorm`; `kv_lora_rank` wide) and a key part `k_pe` that carries RoPE (`qk_rope_head_dim`, one for
every head), caches those two, and expands the latent into each head's key (`k_nope`) and value through
`kv_b_proj`. Here the cache keeps `[c, k_pe]` per position (`kv_lora_rank + qk_rope_head_dim` values, the
latent size, not `heads * (key + value)` dims), and `kv_b_proj` is never applied to the cached positions:
its two halves per head, `W_uk` `[heads, qk_nope_head_dim, kv_lora_rank]` and `W_uv` `[heads, v_head_dim,
kv_lora_rank]`, are absorbed as DeepSeek's own inference does:

    q_nope . k_nope = q_nope . (W_uk c) = (W_uk^T q_nope) . c
    sum_j p_j (W_uv c_j) = W_uv (sum_j p_j c_j)

so each head's query becomes `[W_uk^T q_nope, q_pe]` and attends over the cache as one shared key head
`[c, k_pe]` whose values are its first `kv_lora_rank` columns (a view, `kv_cache.py`), and the head's
output is `W_uv` times the attended latent (with tensor parallel each rank holds its heads' rows of `kv_b_proj`
and the whole latent). That is exact algebra: the scores and outputs equal
transformers' up to float rounding (sums in another order). The attention itself goes through the ops
seam as any other (`ops.attention`), with values narrower than the keys.

The scale is `(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`, times YaRN's `mscale(factor, mscale_all_dim)`
squared when the RoPE is YaRN with `mscale_all_dim` (transformers' `yarn_apply_mscale`). The two inner norms
use transformers' default epsilon (1e-6), not `rms_norm_eps`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .kept_positions import Keep, kept_rows, take
from .model_config import ModelConfig
from .norm_variants import RMSNorm
from .ops import PLAIN, Ops
from .rope_variants import apply_rope

INNER_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with its default


def latent_scale(config: ModelConfig) -> float:
    """The softmax scale: the query/key head's `** -0.5`, with YaRN's `mscale_all_dim` correction squared."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_scaling or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """A projection's weight as it computes: an int8 or fp8 one dequantised (`QuantLinear.dequantized`); this
    process's rows when tensor parallel split them (a DTensor's local part, its gradient flowing back to it)."""
    dequantized = getattr(layer, "dequantized", None)
    w = dequantized() if dequantized is not None else layer.weight
    to_local = getattr(w, "to_local", None)
    return to_local() if to_local is not None else w


class LatentAttention(nn.Module):
    """DeepSeek-V3's attention under transformers' module names (`q_a_proj`, `q_a_layernorm`, `q_b_proj` or
    `q_proj`; `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`; `o_proj`). Attributes the decoder layer
    reads of any attention: `window` (None), `rope` (True), `sinks` (None)."""

    window = None
    rope = True
    sinks = None
    absorbed = ("kv_b_proj",)  # projections whose weight is used as a matrix, never called (no adapter on them)

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.layer_idx = layer_idx
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank, self.v_dim = config.kv_lora_rank, config.v_head_dim
        qk = self.nope + self.rope_dim
        bias = config.attention_bias
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, INNER_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, INNER_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=bias)
        # the latent every head reads, as one module's output: an identity here, where a parallel layout that
        # splits the heads hooks in (tensor parallel sums its gradient over the ranks' heads)
        self.shared_latent = nn.Identity()
        self.scale = latent_scale(config)
        self.interleaved = config.rope_interleaved

    def keys_values(self, x, cos, sin, ops: Ops = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache keeps of `x` (the layer's normalised input): the latent keys `[b, 1, s, kv_lora_rank +
        qk_rope_head_dim]` (`[c, k_pe]`, `k_pe` rotated) and their values, the first `kv_lora_rank` columns (a view)."""
        b, s, _ = x.shape
        c, k_pe = ops.linear(self.kv_a_proj_with_mqa, x).split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c).view(b, 1, s, self.rank)
        k_pe = apply_rope(k_pe.view(b, 1, s, self.rope_dim), cos, sin, self.interleaved)
        keys = self.shared_latent(torch.cat([c, k_pe], dim=-1))
        return keys, keys[..., : self.rank]

    def queries(self, x, cos, sin, ops: Ops) -> torch.Tensor:
        """Each head's query `[b, heads, s, qk_nope + qk_rope]`, its RoPE part rotated."""
        b, s, _ = x.shape
        if hasattr(self, "q_proj"):
            q = ops.linear(self.q_proj, x)
        else:
            q = ops.linear(self.q_b_proj, self.q_a_layernorm(ops.linear(self.q_a_proj, x)))
        q = q.view(b, s, -1, self.nope + self.rope_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        return torch.cat([q_nope, apply_rope(q_pe, cos, sin, self.interleaved)], dim=-1)

    def forward(
        self, x, cos, sin, mask, kv_cache=None, position_ids=None, ops: Ops = PLAIN, keep: Optional[Keep] = None
    ):
        """Attention of `x` (the layer's normalised input) over the latent cache; `keep` as the decoder's
        attention takes it (the output at the kept positions, the cache written at every position)."""
        k, v = self.keys_values(x, cos, sin, ops)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v, position_ids)
        if keep is not None:
            x, cos, sin, mask = (
                take(x, keep),
                take(cos, keep),
                take(sin, keep),
                kept_rows(mask, keep, k.shape[2], k.device),
            )
        q = self.queries(x, cos, sin, ops)
        b, heads, s, _ = q.shape
        w = dense_weight(self.kv_b_proj).view(heads, self.nope + self.v_dim, self.rank).to(q.dtype)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_latent = torch.matmul(q[..., : self.nope], w_uk)  # [b, heads, s, rank]
        out = ops.attention(torch.cat([q_latent, q[..., self.nope :]], dim=-1), k, v, mask, self.scale)
        out = torch.matmul(out, w_uv.transpose(1, 2))  # [b, heads, s, v_head_dim]
        return ops.linear(self.o_proj, out.transpose(1, 2).reshape(b, s, heads * self.v_dim))


__all__ = ["LatentAttention", "latent_scale", "dense_weight", "INNER_NORM_EPS"]
