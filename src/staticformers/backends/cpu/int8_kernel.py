"""ATen's weight-only int8 kernel for float32 activations, as an operator the CPU's compiled graphs call whole.

Why this exists: `torch._weight_int8pack_mm` has no fast float32 path in this PyTorch (it ran 8-60x slower
in float32 than in bfloat16 on the reference's projections: `bench/int8_kernels.py`, BENCHMARKS.md), so a
float32 model's int8 decode runs it in bfloat16. Written inline in a graph, that casts the float32 scales
to bfloat16, and inductor's lowering of the kernel takes its scale input only as a stored buffer: a cast
computed in the graph fails to lower. So the casts and the kernel are one opaque operator here,
`staticformers::int8_linear_bf16` (with a shape function for tracing), as `onednn.py` wraps oneDNN's GEMM.
It is for inference (no autograd formula); the activations a decode step casts are a few rows.
"""

from __future__ import annotations

import torch

from .operators import define

OP = "staticformers::int8_linear_bf16"


def _int8_linear_bf16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    y = torch._weight_int8pack_mm(
        x.to(torch.bfloat16).contiguous(), weight.contiguous(), scale.to(torch.bfloat16).contiguous()
    )
    return y.to(x.dtype)


def _shape(x, weight, scale):
    return x.new_empty((x.shape[0], weight.shape[0]))


define("int8_linear_bf16", "(Tensor x, Tensor weight, Tensor scale) -> Tensor", _int8_linear_bf16, "CPU", _shape)


def int8_linear_bf16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T * scale` for float32 `x` `[rows, in]`, int8 `weight` `[out, in]` and float32 `scale`
    `[out]`, computed by ATen's int8 kernel in bfloat16 and returned in float32."""
    return torch.ops.staticformers.int8_linear_bf16(x, weight, scale)


__all__ = ["OP", "int8_linear_bf16"]
