"""The activations an expert applies between its gate/up and down projections (`moe.py`).

An expert's `gate_up_proj` yields `2I` values per row; families differ in how gate and up are laid out in
them and what joins them:

- `swiglu` (Qwen3-MoE, Mixtral): the gate's `I` values, then the up's; `silu(gate) * up`.
- `clamped_swiglu` (gpt-oss): gate and up interleaved (`[g0, u0, g1, u1, ...]`, as gpt-oss stores them);
  the gate clamped above at `limit`, the up to `[-limit, limit]`, then `(up + 1) * gate * sigmoid(alpha * gate)`,
  as transformers' `GptOssExperts._apply_gate` computes it.

`activation_for(config)` gives the function of a config's family (one argument, the `[..., 2I]` tensor).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def activation_for(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """The expert activation of `config`'s family (a `model_config.ModelConfig`)."""
    kind = config.family.expert_activation
    if kind == "clamped_swiglu":
        return partial(clamped_swiglu, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
    return swiglu


__all__ = ["swiglu", "clamped_swiglu", "activation_for"]
