"""The CPU's streaming projections of a decode step's few rows, as operators compiled graphs call whole.

Why this exists: a batch-1 decode step is bound by the bytes of its weights.
- **int8** (`int8_gemv`): weight-only int8 is meant to halve those bytes. ATen's `_weight_int8pack_mm` reads a
  few cache lines of several weight rows side by side, which keeps the hardware's stream prefetch from running
  ahead once the weights no longer fit in cache: over a whole model it read int8 at about half the rate a bf16
  reduction reads bf16, so int8 decoded no faster than bf16. Inductor's own reduction over int8 is slower still
  (BENCHMARKS.md, weight-only int8).
- **bfloat16** (`bf16_gemv`): inductor's float32 reduction over bf16 weight rows, and oneDNN's GEMM over packed
  weights at a few rows, read a decode step's bf16 weights at well under the memory's rate (BENCHMARKS.md, "A
  streaming bf16 kernel").
`gemv.cpp` reads the weights as one forward stream per thread instead, each weight row once for all the rows of
the step, and computes several projections of one input (q, k and v; gate and up) in one call. `bf16_mlp_block` is a
decoder layer's MLP half (residual, norm, gate and up, SiLU, down, residual) as one call: a compiled decode step made
five calls of it, each with its own host cost, in every layer (`gemv.cpp`'s `int8_mlp_block`, the same math over int8
weights, is no operator of its own: `decode_layers.py`'s one call runs it). Where the CPU has
AMX (bf16 tiles) and Linux grants them, bf16 calls run as tile multiplies (`amx()`): at 8 rows the vector loop's
widening and FMAs, not the memory, bounded the step (BENCHMARKS.md, "AMX tiles for the bf16 kernel");
`STATICFORMERS_AMX=0` turns that off. Where the CPU has AVX512_BF16 and no AMX (AMD Zen 4 and later), the loop
runs on its dot products instead (`dot()`: the activations stay bfloat16, one instruction a pair of products a
row); `STATICFORMERS_BF16_DOT=0` turns that off.

How it is built: `staticformers::int8_gemv` and `staticformers::bf16_gemv` (their schemas and shape functions)
are defined here at import; their CPU kernels are `gemv.cpp`, part of the backend's one library
(`kernel_library.py`), built by inductor's own C++ toolchain (`CppCodeCache`: the compiler, flags and vector ISA
inductor uses for every compiled CPU graph, and its disk cache) ahead in a thread once a model's steps are made, or
at the latest the first time a graph asks whether it can use them (`supports`, `bf16_supports`), and loaded into
this process, where it registers them. A compiled graph calls each as one opaque operator; they are for inference (no
autograd formula). Until the library is loaded, a call (a graph saved by another process) loads it first. Where
the build fails, or inductor picked no x86 vector ISA (AVX-512 or AVX2) for this CPU, `supports` says False and
the caller keeps ATen's kernel (or inductor's reduction); a failed build says why once.
"""

from __future__ import annotations

import torch

from .kernel_library import GEMV, LIBRARY, has_vector_isa
from .operators import NativeKernels, define

DTYPES = (torch.bfloat16, torch.float32)  # of the activations and of the scales, in any pairing

_KERNELS = NativeKernels(
    GEMV,
    LIBRARY,
    ready=has_vector_isa,
    works=lambda: torch.ops.staticformers_native.gemv_isa() > 0,
    fallback="int8 projections run ATen's kernel instead, and bf16 ones inductor's reduction, which read their "
    "weights more slowly.",
)
_STATE = _KERNELS.state  # "loaded": whether the kernel runs here (absent until the first build or load attempt)


def loaded() -> bool:
    """Whether the kernels run in this process: built (once per machine and torch, then from inductor's disk
    cache) and loaded on first call, with a vector path for this CPU."""
    return _KERNELS.loaded()


def _runs(act: torch.dtype, scale: torch.dtype) -> bool:
    """`loaded()` for these dtypes, run once when a graph is traced and a constant in it."""
    return act in DTYPES and scale in DTYPES and loaded()


# what `torch._dynamo.assume_constant_result` does, without importing Dynamo when this module loads: an
# eager run never needs it, and importing it creates inductor's cache folder (which may be unusable)
_runs._dynamo_marked_constant = True  # type: ignore[attr-defined]


