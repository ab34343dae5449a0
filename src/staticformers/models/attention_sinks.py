"""Attention with sinks (gpt-oss): a learned logit per query head that joins each row's softmax.

gpt-oss gives every attention head a parameter `sinks` `[heads]`. For each query row its value is
appended to the row's scaled, masked scores as one more column; the softmax runs over the row plus
that column, and the column is dropped before the values are weighed. So the weights of a row sum to
less than one, and a row may attend to "nothing". transformers computes it in its eager attention
(its gpt-oss eager attention, the max subtracted first); SDPA has no such
column, so the ops seam (`ops.py`) takes this path only when sinks are given.

- `softmax_with_sinks(scores, sinks)`: the softmax of scores `[..., kv]` with each row's sink logit
  (`sinks` broadcastable to `[..., 1]`), the sink's column dropped.
- `attention_with_sinks(q, k, v, mask, scale, sinks)`: matmul, mask, that softmax, matmul, in the inputs'
  dtype as transformers computes it, query heads repeated per KV head.
- `local_sinks(sinks)`: the sinks of this process's query heads. Tensor parallel shards the parameter over
  the heads as it shards q_proj's rows (a DTensor); attention reads its local part, whose gradient flows
  back to the shard.
"""

from __future__ import annotations

from typing import Optional

import torch


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax([scores, sink]) without the sink's column, in `scores`' dtype (max subtracted first)."""
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]


def local_sinks(sinks: torch.Tensor) -> torch.Tensor:
    """`sinks`, or its local part when a parallel layout made it a sharded DTensor."""
    to_local = getattr(sinks, "to_local", None)
    return to_local() if to_local is not None else sinks


def attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """q `[b, heads, s, d]`, k/v `[b, kv_heads, L, d]`, mask boolean `[b, 1, s, L]` (None: causal over the last
    `s` of the `L` keys), sinks `[heads]` -> `[b, heads, s, d]`."""
    b, h, s, _ = q.shape
    kv_len = k.shape[2]
    groups = h // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if mask is None:
        mask = torch.ones(s, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - s)[None, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = softmax_with_sinks(scores, sinks.view(1, h, 1, 1))
    return torch.matmul(probs.to(v.dtype), v)


__all__ = ["softmax_with_sinks", "attention_with_sinks", "local_sinks"]
