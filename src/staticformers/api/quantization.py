"""Quantizing a model the transformers way: at load (`from_pretrained(..., quantization_config=...)`) or a built one.

Why this exists: the model layer (`models/quantization.py`) knows the numbers and the modules but no
device; whether a device may hold fp8 weights is its backend's answer. This module asks it before any
weight changes, and drops an engine built for the unquantized weights (its graphs read modules that are gone).
"""

from __future__ import annotations

import torch

from ..backends import for_device
from ..models.quantization import QuantizationConfig, as_quantization_config, quantize_model
from ..generation.engines import forget_engine


def check_device(config: QuantizationConfig, device: torch.device) -> None:
    """Refuse fp8 weights on a device without fp8 arithmetic, in one sentence."""
    if config.kind == "fp8" and not for_device(device).fp8_arithmetic(device):
        raise ValueError(
            f"fp8 weights need a device with fp8 arithmetic (CUDA compute capability 8.9+, Trainium2), "
            f'and {device} has none: use quantization_config=QuantizationConfig("int8_weight_only").'
        )


def quantize(model, quantization_config) -> list[str]:
    """Quantize a built model in place (see `models/quantization.quantize_model`); returns the modules quantized."""
    config = as_quantization_config(quantization_config)
    check_device(config, model.device)
    done = quantize_model(model, config)
    forget_engine(model)
    return done


__all__ = ["check_device", "quantize"]
