"""What the CPU's decode kernels will run on here, told from the processor's flags without building them.

`staticformers doctor` must stay fast and imports no torch where it can, yet a user comparing machines wants to
know which path the bf16 decode kernel takes (`backends/cpu/gemv.cpp` picks it at run time from CPUID) and
whether a model's weights will sit in huge pages (`backends/cpu/weight_arena.py`). Both follow from
`/proc/cpuinfo`'s flags, the switches in the environment and the kernel's transparent-huge-page mode, which this
module reads as plain text; tests/test_doctor_kernels.py checks the prediction against the built kernel.

- `bf16_decode_path(flags, environ)`: "amx" (AMX tiles, where Linux grants them), "dot" (AVX512_BF16's dot
  products), "widen" (bfloat16 widened to float32 in AVX-512 or AVX2 FMAs), or "none" (no x86 vector ISA:
  inductor's reductions run instead), and a sentence saying why.
- `huge_pages(mode)`: what the weights' block gets under the transparent-huge-page mode.
- `decode_layers(flags, environ)`: whether a warm bf16 decode step of a plain pre-norm model runs its layers as one
  call (`backends/cpu/decode_layers.py`), as a sentence.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

CPUINFO = "/proc/cpuinfo"
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def cpu_flags(text: Optional[str] = None) -> set[str]:
    """The first processor's flags in `/proc/cpuinfo` (`text`: that file's contents; None reads it). Empty where
    there is no such file (not Linux) or no flags line (not x86)."""
    if text is None:
        try:
            with open(CPUINFO, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def vector_isa(flags: set[str]) -> int:
    """The vector width inductor builds the kernels for: 512 (AVX-512 F, BW, VL, DQ), 256 (AVX2 with FMA), 0."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return 512
    if {"avx2", "fma"} <= flags:
        return 256
    return 0


def _off(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name) == "0"


def bf16_decode_path(flags: set[str], environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(path, why): the path `bf16_gemv` takes for a decode step's bf16 projections (see the module docstring)."""
    isa = vector_isa(flags)
    if isa == 0:
        return "none", "no AVX2 or AVX-512 here: bf16 projections run inductor's reductions"
    if isa == 512 and {"amx_tile", "amx_bf16"} <= flags:
        if not _off(environ, "STATICFORMERS_AMX"):
            return "amx", "AMX tiles (amx_bf16), where Linux grants them to the process"
        amx = "AMX switched off by STATICFORMERS_AMX=0"
    else:
        amx = "no AMX"
    if isa == 512 and "avx512_bf16" in flags:
        if not _off(environ, "STATICFORMERS_BF16_DOT"):
            return "dot", f"AVX512_BF16's dot products ({amx})"
        dot = "dot products switched off by STATICFORMERS_BF16_DOT=0"
    else:
        dot = "no AVX512_BF16"
    return "widen", f"bf16 widened into AVX-{isa if isa == 256 else 512} FMAs ({amx}, {dot})"


def decode_layers(flags: set[str], environ: Mapping[str, str] = os.environ) -> str:
    """Whether a warm bf16 decode step whose layers are all the plain pre-norm kind (Llama, Mistral, Qwen2, Qwen3;
    bf16 weights, or weight-only int8 ones at one row; over a static or a block KV cache) runs them as one C++ call
    here, as a sentence: it needs the kernels `bf16_decode_path` needs, and `STATICFORMERS_DECODE_LAYERS=0` turns it
    off."""
    if _off(environ, "STATICFORMERS_DECODE_LAYERS"):
        return "each layer's compiled regions: STATICFORMERS_DECODE_LAYERS=0"
    if vector_isa(flags) == 0:
        return "each layer's compiled regions: no AVX2 or AVX-512 for the kernels"
    return (
        "one call for all layers, where they are the plain pre-norm kind with bf16 weights, or int8 ones at one row, "
        "over a static or a block KV cache (STATICFORMERS_DECODE_LAYERS=0: off)"
    )


def thp_mode(text: Optional[str] = None) -> Optional[str]:
    """The transparent-huge-page mode ("always", "madvise" or "never": the bracketed word of `THP`'s text), or
    None where the kernel has none."""
    if text is None:
        try:
            with open(THP, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def weight_arena_off(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `STATICFORMERS_WEIGHT_ARENA=0` leaves a model's weights where they were loaded
    (`backends/cpu/weight_arena.py`)."""
    return environ.get("STATICFORMERS_WEIGHT_ARENA", "1").strip() == "0"


def huge_pages(mode: Optional[str], environ: Mapping[str, str] = os.environ) -> str:
    """What a model's weights get on the CPU under transparent-huge-page mode `mode`, as a sentence."""
    if weight_arena_off(environ):
        return "left where they were loaded: STATICFORMERS_WEIGHT_ARENA=0"
    if mode in ("always", "madvise"):
        return f"one block of huge pages (transparent huge pages: {mode})"
    why = "this kernel has none" if mode is None else "they are off: never"
    return f"one block of 4 KiB pages (transparent huge pages: {why})"


__all__ = ["bf16_decode_path", "cpu_flags", "huge_pages", "thp_mode", "vector_isa", "weight_arena_off"]
