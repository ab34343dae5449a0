"""Prefix caching on fixed slots: the keys and values of prompt prefixes kept in a bounded device pool, so a
prompt that starts like an earlier one prefills only what is new.

Why this exists: chat and agent traffic repeats itself (a system prompt, a tool list, the conversation so
far), and every request used to prefill its whole prompt. The loop's cache is `[B, K]` slots (no pages), so
the cached keys and values are *copied* into a joining row's slot, then the rest of its prompt runs as
chunks (`chunking.py`, the engine's extend step), starting at the first position not copied.

Design choices:

- **Blocks of `block_size` tokens, hashed in a chain.** Block j's key is a SHA-256 over block j-1's key,
  the adapter's key and block j's tokens, so a block matches only when everything before it matches too,
  and a prefix computed under one adapter never serves another adapter or the base model. Only full blocks
  are kept and matched, and a match leaves at least one prompt token to compute (its logits choose the
  first new token).
- **A bounded pool on the device**, `blocks` rows of `[kv_heads, block_size, head_dim]` per layer, with LRU
  eviction. A match touches its blocks deepest first, so a chain's first blocks are the last evicted
  (a block is useless once its parent is gone).
- **Fixed-shape copies.** Loading is one gather of a whole row's worth of blocks (`K / block_size` pool
  rows, those past the hit taken from a scratch row: what lands after the hit is written by the row
  before it is read), storing one scatter of the row's blocks (those not stored sent to the scratch row),
  with host-made tensor indices: one copy shape per cache shape, whatever the hit's length, so no hit
  creates a graph (on a lazily traced device too).
- **Counted as vLLM counts.** `queries`: prompt tokens looked up; `hits`: prompt tokens served from the pool
  (`prefix_cache_queries`, `prefix_cache_hits` on `/metrics`).
- **Keys and values depend on the prefix alone.** Attention is causal, a mixture of experts routes each
  token on its own (no token is dropped), and a sliding-window layer's cache here keeps every position
  (it is not a ring buffer; the window is a mask over absolute positions): a block computed for one prompt
  is exactly the block any prompt with the same prefix would compute, whatever the window. A cache that
  kept only the last `window` positions would make a block older than the window unusable; this cache
  never drops one, so no block is refused for a window.
- **Weights change, pool empties.** The pool remembers the engine's weights fingerprint it was filled
  under (`owner`); new weights, an adapter swapped or trained in place drop every block.
- **An adapter reloaded is another adapter.** The adapter bank rewrites a slot in place, which changes no
  parameter, so the fingerprint cannot see it: each write of a slot gets a new load number
  (`AdapterBank.load_of`), which the adapter's key includes, and `retire` frees the blocks of loads the
  bank no longer holds (an adapter unloaded, or loaded again under its name from other files).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch

from ..backends.memory_check import check_fits
from ..models.kv_cache import KVCache, layout


class PrefixCache:
    """The pool and its index (see the module docstring)."""

    def __init__(self, model, blocks: int, block_size: int = 32, tp: int = 1):
        if int(blocks) < 1:
            raise ValueError(f"prefix cache blocks={blocks} must be at least 1 (or turn prefix caching off).")
        if int(block_size) < 1:
            raise ValueError(f"prefix cache block_size={block_size} must be a positive number of tokens.")
        c = model.config
        self.blocks, self.block_size = int(blocks), int(block_size)
        check_fits(
            self.bytes_for(model, self.blocks, self.block_size, tp),
            model.device,
            f"The prefix cache ({self.blocks} blocks of {self.block_size} tokens)",
            "give it fewer blocks",
        )
        # one row more than `blocks`: the scratch row, where the fixed-size copies send the blocks they skip
        heads, dim, latent = layout(c, tp)  # a latent cache's pool holds its keys alone, as the cache does
        shape = (self.blocks + 1, heads, self.block_size, dim)
        self.keys = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_hidden_layers)]
        self.values = (
            []
            if latent
            else [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_hidden_layers)]
        )
        self.device = model.device
        self.index: OrderedDict[bytes, int] = OrderedDict()  # block key -> pool row, least recently used first
        self.free = list(range(self.blocks))
        self.queries = self.hits = 0  # prompt tokens looked up, and served from the pool
        self.evictions = 0
        self.owner: Any = None
        self.tags: dict[bytes, Any] = {}  # block key -> the adapter load it was computed under (`retire`)

    @staticmethod
    def bytes_for(model, blocks: int, block_size: int, tp: int = 1) -> int:
        """What the pool allocates, in bytes."""
        return KVCache.bytes_for(model, blocks + 1, block_size, tp)

    # ---- the index ---------------------------------------------------------------------------------
    def block_keys(self, prompt: Sequence[int], adapter: str) -> list[bytes]:
        """The chained key of each full block of `prompt` under adapter key `adapter` (`block_keys`)."""
        return block_keys(prompt, adapter, self.block_size)

    def owned_by(self, owner: Any) -> None:
        """Drop every block when the weights it was computed with changed (`owner`: their fingerprint)."""
        if owner != self.owner:
            self.clear()
            self.owner = owner

    def clear(self) -> None:
        self.index.clear()
        self.tags.clear()
        self.free = list(range(self.blocks))

    def retire(self, live: Callable[[Any], bool]) -> int:
        """Free the blocks whose tag (the adapter load given to `store`) `live` says is gone; returns how many.
        Their keys can never match again (the key holds the load), so this only gives their rows back."""
        dead = [key for key, tag in self.tags.items() if not live(tag)]
        for key in dead:
            self.tags.pop(key)
            row = self.index.pop(key, None)
            if row is not None:
                self.free.append(row)
        return len(dead)

    def match(self, prompt: Sequence[int], adapter: str) -> list[int]:
        """The pool rows of the longest cached prefix of `prompt` (whole blocks, leaving at least its last
        token to compute), counted in `queries` and `hits`."""
        usable = (len(prompt) - 1) // self.block_size
        rows = []
        for key in self.block_keys(prompt[: usable * self.block_size], adapter):
            row = self.index.get(key)
            if row is None:
                break
            rows.append((key, row))
        for key, _ in reversed(rows):  # deepest first: the chain's first blocks end up most recently used
            self.index.move_to_end(key)
        self.queries += len(prompt)
        self.hits += len(rows) * self.block_size
        return [row for _, row in rows]

    # ---- moving keys and values ----------------------------------------------------------------------
    def load(self, cache: KVCache, slot: int, rows: Sequence[int]) -> None:
        """Copy pool rows `rows` into positions `0..len(rows) * block_size - 1` of the cache row `slot`: one
        gather of every block position of the row (`cache.max_length // block_size` blocks), the blocks not
        hit taken from the pool's scratch row. What lands after the hit is never read: the row writes those
        positions (its chunks, its decode steps) before it attends to them."""
        index = torch.full((cache.max_length // self.block_size,), self.blocks, dtype=torch.long)
        index[: len(rows)] = torch.as_tensor(list(rows), dtype=torch.long)
        index, slot_index, positions = self._indices(index, slot)
        for dst, src in zip(cache.position_tensors, self.keys + self.values):
            b, h, bs, d = src[index].shape
            dst[slot_index, :, positions] = src[index].transpose(1, 2).reshape(1, b * bs, h, d)

    def store(self, cache: KVCache, slot: int, prompt: Sequence[int], adapter: str, tag: Any = None) -> int:
        """Keep every full block of `prompt` (whose keys and values are in positions `0..len - 1` of the cache
        row `slot`) that the pool does not hold, evicting the least recently used; returns how many were
        stored. One scatter of every block position of the row, the blocks not stored sent to the scratch
        row. `tag` (the adapter load) is what `retire` asks about."""
        keys = self.block_keys(prompt, adapter)
        index = torch.full((cache.max_length // self.block_size,), self.blocks, dtype=torch.long)
        stored = []
        for j, key in enumerate(keys):
            if key in self.index:
                continue
            row = self._take(set(keys[:j]))
            if row is None:  # every row holds this prompt's own earlier blocks
                break
            index[j] = row
            stored.append((key, row))
        if stored:
            index, slot_index, positions = self._indices(index, slot)
            for dst, src in zip(self.keys + self.values, cache.position_tensors):
                _, h, bs, d = dst.shape
                dst[index] = src[slot_index, :, positions].reshape(-1, bs, h, d).transpose(1, 2)
            self.index.update(stored)
            self.tags.update((key, tag) for key, _ in stored)
        for key in reversed(keys):  # the chain's first blocks most recently used, as `match` leaves them
            if key in self.index:
                self.index.move_to_end(key)
        return len(stored)

    def _take(self, keep: set) -> Optional[int]:
        """A free pool row, or the least recently used block's (not one of `keep`)."""
        if self.free:
            return self.free.pop()
        for key in self.index:
            if key not in keep:
                self.evictions += 1
                self.tags.pop(key, None)
                return self.index.pop(key)
        return None

    def _indices(self, index: torch.Tensor, slot: int) -> tuple:
        """The pool rows `index`, the slot `[1, 1]` and the row's block positions `[1, blocks * block_size]`,
        made on the host and sent together (fixed shapes for a cache shape: no hit length makes a graph)."""
        positions = torch.arange(index.shape[0] * self.block_size)
        packed = torch.cat([index, torch.tensor([slot]), positions]).to(self.device)
        n = index.shape[0]
        return packed[:n], packed[n : n + 1].view(1, 1), packed[n + 1 :].view(1, -1)

    @property
    def used(self) -> int:
        return len(self.index)


def block_keys(prompt: Sequence[int], adapter: str, block_size: int) -> list[bytes]:
    """The chained key of each full block of `prompt` under adapter key `adapter`: block j's is a SHA-256 over
    block j-1's, the adapter's key and block j's tokens (a cryptographic hash: a crafted prompt cannot collide
    with another user's prefix)."""
    keys, parent = [], hashlib.sha256(("adapter:" + adapter).encode()).digest()
    for j in range(len(prompt) // block_size):
        h = hashlib.sha256(parent)
        h.update(torch.tensor(prompt[j * block_size : (j + 1) * block_size], dtype=torch.int64).numpy().tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


def adapter_key(request_adapter: Optional[str], slot: int, load: int = 0) -> str:
    """What separates one adapter's prefixes from another's: the name the request gave, its bank slot and
    the load that slot holds (`AdapterBank.load_of`: a new number each time the slot is written)."""
    return repr((request_adapter, int(slot), int(load)))


__all__ = ["PrefixCache", "adapter_key", "block_keys"]
