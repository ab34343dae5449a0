"""One rule for every seed argument (`TrainingArguments.seed`, `set_seed`, `generate(seed=)`,
`from_config(seed=)`): an integer from 0 to 2**64 - 1, the range torch's generators take; anything else
gets one sentence instead of torch's "Overflow when unpacking long"."""

from __future__ import annotations

from typing import Any

MAX_SEED = 2**64 - 1


def check_seed(seed: Any, name: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name}={seed!r} must be an integer from 0 to 2**64 - 1.")
    return seed


__all__ = ["check_seed", "MAX_SEED"]
