"""oneDNN's float32 GEMM as an operator the CPU's compiled graphs can call.

Why this exists: on the CPU, `F.linear` / `torch.mm` in float32 go to MKL's sgemm, while bfloat16
goes to oneDNN, and oneDNN's float32 matmul measured faster than MKL's for every shape a decoder runs
(BENCHMARKS.md), where a float32 prefill spends most of its time. PyTorch exposes that kernel as
`torch.ops.mkldnn._linear_pointwise`, but inductor lowers that op only when the weight is a frozen
constant, and our graphs take weights as inputs (one layer graph serves every layer). So it is wrapped
here as an opaque operator, `staticformers::onednn_linear`, that graphs call like any extern kernel
(with a shape function for tracing); its dispatch cost is small against the GEMMs it runs.

The operator is for inference (no autograd formula): `onednn_linear` falls back to `F.linear` where
oneDNN is not built in or a gradient is wanted.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .operators import define

OP = "staticformers::onednn_linear"


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    bias = bias.contiguous() if bias is not None else None
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.contiguous(), bias, "none", [], "")


def _shape(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _define() -> bool:
    """Define the operator (once, at import) when this PyTorch has oneDNN's linear; whether it did."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    define("onednn_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _onednn_linear, "CPU", _shape)
    return True


ONEDNN = _define()  # a plain flag: read inside traced code


def onednn_available() -> bool:
    """Whether this PyTorch has oneDNN's linear (and so the operator)."""
    return ONEDNN


def onednn_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` computed by oneDNN (float32 on the CPU); `F.linear` where oneDNN is absent or a gradient
    is wanted (the operator has no backward)."""
    if not ONEDNN or (torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad)):
        return F.linear(x, layer.weight, layer.bias)
    return torch.ops.staticformers.onednn_linear(x, layer.weight, layer.bias)
