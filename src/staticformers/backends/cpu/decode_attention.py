"""The CPU's attention for a decode step over a static KV cache, as one operator compiled graphs call whole.

Why this exists: in the `"reduce"` formulation a decode step's attention is fused reductions that inductor
generates (`formulations.attend_decode`). They recompute the query's rotary embedding for every cached position
and sum each position's product across the vector, and at batch 8 they cost about a fifth of a bf16 decode
step of a 30-layer model (BENCHMARKS.md, "A decode attention kernel"). `decode_attention.cpp` does the same math
by hand: per (row, query head) the query once in float32, one pass over the positions its mask lets it attend
(masked ones are not read), a vectorised softmax, one pass over the values, all summed in float32.

How it is built: `staticformers::decode_attention` (its schema and shape function) is defined here at import; its
CPU kernel is `decode_attention.cpp`, part of the backend's one library (`kernel_library.py`), built by inductor's
toolchain at the latest the first time a graph asks whether it can use it (`runs`), and loaded into this process. Where the build fails, or the streaming
kernels of `gemv.py` cannot be built (no C++ compiler, no x86 vector ISA for inductor), `runs` says False and the
formulation keeps inductor's reductions. Block caches keep them too: their keys and values are read through the
block table inside those loops, where this operator would take a gathered copy (`decode_layers.py`'s one call reads
a pool through the table with the same loops, `attend_paged`).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import gemv
from .kernel_library import DECODE_ATTENTION, LIBRARY
from .operators import NativeKernels, define

DTYPES = (torch.float32, torch.bfloat16)

_KERNELS = NativeKernels(
    DECODE_ATTENTION,
    LIBRARY,
    ready=gemv.loaded,
    works=lambda: True,
    fallback="a decode step's attention runs inductor's reductions instead, which are slower.",
)


def loaded() -> bool:
    """Whether the kernel runs in this process: built (once per machine and torch, then from inductor's disk
    cache) and loaded on first call, where `gemv.py`'s kernels run (the same toolchain and vector ISA)."""
    return _KERNELS.loaded()


def _loaded_constant() -> bool:
    """`loaded()`, run once when a graph is traced and a constant in it."""
    return loaded()


# what `torch._dynamo.assume_constant_result` does, without importing Dynamo when this module loads
_loaded_constant._dynamo_marked_constant = True  # type: ignore[attr-defined]


def runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether `decode_attention` computes this attention here: one query per row, q, k and v on the CPU in one
    dtype (float32 or bfloat16), k and v of one length and q's head size, heads a multiple of the KV heads, and
    a boolean mask (or none)."""
    return (
        q.device.type == "cpu"
        and q.dim() == 4
        and q.shape[2] == 1
        and q.dtype in DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and k.shape[-1] == q.shape[-1]
        and k.shape[2] == v.shape[2]
        and q.shape[1] % k.shape[1] == 0
        and (mask is None or mask.dtype == torch.bool)
        and _loaded_constant()
    )


def _first_call(q, k, v, mask, scale):
    """The kernel for every dispatch key without its own (`NativeKernels.first_call`)."""
    return _KERNELS.first_call("decode_attention", "attention", q, k, v, mask, scale)


def _shape(q, k, v, mask, scale):
    return q.new_empty((q.shape[0], q.shape[1], 1, v.shape[-1]))


define(
    "decode_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor",
    _first_call,
    "CompositeExplicitAutograd",
    _shape,
)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float
) -> torch.Tensor:
    """Attention of one query per row: q `[b, h, 1, d]`, k `[b, kvh, L, d]`, v `[b, kvh, L, dv]`, mask `[b, 1, 1, L]`
    (True: may attend) or None; `[b, h, 1, dv]` in q's dtype, a row with nothing to attend zeros. Check `runs`."""
    return torch.ops.staticformers.decode_attention(q, k, v, mask, float(scale))


__all__ = ["decode_attention", "loaded", "runs"]
