"""Prompt lookup: propose the tokens that followed the last occurrence of the row's latest n-gram.

Why on the host: the loop already holds every row's tokens on the host (it reads each step's ids back),
and the search is a vectorised comparison over one row's prompt and output, O(length x n) machine
integers, far below a device step even for prompts of thousands of tokens (`bench/speculative.py`
reports it). On the device it would need the history as a fixed-shape tensor per row and one more graph
per batch bucket and KV length, for no fewer host reads: the proposals feed the verify step's inputs,
which are made on the host anyway.

The match follows transformers' `prompt_lookup_num_tokens` and vLLM's `ngram` method: try the longest
n-gram first (`max_ngram` down to `min_ngram`); the proposal is the k tokens after its latest earlier
occurrence that k tokens follow, else the tokens after its first occurrence (inside a run of one
repeated token, the latest occurrence is the suffix's neighbour, followed by one token only).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def lookup(history: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of `history`'s last n tokens (the longest n in
    `max_ngram..min_ngram` that occurs; the module docstring says which occurrence); [] when none does."""
    if k < 1:
        return []
    seq = np.asarray(history, dtype=np.int64)
    size = len(seq)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = seq[size - n :]
        # windows starting at 0..size-n-1: each earlier n-gram, the suffix itself excluded
        windows = np.lib.stride_tricks.sliding_window_view(seq[: size - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= size]  # occurrences followed by k tokens
            start = int(full[-1] if full.size else hits[0]) + n
            return seq[start : start + k].tolist()
    return []


class PromptLookup:
    """The prompt-lookup proposer: a deterministic proposal (q is one-hot at each proposed token)."""

    deterministic = True

    def __init__(self, k: int, max_ngram: int = 3, min_ngram: int = 1):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"prompt_lookup_num_tokens={k!r} must be a positive integer.")
        for name, v in (("prompt_lookup_max", max_ngram), ("prompt_lookup_min", min_ngram)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer.")
        if min_ngram > max_ngram:
            raise ValueError(
                f"prompt_lookup_min={min_ngram} is more than prompt_lookup_max={max_ngram}: "
                f"lower the minimum or raise the maximum."
            )
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram

    def propose(self, histories: list, limits: list, **_) -> tuple[list[list[int]], None]:
        """For each row, up to `limits[i]` tokens; no draft distribution (q one-hot)."""
        return [lookup(h, min(self.k, m), self.max_ngram, self.min_ngram) for h, m in zip(histories, limits)], None

    def warm(self, batch: int, kv: int) -> bool:
        return True
