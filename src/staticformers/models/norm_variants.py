"""The RMSNorm flavours of Gemma, OLMo 2 and gpt-oss, and the soft cap Gemma 2 puts on logits.

`RMSNorm` here is Llama's, the decoder's default: normalise in float32, cast back, then multiply
by the weight in the input's dtype. Two families round differently, and in bf16 the difference shows:

- Gemma (2 and 3) stores the weight as an offset from one (zeros at init) and multiplies by `1 + w`
  in float32 *before* casting back (`OffsetRMSNorm`);
- OLMo 2 and gpt-oss multiply by `w` in float32 before casting back (`FloatWeightRMSNorm`).

`make_norm(kind, dim, eps)` builds the one a family's `Family.norm` names. `softcap(x, cap)` is
`tanh(x / cap) * cap`, in `x`'s dtype, as transformers computes Gemma 2's attention scores and final logits.
"""

from __future__ import annotations

import struct
from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers does (bf16 parity): the weight applied
    after the cast (Llama's order; the other orders follow)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: `x / rms(x) * (1 + w)`, all in float32, then cast to the input's dtype."""

    init_value = 0.0

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class FloatWeightRMSNorm(nn.Module):
    """OLMo 2's RMSNorm: `x / rms(x) * w` in float32 (the weight promoted), then cast to the input's dtype."""

    init_value = 1.0

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


VARIANTS = {"offset": OffsetRMSNorm, "float_weight": FloatWeightRMSNorm}
NORM_CLASSES = tuple(VARIANTS.values())


def make_norm(kind: str, dim: int, eps: float, plain: type) -> nn.Module:
    """The norm a family's `Family.norm` names ("rms": `plain`, the decoder's own; "offset"; "float_weight")."""
    return plain(dim, eps) if kind == "rms" else VARIANTS[kind](dim, eps)


def softcap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """`tanh(x / cap) * cap` (Gemma 2's soft cap on attention scores and final logits); `x` when cap is None."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


ROUNDED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)  # every dtype a model may compute in


def embedding_scale(scale: float, dtype: torch.dtype) -> float:
    """`scale` rounded to `dtype`, as transformers multiplies Gemma's embeddings by a tensor of that dtype
    (sqrt(hidden) is exact in bf16 only for some widths)."""
    bits = struct.unpack("<I", struct.pack("<f", scale))[0]  # float32, rounded to nearest
    if dtype == torch.bfloat16:  # the top 16 bits, rounded to nearest even (no tensor: this runs under meta init)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    value = struct.unpack("<f", struct.pack("<I", bits))[0]
    if dtype == torch.float16:
        value = struct.unpack("<e", struct.pack("<e", value))[0]
    return value
