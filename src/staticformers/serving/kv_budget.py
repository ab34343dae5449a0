"""How many KV blocks the server's pool gets: vLLM's flags, and a byte budget for the CPU.

Why this exists: with block caches (`models/block_kv_cache.py`) the pool's size is a memory budget, not batch x
length, and users already size it with vLLM's names. One of three, the first given wins:

- `--num-gpu-blocks-override N`: N blocks, whatever the memory;
- `--kv-cache-memory-bytes SIZE`: the blocks that SIZE bytes hold ("512MiB", "2GB", or a number of bytes), the
  way to size it on the CPU, whose memory the host shares;
- `--gpu-memory-utilization F`: F of the memory the device has available once the weights are loaded (what
  the device's backend reports; a device that reports none needs one of the others).

None of them: static caches, each request holding its whole need from its prefill.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """A size as bytes: an integer, or a number with a unit (KB, MB, GB, KiB, MiB, GiB; any case)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise ValueError(f"{text!r} is not a size: write a number of bytes or a number with a unit (512MiB, 2GB).")
    value = int(float(match.group(1)) * UNITS[unit])
    if value < 1:
        raise ValueError(f"{text!r} is not a positive size.")
    return value


def kv_blocks(
    model,
    blocks: Optional[int],
    memory_bytes: Optional[int],
    utilization: Optional[float],
    block_size: int,
    tp: int = 1,
    window: Optional[Callable[[int], Optional[tuple]]] = None,
) -> Optional[int]:
    """The pool's blocks from the three flags (see the module docstring), or None for static caches. A budget
    that holds no block is refused in one sentence. `window(n)`: a mixed model's window layers' group beside a pool
    of n blocks (`generation/kv_blocks.py`'s `window_spec`), whose smaller pools leave a budget more blocks."""
    from ..backends.memory_check import available_bytes
    from ..models.block_kv_cache import KVBlocks

    if blocks is not None:
        return int(blocks)
    if memory_bytes is None and utilization is None:
        return None
    if memory_bytes is None:
        if not 0 < utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization {utilization} must be a fraction in (0, 1].")
        free = available_bytes(model.device)
        if free is None:
            raise ValueError(
                f"{model.device} does not report its available memory, so --gpu-memory-utilization "
                f"cannot size the KV pool: pass --kv-cache-memory-bytes or --num-gpu-blocks-override."
            )
        memory_bytes = int(free * utilization)
    count = KVBlocks.blocks_in(model, memory_bytes, block_size, tp, window)
    if count < 1:
        raise ValueError(
            f"A KV budget of {memory_bytes} bytes holds no block of {block_size} positions (plus the "
            f"pool's null block): give it more memory or a smaller --block-size."
        )
    return count


__all__ = ["kv_blocks", "parse_bytes"]
