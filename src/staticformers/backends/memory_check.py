"""Refusing, in one sentence, an allocation that one argument made larger than the machine's memory.

`max_length=10**7` made the Trainer allocate its row table and then its activations until the kernel
killed the process; a batch bucket times a long `max_model_len` can ask the KV cache for more than the
device holds. Each of these sizes is known before anything is allocated, so the code that allocates
asks `check_fits(bytes, device, what, fix)` first: when the request is above the memory available
now (the device's backend answers: the host's available memory, CUDA's free device memory; other
devices: not checked) it
raises `InsufficientMemoryError` naming what needed how much, what there is, and what to lower.

The estimates given to it are lower bounds (what must be resident at once, not what a run peaks
at), so a refusal is certain to be right; a run that passes may still need more.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

GIB = 2**30


class InsufficientMemoryError(MemoryError):
    """A request that cannot fit in the memory the device has now (raised before allocating)."""


def available_bytes(device: Union[str, torch.device, None] = None) -> Optional[int]:
    """Memory that can be allocated on `device` now, or None when it cannot be known (the device's backend says)."""
    from . import device_kind, for_device
    from .base import host_available_memory

    device = torch.device(device if device is not None else "cpu")
    if device_kind(device) == "cpu":  # the host's memory: no need to load the CPU's compile tuning for it
        return host_available_memory()
    return for_device(device).available_memory(device)


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:,.1f} MiB"


def check_fits(nbytes: int, device: Union[str, torch.device, None], what: str, fix: str) -> None:
    """Raise `InsufficientMemoryError` when `nbytes` is above what `device` can allocate now."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise InsufficientMemoryError(
            f"{what} needs at least {_gib(nbytes)} but {torch.device(device or 'cpu')} has "
            f"{_gib(free)} available: {fix}."
        )


def training_step_bytes(config, batch: int, length: int, dtype: torch.dtype, gradient_checkpointing: bool) -> int:
    """A lower bound of what one training step keeps resident beyond the weights: the logits (in the
    compute dtype, and in float32 for the loss), each layer's saved input (and, without gradient
    checkpointing, its MLP activations), fp32 gradients and AdamW's two fp32 moments."""
    tokens = batch * length
    width = torch.empty((), dtype=dtype).element_size()
    logits = tokens * config.vocab_size * (width + 4)
    per_layer = config.hidden_size + (0 if gradient_checkpointing else 2 * config.intermediate_size)
    activations = config.num_hidden_layers * tokens * per_layer * width
    optimizer = config.num_parameters * (4 + 8)
    return logits + activations + optimizer


__all__ = ["check_fits", "available_bytes", "training_step_bytes", "InsufficientMemoryError"]
