"""Keep freed host memory in the process while training on a CPU, so steps stop page-faulting.

Why: glibc's malloc serves every block above its mmap threshold (128 KiB, adapting up to 32 MiB)
with a fresh `mmap` and gives it back to the kernel on `free`. A training step allocates and frees
the same hundreds of megabytes each time (activations, the `[batch, seq, vocab]` logits and their
gradient, the gradients), so every step pays a page fault for each 4 KiB page of them again, a
measurable share of a step (`BENCHMARKS.md`). With the thresholds raised, freed blocks stay in the heap and the next step
reuses them already mapped. The cost is that the process keeps its peak footprint until it exits,
which is what a training process reaches every step anyway.

This changes malloc for the whole process, so it happens only when a Trainer trains on the CPU,
once, logged; `STATICFORMERS_KEEP_HOST_MEMORY=0` turns it off. Only glibc has `mallopt`: elsewhere
nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Optional

logger = logging.getLogger("staticformers")

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_LARGEST = 2**31 - 1  # mallopt takes an int
_TOP_PAD = 256 * 2**20

_done = False


@functools.cache
def libc() -> Optional[ctypes.CDLL]:
    """The C library (loaded once), or None where it cannot be loaded; glibc-only calls are looked up on it."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover - every Linux has a libc
        return None


def keep_freed_host_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process). True if they are now raised."""
    global _done
    if _done:
        return True
    if os.environ.get("STATICFORMERS_KEEP_HOST_MEMORY", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:  # not glibc (macOS, musl): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(
        mallopt(option, value) == 1
        for option, value in ((_M_MMAP_THRESHOLD, _LARGEST), (_M_TRIM_THRESHOLD, _LARGEST), (_M_TOP_PAD, _TOP_PAD))
    )
    if ok:
        _done = True
        logger.info(
            "Training on the CPU: freed host memory stays in the process between steps (no page faults "
            "per step); STATICFORMERS_KEEP_HOST_MEMORY=0 turns this off."
        )
    return ok


__all__ = ["keep_freed_host_memory", "libc"]
