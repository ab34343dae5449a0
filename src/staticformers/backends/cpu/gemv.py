"""The CPU's weight-only int8 projections of a decode step's one row, as an operator compiled graphs call whole.

Why this exists: a batch-1 decode step is bound by the bytes of its weights, and weight-only int8 is
meant to halve them. ATen's `_weight_int8pack_mm` reads a few cache lines of several weight rows side
by side, which keeps the hardware's stream prefetch from running ahead once the weights no longer fit
in cache: over a whole model it read int8 at about half the rate a bf16 reduction reads bf16, so int8
decoded no faster than bf16. Inductor's own reduction over int8 is slower still (BENCHMARKS.md,
weight-only int8). `int8_gemv.cpp` reads the weights as one forward stream per thread instead, and
computes several projections of one input (q, k and v; gate and up) in one call.

How it is built: `staticformers::int8_gemv` (its schema and shape function) is defined here at import;
its CPU kernel is `int8_gemv.cpp`, built by inductor's own C++ toolchain (`CppCodeCache`: the compiler,
flags and vector ISA inductor uses for every compiled CPU graph, and its disk cache) the first time a
graph asks whether it can use it (`supports`), and loaded into this process, where it registers itself.
A compiled graph calls it as one opaque operator; it is for inference (no autograd formula). Until the
library is loaded, a call (a graph saved by another process) loads it first. Where the build fails, or
inductor picked no x86 vector ISA (AVX-512 or AVX2) for this CPU, `supports` says False and the caller
keeps ATen's kernel; a failed build says why once.
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

from .operators import define

OP = "staticformers::int8_gemv"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int8_gemv.cpp")
DTYPES = (torch.bfloat16, torch.float32)  # of the activations and of the scales, in any pairing

_STATE: dict = {}  # "loaded": whether the kernel runs here (absent until the first build or load attempt)
_LOCK = threading.Lock()
_CALLING = threading.local()  # `again`: this thread is inside `_first_call`'s re-dispatch


def _build() -> None:
    """Build `int8_gemv.cpp` against this torch and load it (its static initialisers register the kernel)."""
    from torch._inductor.codecache import CppCodeCache

    class TorchLibrary(CppCodeCache):  # a shared library that includes and links PyTorch
        cache: dict = {}
        cpp_compile_command_flags = {"include_pytorch": True, "shared": True}

    with open(SOURCE) as f:
        TorchLibrary.load(f.read(), needs_vec_isa=True)


def loaded() -> bool:
    """Whether the kernel runs in this process: built (once per machine and torch, then from inductor's disk
    cache) and loaded on first call, with a vector path for this CPU."""
    if "loaded" in _STATE:
        return _STATE["loaded"]
    with _LOCK:
        if "loaded" not in _STATE:
            ok = False
            if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
                try:
                    _build()
                    ok = torch.ops.staticformers_native.int8_gemv_isa() > 0
                except Exception as exc:  # no working C++ compiler here: ATen's kernel runs instead
                    warnings.warn(
                        f"staticformers: the CPU's int8 decode kernel could not be built ({exc!r}); "
                        "int8 projections run ATen's kernel instead, which reads int8 more slowly.",
                        stacklevel=2,
                    )
            _STATE["loaded"] = ok
    return _STATE["loaded"]


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


def _first_call(x: torch.Tensor, weights: list, scales: list) -> list:
    """The operator's kernel for every dispatch key without its own: on the CPU until the C++ kernel is
    loaded (a graph traced in another process calls it first), which this loads, then calls. Anything else
    gets one clear error."""
    devices = {t.device.type for t in (x, *weights, *scales)}
    if devices != {"cpu"}:
        raise RuntimeError(
            f"staticformers::int8_gemv runs on the CPU only, and got tensors on {sorted(devices)}; "
            "int8 projections on other devices run their backend's own form."
        )
    if not loaded():
        raise RuntimeError(
            "staticformers::int8_gemv was called on a machine where its kernel cannot be built "
            "(see the warning above); recompile the graph here, where ATen's kernel is chosen."
        )
    if getattr(_CALLING, "again", False):  # loaded, yet dispatch came back here: the kernel did not register
        raise RuntimeError(
            "staticformers::int8_gemv's CPU kernel was built but did not register; "
            "clear inductor's cache folder and run again."
        )
    _CALLING.again = True
    try:
        return torch.ops.staticformers.int8_gemv(x, weights, scales)
    finally:
        _CALLING.again = False


def _shape(x, weights, scales):
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


# a kernel for every backend key without its own: the C++ CPU kernel, once registered, takes precedence
define(
    "int8_gemv",
    "(Tensor x, Tensor[] weights, Tensor[] scales) -> Tensor[]",
    _first_call,
    "CompositeExplicitAutograd",
    _shape,
)


def int8_gemv(x: torch.Tensor, weights: list, scales: list) -> list:
    """`[x @ w.T * s for w, s in zip(weights, scales)]` in one call, for `x` `[rows, in]` (bfloat16 or
    float32), int8 weights `[out_i, in]` and their scales, `out_i` values each (`[out_i]` or `[out_i, 1]`;
    bfloat16 or float32, all of one dtype), each summed in float32 and returned in `x`'s dtype. Check
    `supports` first."""
    return torch.ops.staticformers.int8_gemv(x, list(weights), list(scales))


__all__ = ["OP", "int8_gemv", "loaded", "supports"]
