"""Which pool blocks each request holds: the host side of the block KV cache (`models/block_kv_cache.py`).

Why this exists: with a block cache a request holds only the blocks its tokens fill, so blocks are handed out
as a row writes positions and come back when it ends or is preempted. This file keeps that account, apart
from the device pool, so that the loop (`loop.py`) asks one question before each step ("can every row of this
step have blocks for the positions it will write and read?") and a test can check that no block ever leaks.

- `BlockAllocator(blocks)`: blocks `1..blocks` (block 0 is the pool's null block), each held by a number of
  rows (its reference count): handed out lowest first, taken back in any order.
- **Prefix caching by sharing.** A full block of a prompt can be *registered* under its chained key
  (`prefix_cache.block_keys`: the adapter and its load, and every token before it, are in the key). A joining
  prompt whose first blocks' keys are registered holds those very blocks (`peek` finds them, `hold` counts it): no
  copy, no graph. A registered block nobody holds stays cached, in least-recently-used order, and is handed
  out again (its key dropped) only when no never-used block is left. A row gives its blocks back tail first, so
  a chain's last blocks are evicted before its first. `retire` drops the keys of adapter loads the bank no
  longer holds, `forget` every key (new weights).
- `blocks_for(positions, block_size)`: how many blocks hold `positions` positions.
- **Sliding windows.** On a model whose every layer attends a sliding window (`sliding_window(config)`), a query at
  position p reads no position before `p - window + 1`, so the blocks wholly before a row's next query are given
  back as it moves on (`blocks_behind`), their table entries the null block (`NULL_BLOCK`). A row then holds at
  most `window_blocks` blocks however long it runs, which is what admission checks (`Scheduler.peak_blocks`).
- **Two groups.** A model that mixes window and full-attention layers (Gemma 2 and 3, gpt-oss, Qwen2's
  `max_window_layers`; `window_group(config)`) keeps its full layers' blocks as above and its window layers' in a
  pool and an account of their own, of `window_pool_blocks` blocks: a row holds both, the same logical blocks, and
  gives back the window layers' behind the window while its full layers keep theirs. Prefix caching registers both;
  a hit needs the full layers' blocks of the whole prefix and the window layers' of its last window only.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

from ..models.block_kv_cache import NULL_BLOCK  # a row's entry for a block it gave back


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold positions `0..positions-1`."""
    return -(-int(positions) // int(block_size))


def sliding_window(config) -> Optional[int]:
    """The window beyond which no layer of the model reads (the largest of its layers' windows), or None when a
    layer attends to every position (or there are no layers)."""
    windows = {config.layer_window(i) for i in range(config.num_hidden_layers)}
    return None if not windows or None in windows else max(windows)


def window_group(config) -> Optional[tuple[tuple[int, ...], int]]:
    """(the layers that attend a window, the largest of their windows) on a model that mixes them with
    full-attention layers, None on one whose layers all attend fully or all slide (`sliding_window`)."""
    windows = {i: config.layer_window(i) for i in range(config.num_hidden_layers)}
    sliding = tuple(i for i, w in windows.items() if w is not None)
    if not sliding or len(sliding) == len(windows):
        return None
    return sliding, max(windows[i] for i in sliding)


def window_pool_blocks(
    blocks: int, window: int, slots: int, width, prompt: int, block_size: int, ahead: int = 1
) -> int:
    """The window layers' pool beside a full layers' pool of `blocks`: enough for `slots` rows each at its widest
    step's window (`width` tokens: a chunk, a verify step's, or one decoded; or `(rows, tokens)` pairs, each a step in
    which that many rows take that many tokens and the others `ahead`: a chunk budget's steps, whose fewer rows chunk
    wider), and for one prompt of `prompt` tokens run whole (a prefill, a scored prompt, a resumed row's), never more
    than `blocks`."""
    steps = ((slots, width),) if isinstance(width, int) else tuple(width)
    held = max(
        min(r, slots) * window_blocks(window, max(w, ahead), block_size)
        + (slots - min(r, slots)) * window_blocks(window, ahead, block_size)
        for r, w in steps
    )
    return min(int(blocks), max(held, blocks_for(prompt, block_size)))


def window_spec(
    config, blocks: int, slots: int, width, max_model_len: int, block_size: int, ahead: int = 1
) -> Optional[tuple[tuple[int, ...], int]]:
    """(the window layers, their pool's blocks: `window_pool_blocks`) beside a pool of `blocks`, on a model whose
    window layers are a group of their own (`window_group`); None on another."""
    group = window_group(config)
    if group is None:
        return None
    return group[0], window_pool_blocks(blocks, group[1], slots, width, max_model_len, block_size, ahead)


def blocks_behind(length: int, window: int, block_size: int) -> int:
    """How many of a row's first blocks no query at position `length` or later reads through a window of `window`
    positions: those wholly before `length - window + 1`."""
    return max(int(length) - int(window) + 1, 0) // int(block_size)


def window_blocks(window: int, width: int, block_size: int) -> int:
    """The most blocks a row holds in a step of `width` tokens (from position p) once the blocks behind it are given
    back: positions `p - window + 1` to `p + width - 1`, which may start and end inside a block."""
    return blocks_for(int(window) + int(width) - 1, block_size) + 1


class BlockAllocator:
    """The blocks of a pool of `blocks` usable blocks (numbered from 1): who holds them, and which are cached."""

    def __init__(self, blocks: int):
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise ValueError(f"kv_blocks={blocks!r} must be a positive number of blocks.")
        self.blocks = blocks
        self._fresh = list(range(1, blocks + 1))  # a heap: never used, or used and not cached
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # cached, held by no row: least recent first
        self._refs: dict[int, int] = {}  # held block -> rows holding it
        self._index: dict[bytes, int] = {}  # key -> the cached block
        self._keys: dict[int, tuple] = {}  # cached block -> (key, tag)
        self.queries = self.hits = 0  # prompt tokens looked up, and found cached (as vLLM counts them)
        self.evictions = 0

    @property
    def free(self) -> int:
        """Blocks a `take` may hand out: never used, or cached and held by no row."""
        return len(self._fresh) + len(self._cached_free)

    @property
    def used(self) -> int:
        """Blocks some row holds."""
        return len(self._refs)

    @property
    def references(self) -> int:
        """Rows holding blocks, counted per block (a block two rows share counts twice)."""
        return sum(self._refs.values())

    @property
    def cached(self) -> int:
        """Blocks registered under a key (held or not)."""
        return len(self._index)

    def take(self, n: int) -> list[int]:
        """`n` blocks, now held once each: never-used ones first, then the least recently used cached ones (their
        keys dropped). Refuses (ValueError) when fewer are free: ask `free` first."""
        if n > self.free:
            raise ValueError(f"{n} blocks asked, {self.free} free.")
        out = []
        for _ in range(n):
            if self._fresh:
                block = heapq.heappop(self._fresh)
            else:
                block, _ = self._cached_free.popitem(last=False)
                self._unregister(block)
                self.evictions += 1
            self._refs[block] = 1
            out.append(block)
        return out

    def give_back(self, blocks: Sequence[int]) -> None:
        """One row's hold on each of `blocks` ends, the last block first; a block held by no row is refused. A
        block nobody holds any more stays cached if it is registered, else it is free again."""
        for b in reversed(list(blocks)):
            if b not in self._refs:
                raise ValueError(f"Block {b} was given back but is not held.")
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            del self._refs[b]
            if b in self._keys:
                self._cached_free[b] = None
            else:
                heapq.heappush(self._fresh, b)

    # ---- sharing ---------------------------------------------------------------------------------------
    def peek(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys`, not held."""
        found = []
        for key in keys:
            block = self._index.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def hold(self, blocks: Sequence[int]) -> None:
        """Hold each of `blocks` (cached ones, `peek`'s) once more."""
        for b in blocks:
            if b in self._cached_free:
                del self._cached_free[b]
                self._refs[b] = 1
            else:
                self._refs[b] += 1

    def count_query(self, tokens: int, hit: int) -> None:
        """Count a prompt of `tokens` tokens looked up, `hit` of them found (once it is admitted)."""
        self.queries += tokens
        self.hits += hit

    def register(self, blocks: Sequence[int], keys: Sequence[bytes], tag: Any = None) -> int:
        """Cache held blocks under the keys of the full blocks they hold (`blocks[j]` under `keys[j]`); a key
        another block is cached under already keeps that one, and a `NULL_BLOCK` entry (given back behind a sliding
        window, registered before) is skipped. `tag`: what `retire` asks about (the adapter load). Returns how many
        were registered."""
        added = 0
        for block, key in zip(blocks, keys):
            if block == NULL_BLOCK or key in self._index or block in self._keys:  # given back, or cached already
                continue
            if block not in self._refs:
                raise ValueError(f"Block {block} is registered but not held.")
            self._index[key] = block
            self._keys[block] = (key, tag)
            added += 1
        return added

    def retire(self, live: Callable[[Any], bool]) -> int:
        """Drop the keys of blocks whose tag `live` says is gone (an adapter load the bank no longer holds): they
        can never match again. Returns how many."""
        dead = [b for b, (_, tag) in self._keys.items() if not live(tag)]
        for b in dead:
            self._uncache(b)
        return len(dead)

    def forget(self) -> None:
        """Drop every key (the weights they were computed with changed)."""
        for b in list(self._keys):
            self._uncache(b)

    def _uncache(self, block: int) -> None:
        self._unregister(block)
        if block in self._cached_free:
            del self._cached_free[block]
            heapq.heappush(self._fresh, block)

    def _unregister(self, block: int) -> None:
        key, _ = self._keys.pop(block)
        del self._index[key]


__all__ = [
    "NULL_BLOCK",
    "BlockAllocator",
    "blocks_behind",
    "blocks_for",
    "sliding_window",
    "window_blocks",
    "window_group",
    "window_pool_blocks",
    "window_spec",
]
