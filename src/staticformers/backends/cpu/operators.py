"""Defining the CPU backend's own operators (`staticformers::...`), which compiled graphs call whole.

Why this exists: each of the CPU's kernels that inductor cannot generate (oneDNN's float32 GEMM, ATen's int8
kernel in bf16, the streaming kernels of `gemv.py`, the decode attention of `decode_attention.py`) is one opaque
operator with a shape function for tracing, defined once per process even when two copies of this package are
imported. `define` is that step, written once; `build_library` builds and loads a C++ file of such kernels.
"""

from __future__ import annotations

from typing import Callable

import torch

_LIBRARIES: list = []  # the torch.library.Library objects: an operator lives as long as its library


def define(
    name: str, schema: str, kernel: Callable, key: str, shape: Callable, namespace: str = "staticformers"
) -> None:
    """Define `namespace::name` with `schema` (the part after the name), `kernel` for dispatch key `key` and
    `shape` as its shape function, unless it is defined already (another copy of this package did it)."""
    if hasattr(getattr(torch.ops, namespace), name):
        return
    library = torch.library.Library(namespace, "FRAGMENT")
    library.define(f"{name}{schema}")
    library.impl(name, kernel, key)
    torch.library.register_fake(f"{namespace}::{name}")(shape)
    _LIBRARIES.append(library)


def build_library(source: str) -> None:
    """Build the C++ file `source` against this torch with inductor's own toolchain (`CppCodeCache`: the compiler,
    flags and vector ISA inductor uses for every compiled CPU graph, and its disk cache) and load it into this
    process, where its static initialisers register its kernels."""
    from torch._inductor.codecache import CppCodeCache

    class TorchLibrary(CppCodeCache):  # a shared library that includes and links PyTorch
        cache: dict = {}
        cpp_compile_command_flags = {"include_pytorch": True, "shared": True}

    with open(source) as f:
        TorchLibrary.load(f.read(), needs_vec_isa=True)


__all__ = ["build_library", "define"]
