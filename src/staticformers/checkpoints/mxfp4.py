"""MXFP4 expert weights (gpt-oss checkpoints): their file names, their checks, and their dequantisation.

gpt-oss checkpoints store each sparse layer's stacked experts in OCP's MXFP4 format, with
`"quantization_config": {"quant_method": "mxfp4"}` in config.json:

- `...mlp.experts.gate_up_proj_blocks` `[E, rows, G, 16]` uint8: each byte two e2m1 values (the low
  nibble first), 32 values per group, `G` groups per row;
- `...mlp.experts.gate_up_proj_scales` `[E, rows, G]` uint8: each group's e8m0 exponent, biased by 127;

(and `down_proj_*` alike). A value is `FP4_VALUES[nibble] * 2 ** (scale - 127)`. `dequantize` turns a pair
into the `[E, rows, G * 32]` matrix in a floating dtype, exactly as transformers' `convert_moe_packed_tensors`
does before it transposes; the loader (`models/pretrained.py`) then fills the model's parameter from it,
which may be quantized again to our int8 when `quantization_config` asks for it. Nothing here knows a model.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

# the 16 e2m1 values, by nibble
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
SCALE_BIAS = 127

_PACKED = re.compile(r"^(?P<base>.*\.mlp\.experts\.(?:gate_up_proj|down_proj))_(?P<part>blocks|scales)$")


class Mxfp4FormatError(ValueError):
    """MXFP4 tensors that cannot be dequantised (one sentence naming the tensor)."""


def packed_part(name: str) -> Optional[tuple[str, str]]:
    """`(base, "blocks" | "scales")` for a file tensor holding part of an MXFP4 expert stack, else None."""
    m = _PACKED.match(name)
    return (m["base"], m["part"]) if m else None


def is_mxfp4_config(extra: dict) -> bool:
    """Whether config.json's `quantization_config` (kept among a config's extra keys) is MXFP4's."""
    raw = extra.get("quantization_config")
    return isinstance(raw, dict) and raw.get("quant_method") == "mxfp4"


def check(
    base: str,
    blocks: tuple,
    blocks_dtype: torch.dtype,
    scales: Optional[tuple],
    scales_dtype: Optional[torch.dtype],
    want: tuple,
    where: str,
) -> None:
    """Refuse, in one sentence, a pair that does not dequantise into `want` (`[E, rows, cols]`, the matrix
    before transposition): `scales` None means the file holds no scales for `base`."""
    if scales is None:
        raise Mxfp4FormatError(
            f"{where} holds {base}_blocks but no {base}_scales: an MXFP4 stack needs both; "
            f"restore the checkpoint's missing shard."
        )
    if blocks_dtype != torch.uint8 or scales_dtype != torch.uint8:
        raise Mxfp4FormatError(
            f"{base}_blocks and {base}_scales in {where} must be uint8, not "
            f"{blocks_dtype} and {scales_dtype}: the file is not an MXFP4 export."
        )
    if len(blocks) != len(want) + 1 or blocks[-1] != GROUP // 2 or tuple(blocks[:-1]) != tuple(scales):
        raise Mxfp4FormatError(
            f"{base}_blocks {list(blocks)} and {base}_scales {list(scales)} in {where} do not "
            f"pair up (blocks must be the scales' shape plus a last dim of {GROUP // 2})."
        )
    got = (*blocks[:-2], blocks[-2] * GROUP)
    if got != tuple(want):
        raise Mxfp4FormatError(
            f"{base}_blocks in {where} dequantises to {list(got)}, but config.json implies "
            f"{list(want)}: the config and the weights come from different models."
        )


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[*prefix, G, 16]` uint8 blocks and `[*prefix, G]` uint8 scales -> `[*prefix, G * 32]` in `dtype`
    (each byte's low nibble first; `ldexp` by the unbiased exponent, as transformers computes it), one
    leading slice at a time so the index tensors stay small."""
    if blocks.shape[:-1] != scales.shape:
        raise Mxfp4FormatError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair up.")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    *prefix, groups, width = blocks.shape
    out = torch.empty(*prefix, groups, width * 2, dtype=dtype, device=blocks.device)
    flat_blocks, flat_scales, flat_out = (
        blocks.reshape(-1, groups, width),
        scales.reshape(-1, groups),
        out.view(-1, groups, width * 2),
    )
    for i in range(flat_blocks.shape[0]):
        b = flat_blocks[i]
        part = flat_out[i]
        part[:, 0::2] = lut[(b & 0x0F).to(torch.int)]
        part[:, 1::2] = lut[(b >> 4).to(torch.int)]
        torch.ldexp(part, flat_scales[i].to(torch.int32).unsqueeze(-1) - SCALE_BIAS, out=part)
    return out.view(*prefix, groups * width * 2)


__all__ = ["FP4_VALUES", "GROUP", "Mxfp4FormatError", "packed_part", "is_mxfp4_config", "check", "dequantize"]