def supports(x: torch.Tensor, *scales: torch.Tensor) -> bool:
    """Whether `int8_gemv` computes projections of these activations with these scales on this machine (one
    call takes scales of one dtype)."""
    return x.device.type == "cpu" and len({s.dtype for s in scales}) == 1 and _runs(x.dtype, scales[0].dtype)


def _first_call(name: str, *args) -> list:
    """The kernel of operator `name` for every dispatch key without its own (`NativeKernels.first_call`)."""
    return _KERNELS.first_call(name, "projections", *args)


def _shape(x, weights, scales=None):
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


# a kernel for every backend key without its own: the C++ CPU kernel, once registered, takes precedence
define(
    "int8_gemv",
    "(Tensor x, Tensor[] weights, Tensor[] scales) -> Tensor[]",
    lambda x, weights, scales: _first_call("int8_gemv", x, weights, scales),
    "CompositeExplicitAutograd",
    _shape,
)
define(
    "bf16_gemv",
    "(Tensor x, Tensor[] weights) -> Tensor[]",
    lambda x, weights: _first_call("bf16_gemv", x, weights),
    "CompositeExplicitAutograd",
    _shape,
)
define(
    "bf16_mlp_block",
    "(Tensor x, Tensor attn, Tensor norm, float eps, Tensor gate, Tensor up, Tensor down) -> Tensor",
    lambda *args: _first_call("bf16_mlp_block", *args),
    "CompositeExplicitAutograd",
    lambda x, attn, norm, eps, gate, up, down: x.new_empty(x.shape),
)


def int8_gemv(x: torch.Tensor, weights: list, scales: list) -> list:
    """`[x @ w.T * s for w, s in zip(weights, scales)]` in one call, for `x` `[rows, in]` (bfloat16 or
    float32), int8 weights `[out_i, in]` and their scales, `out_i` values each (`[out_i]` or `[out_i, 1]`;
    bfloat16 or float32, all of one dtype), each summed in float32 and returned in `x`'s dtype. Check
    `supports` first."""
    return torch.ops.staticformers.int8_gemv(x, list(weights), list(scales))


def bf16_supports(x: torch.Tensor) -> bool:
    """Whether `bf16_gemv` computes projections of these activations on this machine: bfloat16 on the CPU."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and _runs(x.dtype, x.dtype)


def amx() -> bool:
    """Whether `bf16_gemv` runs on AMX's tiles here, now (the kernel loaded, the CPU has them, Linux granted them,
    and `STATICFORMERS_AMX` is not `0`), for calls whose inputs have a multiple of 32 values and whose weights have
    at least 16 rows each; other calls, and every call elsewhere, run the vector loop."""
    return loaded() and bool(torch.ops.staticformers_native.gemv_amx())


def dot() -> bool:
    """Whether `bf16_gemv`'s calls that AMX does not take run on AVX512_BF16's dot products here, now (the kernel
    loaded, the CPU has them, and `STATICFORMERS_BF16_DOT` is not `0`): the activations stay bfloat16 and each pair
    of products is one instruction's; elsewhere the loop widens the weights to float32 and multiplies them."""
    return loaded() and bool(torch.ops.staticformers_native.gemv_dot())


def bf16_gemv(x: torch.Tensor, weights: list) -> list:
    """`[x @ w.T for w in weights]` in one call, for `x` `[rows, in]` and weights `[out_i, in]`, all bfloat16:
    each output summed in float32 and rounded to bfloat16 once, each weight row read once for all the rows.
    Check `bf16_supports` first."""
    return torch.ops.staticformers.bf16_gemv(x, list(weights))


def bf16_mlp_block(
    x: torch.Tensor,
    attn: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """The MLP half of a decoder layer in one call, for `x` and `attn` `[rows, hidden]` and bfloat16 weights: `r =
    x + attn`, then `r + down(silu(gate(h)) * up(h))` with `h = norm * rmsnorm(r)` (float32, cast to bfloat16
    before the weight), each of r, the normalised r, h, the activation and the output rounded to bfloat16 once, and
    the gate, up and down projections streamed as `bf16_gemv` streams them. Check `bf16_supports` first."""
    return torch.ops.staticformers.bf16_mlp_block(x, attn, norm, float(eps), gate, up, down)


__all__ = ["amx", "bf16_gemv", "bf16_mlp_block", "bf16_supports", "dot", "int8_gemv", "loaded", "supports"]
