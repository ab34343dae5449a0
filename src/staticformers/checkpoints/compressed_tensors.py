"""compressed-tensors' weight-only 8-bit formats, as llm-compressor writes them and vLLM serves them.

Why this exists: a quantized model saved here must load again without quantising a second time, and the
Hub's int8 and fp8 weight-only checkpoints are compressed-tensors folders. This module is the file side
of that format and knows no model: the `quantization_config` of config.json (read and written) and the
packing of `pack-quantized` weights.

What is read: one config group whose weights are 8-bit, symmetric, per output channel (`strategy:
"channel"`; `"tensor"` scales are widened to one per row), `type` "int" in the `int-quantized` format
(`weight` int8, `weight_scale` `[out, 1]`, a zero `weight_zero_point` if stored) or the `pack-quantized`
one (`weight_packed` int32 holding four offset bytes each, `weight_shape`), or `type` "float" in the
`float-quantized` format (`weight` float8_e4m3fn); `targets: ["Linear"]`; `ignore` as module names or
`re:` patterns. What is refused, one sentence each: other bit widths (int4 and the like), group or block
scales, asymmetric weights, quantized activations, sparsity and several config groups.

What is written: `pack-quantized` for int8 (what llm-compressor writes for 8-bit weight-only, and what
transformers' compressed-tensors loader expects of such a config), `float-quantized` for fp8; strategy
"channel", the scale in the model's dtype, the skipped modules under `ignore`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

FORMATS = {"int-quantized": "int8", "pack-quantized": "int8", "float-quantized": "fp8"}


class QuantizationFormatError(ValueError):
    """A `quantization_config` this reader does not load (the message says which part and what to do)."""


@dataclass(frozen=True)
class Scheme:
    """What a compressed-tensors config says of the weights: `kind` ("int8" or "fp8"), the file `format`,
    the modules left in full precision (`ignore`)."""

    kind: str
    format: str
    ignore: tuple = field(default_factory=tuple)

    def skips(self, module: str) -> bool:
        """Whether `module` (a dotted name) is one of `ignore`'s names or matches one of its `re:` patterns."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif entry == module:
                return True
        return False


def write_config(kind: str, ignore: list[str]) -> dict:
    """config.json's `quantization_config` for weight-only `kind` ("int8" or "fp8"), per output channel."""
    weights: dict[str, Any] = {
        "num_bits": 8,
        "type": "int" if kind == "int8" else "float",
        "symmetric": True,
        "strategy": "channel",
        "group_size": None,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    fmt = "pack-quantized" if kind == "int8" else "float-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "format": fmt,
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


def read_config(raw: dict, source: str = "config.json") -> Scheme:
    """The `Scheme` of a compressed-tensors `quantization_config`, or one sentence saying what is not read."""
    fmt = raw.get("format")
    if fmt not in FORMATS:
        raise QuantizationFormatError(
            f"{source}'s quantization_config has format {fmt!r}, which staticformers does not read: it reads "
            f"compressed-tensors' {', '.join(sorted(FORMATS))} (8-bit weights per channel); use the model's "
            f'unquantized checkpoint with quantization_config=QuantizationConfig("int8_weight_only").'
        )
    if raw.get("sparsity_config"):
        raise QuantizationFormatError(
            f"{source}'s quantization_config has a sparsity_config, which staticformers does "
            f"not read: use a dense checkpoint."
        )
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationFormatError(
            f"{source}'s quantization_config has {len(groups)} config groups; staticformers reads exactly one (every "
            f"quantized Linear alike): use the unquantized checkpoint and quantize at load."
        )
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    kind = FORMATS[fmt]
    want_type = "int" if kind == "int8" else "float"
    problems = []
    if weights.get("num_bits") != 8 or weights.get("type") != want_type:
        problems.append(f"{weights.get('num_bits')}-bit {weights.get('type')} weights (it reads 8-bit {want_type})")
    if weights.get("strategy") not in ("channel", "tensor"):
        problems.append(f'strategy {weights.get("strategy")!r} (it reads "channel" and "tensor")')
    if weights.get("symmetric") is False:
        problems.append("asymmetric weights")
    if group.get("input_activations") or group.get("output_activations"):
        problems.append("quantized activations (it reads weight-only checkpoints)")
    if [t for t in group.get("targets") or [] if t != "Linear"]:
        problems.append(f'targets {group.get("targets")} (it reads ["Linear"])')
    if problems:
        raise QuantizationFormatError(
            f"{source}'s quantization_config asks for {'; '.join(problems)}, which staticformers does not read: use "
            f'the unquantized checkpoint with quantization_config=QuantizationConfig("int8_weight_only").'
        )
    return Scheme(kind, fmt, tuple(raw.get("ignore") or ()))


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """`pack-quantized` at 8 bits: each row's int8 values offset by 128 and packed four to an int32, the first
    in the lowest byte (rows padded with zero bytes to a multiple of four)."""
    rows, cols = q.shape
    pad = (-cols) % 4
    u = q.to(torch.int32) + 128
    if pad:
        u = torch.cat([u, u.new_zeros(rows, pad)], 1)
    u = u.view(rows, -1, 4)
    packed = u[..., 0] | (u[..., 1] << 8) | (u[..., 2] << 16) | (u[..., 3] << 24)
    return packed.to(torch.int32)


def unpack_int8(packed: torch.Tensor, shape: tuple) -> torch.Tensor:
    """The int8 weight `shape` `[out, in]` of a `pack-quantized` 8-bit `weight_packed` (see `pack_int8`)."""
    if packed.dtype != torch.int32:
        raise QuantizationFormatError(
            f"A weight_packed tensor is {packed.dtype}, not int32: the file is not "
            f"compressed-tensors' pack-quantized format."
        )
    parts = [(packed >> (8 * i)) & 0xFF for i in range(4)]
    u = torch.stack(parts, -1).reshape(packed.shape[0], -1)[:, : int(shape[1])]
    return (u - 128).to(torch.int8)


def scheme_of(config_extra: dict, source: str = "config.json") -> Optional[Scheme]:
    """The scheme of a config.json's extra keys (`quantization_config`), None when it has none; a
    quantization_config of another method (torchao, bitsandbytes, GPTQ, AWQ, ...) is refused in one sentence."""
    raw = config_extra.get("quantization_config")
    if raw is None:
        return None
    method = raw.get("quant_method") if isinstance(raw, dict) else None
    if method != "compressed-tensors":
        raise QuantizationFormatError(
            f"{source} holds a {method or 'unknown'} quantization_config, which staticformers does not read (it reads "
            f"compressed-tensors' 8-bit weight-only formats): load the unquantized checkpoint with "
            f'quantization_config=QuantizationConfig("int8_weight_only").'
        )
    return read_config(raw, source)


__all__ = [
    "FORMATS",
    "QuantizationFormatError",
    "Scheme",
    "write_config",
    "read_config",
    "pack_int8",
    "unpack_int8",
    "scheme_of",
]
