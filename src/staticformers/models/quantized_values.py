"""The numbers of weight-only quantization: per-row symmetric int8 / fp8 values, their scales, widening them back.

Why this exists apart from `quantization.py`: the ops seam (`ops.py`) and the experts (`moe.py`) compute with
quantized values, and `quantization.py` builds on both; the numbers alone sit below all three.
"""

from __future__ import annotations

from typing import Optional

import torch

FP8 = torch.float8_e4m3fn
QMAX = {"int8": 127.0, "fp8": 448.0}


# ---------------------------------------------------------------------------------------------
def quantize_rows(w: torch.Tensor, kind: str, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)`: `w` `[..., out, in]` per output row, symmetric; `scale` `[..., out, 1]` in `scale_dtype`,
    and `q` computed against the scale as stored, so `q * scale` is within half a step of `w` (int8)."""
    wf = w.detach().float()
    amax = wf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX[kind], torch.ones_like(amax)).to(scale_dtype)
    ratio = wf / scale.float()
    if kind == "int8":
        return ratio.round().clamp(-127, 127).to(torch.int8), scale
    return ratio.clamp(-448, 448).to(FP8), scale


def widen(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stored values in `dtype`, exactly. int8 goes through bfloat16 first: inductor's freezing keeps
    an int8 -> bf16 conversion of a constant in the graph (so the int8 bytes are what is read), where it
    would fold any other into a wide copy of the weight."""
    return q.to(torch.bfloat16).to(dtype) if q.dtype == torch.int8 else q.to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`q * scale` in `dtype` (default: the scale's)."""
    dtype = dtype or scale.dtype
    return (widen(q, torch.float32) * scale.float()).to(dtype)


__all__ = ["FP8", "QMAX", "quantize_rows", "widen", "dequantize"]
