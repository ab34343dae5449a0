"""Which pool blocks each request holds: the host side of the block KV cache (`models/block_kv_cache.py`).

Why this exists: with a block cache a request holds only the blocks its tokens fill, so blocks are handed out
as a row writes positions and come back when it ends or is preempted. This file keeps that account, apart
from the device pool, so that the loop (`loop.py`) asks one question before each step ("can every row of this
step have blocks for the positions it will write and read?") and a test can check that no block ever leaks.

- `BlockAllocator(blocks)`: blocks `1..blocks` (block 0 is the pool's null block), handed out lowest first
  and taken back in any order.
- `blocks_for(positions, block_size)`: how many blocks hold `positions` positions.
"""

from __future__ import annotations

import heapq


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold positions `0..positions-1`."""
    return -(-int(positions) // int(block_size))


class BlockAllocator:
    """The free blocks of a pool of `blocks` usable blocks (numbered from 1) and how many are held."""

    def __init__(self, blocks: int):
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise ValueError(f"kv_blocks={blocks!r} must be a positive number of blocks.")
        self.blocks = blocks
        self._free = list(range(1, blocks + 1))  # a heap: the lowest free block first
        self._held: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._held)

    def take(self, n: int) -> list[int]:
        """`n` free blocks, now held; refuses (ValueError) when fewer are free: ask `free` first."""
        if n > len(self._free):
            raise ValueError(f"{n} blocks asked, {len(self._free)} free.")
        out = [heapq.heappop(self._free) for _ in range(n)]
        self._held.update(out)
        return out

    def give_back(self, blocks: list[int]) -> None:
        """Blocks no longer held; a block given back twice, or never taken, is refused."""
        for b in blocks:
            if b not in self._held:
                raise ValueError(f"Block {b} was given back but is not held.")
            self._held.discard(b)
            heapq.heappush(self._free, b)


__all__ = ["BlockAllocator", "blocks_for"]
