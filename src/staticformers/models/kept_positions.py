"""Keeping some positions only: a forward asked for its output at a few positions (a prompt's last token,
a verify step's kept tokens) computes attention and the MLP there alone.

`Keep` is the last n positions (an int) or per-row indices `[batch, n]`; `take` selects them from a
sequence or from a mask's queries, `kept_rows` builds the kept queries' rows of a causal mask, and
`causal_rows` is the causal mask of the last queries over every key. The decoder's attention
(`decoder.py`) and multi-head latent attention (`latent_attention.py`) use them, as do the compiled steps.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

Keep = Union[int, torch.Tensor]  # the last n positions, or per-row indices [batch, n]


def take(t: torch.Tensor, keep: Keep, dim: int = 1) -> torch.Tensor:
    """`t` at the kept positions along `dim`: the sequence of `[b, s, ...]` (dim 1) or a mask's queries
    `[b, 1, q, kv]` (dim 2)."""
    if isinstance(keep, int):
        return t.narrow(dim, t.shape[dim] - keep, keep)
    b, n = keep.shape
    shape = [b, *t.shape[1:]]
    shape[dim] = n
    index = keep.view(b, *([1] * (dim - 1)), n, *([1] * (t.dim() - dim - 1)))
    return t.expand(b, *t.shape[1:]).gather(dim, index.expand(shape))


def kept_rows(mask: Optional[torch.Tensor], keep: Keep, kv_len: int, device: torch.device) -> Optional[torch.Tensor]:
    """The rows of a self-attention mask `[b, 1, q, kv]` for the kept queries. None (plain causal
    attention) stays None for the last query alone, which sees every key; otherwise their causal rows
    are built (SDPA's `is_causal` aligns a shorter query block to the first keys, not the last)."""
    if mask is not None:
        return take(mask, keep, dim=2)
    if isinstance(keep, int):
        return None if keep == 1 else causal_rows(keep, kv_len, device)
    k_pos = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return k_pos <= keep.view(keep.shape[0], 1, keep.shape[1], 1)


def causal_rows(q_len: int, kv_len: int, device) -> torch.Tensor:
    """The causal mask `[1, 1, q_len, kv_len]` of the last `q_len` positions over all `kv_len` keys."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)[None, None]


__all__ = ["Keep", "take", "kept_rows", "causal_rows"]
