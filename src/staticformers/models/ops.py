"""The decoder's one seam: how its projections and its attention are computed.

The model (`decoder.py`) describes the architecture and nothing else. Where a device or a compiled
shape is faster with another formulation of the same math (a weight-streaming reduction for one
decode row on a CPU, an operator the compiler cannot reach, attention in query blocks), the caller
passes an `Ops` object to `model(..., ops=...)`; the model calls

- `ops.linear(layer, x)` for every projection inside a decoder layer, and `ops.linear_group(layers, x)` for
  projections of one input (q, k and v; gate and up), which a backend may compute in one call,
- `ops.head(layer, x)` for the `lm_head`,
- `ops.attention(q, k, v, mask, scale, softcap=None, sinks=None)` for scaled dot-product attention with grouped
  KV heads (`softcap`: Gemma 2's `tanh(s / c) * c` on the scores, which SDPA cannot apply: `capped_attention`;
  `sinks` `[heads]`: gpt-oss's per-head sink logits, `attention_sinks.py`; each given only by a family that has it),
- `ops.expert_matmul(x, weight, scale, index)` for the products of stacked experts (`moe.py`),
- `ops.mlp_block(norm, mlp, x, attn)`, which a backend may answer with one call for a pre-norm layer's MLP half (the
  plain path answers None, and the model computes it op by op),

and never asks which device it runs on. A quantized projection (`quantization.QuantLinear`: int8 or fp8
weights, one scale per output channel) comes through `linear`/`head` like any other: the plain path runs
its own forward (the weight widened in the graph, the product, the scale), and a backend that computes
an int8 product its own way checks for it there; quantized experts pass their `scale` `[E, out, 1]`. `Ops()` is the plain path: the module itself (so hooks and
wrappers such as LoRA layers run) and PyTorch's SDPA. Backends (`staticformers.backends`) subclass it.
An `Ops` is compared and hashed by its `key`, so compiled graphs can be keyed on the formulation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .attention_sinks import attention_with_sinks
from .norm_variants import softcap as cap_scores
from .quantized_values import widen


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Scaled dot-product attention; `mask` is boolean `[b, 1, q, kv]` (True = may attend) or None for plain
    causal self-attention. q `[b, heads, q, d]`, k/v `[b, kv_heads, kv, d]`."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float, softcap: float
) -> torch.Tensor:
    """Attention with soft-capped scores, as transformers' eager attention computes it (SDPA has no cap): the
    scores in q's dtype, `tanh(s / softcap) * softcap`, the mask, softmax in float32 cast back to q's dtype,
    then the values. `mask` as `sdpa`'s (None: causal self-attention)."""
    b, h, s, d = q.shape
    kvh, kv_len = k.shape[1], k.shape[2]
    qg = q.reshape(b, kvh, (h // kvh) * s, d)  # the query heads grouped per KV head
    scores = cap_scores(torch.matmul(qg, k.transpose(-1, -2)) * scale, softcap).view(b, kvh, h // kvh, s, kv_len)
    if mask is None:
        mask = torch.ones(s, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - s)[None, None]
    scores = scores.masked_fill(~mask.unsqueeze(2), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.view(b, kvh, -1, kv_len), v).view(b, h, s, v.shape[-1])


def expert_product(
    x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None, index: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """`Ops.expert_matmul`'s plain form: the gathered matrices (if `index`), then one batched matmul; a
    quantized stack's values widened to `x`'s dtype, and its per-row `scale` applied to the product."""
    w = weight if index is None else weight.index_select(0, index)
    if scale is None:
        return torch.matmul(x, w.transpose(-1, -2))
    s = scale if index is None else scale.index_select(0, index)
    return torch.matmul(x, widen(w, x.dtype).transpose(-1, -2)) * s.transpose(-1, -2).to(x.dtype)


class Ops:
    """The plain formulation (see the module docstring); subclasses override what they change."""

    name = "plain"

    @property
    def key(self) -> tuple:
        """What distinguishes this formulation from another (part of every compiled graph's key)."""
        return (type(self).__qualname__,)

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    def linear_group(self, layers: tuple, x: torch.Tensor) -> tuple:
        """`tuple(self.linear(layer, x) for layer in layers)`: projections of one input."""
        return tuple(self.linear(layer, x) for layer in layers)

    def head(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Optional[torch.Tensor],
        scale: float,
        softcap: Optional[float] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """SDPA; with `softcap`, the manual `capped_attention`; with `sinks`, `attention_with_sinks` (no family
        has both)."""
        if sinks is not None:  # SDPA has no sink column
            return attention_with_sinks(q, k, v, mask, scale, sinks)
        if softcap is not None:
            return capped_attention(q, k, v, mask, scale, softcap)
        return sdpa(q, k, v, mask, scale)

    def expert_matmul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scale: Optional[torch.Tensor] = None,
        index: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """`x` `[G, R, in]` (or `[1, R, in]`, shared by every group) times the transposed stacked weights
        `weight` `[E, out, in]`, one matrix per group: `weight[index]` (`index` `[G]`), or all E in order;
        `scale` `[E, out, 1]` for a quantized stack (None otherwise)."""
        return expert_product(x, weight, scale, index)

    def mlp_block(self, norm: nn.Module, mlp: nn.Module, x: torch.Tensor, attn: torch.Tensor) -> Optional[torch.Tensor]:
        """A pre-norm decoder layer's MLP half as one call, where the formulation has one for these modules and
        this input: `r + mlp(norm(r))` with `r = x + attn` (the attention's residual). None: the layer computes it
        op by op (what the plain formulation always does)."""
        return None

    def __eq__(self, other) -> bool:
        return isinstance(other, Ops) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.key[1:] if len(self.key) > 1 else ''}"


PLAIN = Ops()
