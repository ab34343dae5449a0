"""Defining the CPU backend's own operators (`staticformers::...`), which compiled graphs call whole.

Why this exists: each of the CPU's kernels that inductor cannot generate (oneDNN's float32 GEMM, ATen's int8
kernel in bf16, the streaming kernels of `gemv.py`, the decode attention of `decode_attention.py`) is one opaque
operator with a shape function for tracing, defined once per process even when two copies of this package are
imported. `define` is that step, written once; `build_library` builds and loads C++ files of such kernels as one
library, `NativeLibrary` does that once per process (ahead, in a thread, where `start` asks), and `NativeKernels`
loads one file's kernels from it on first use and gives their operators the kernel every other dispatch key runs
(load, then call again; or one clear error).
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_leaves

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


def build_library(sources: tuple) -> None:
    """Build the C++ files `sources`, in order, as one text against this torch with inductor's own toolchain
    (`CppCodeCache`: the compiler, flags and vector ISA inductor uses for every compiled CPU graph, and its disk
    cache) and load the library into this process, where its static initialisers register its kernels. One text,
    because the toolchain builds one (an `#include` of a file beside it would not be found), and because parsing
    PyTorch's headers is most of a build: several files built as one parse them once."""
    from torch._inductor.codecache import CppCodeCache

    class TorchLibrary(CppCodeCache):  # a shared library that includes and links PyTorch
        cache: dict = {}
        cpp_compile_command_flags = {"include_pytorch": True, "shared": True}

    texts = []
    for path in sources:
        with open(path) as f:
            texts.append(f.read())
    TorchLibrary.load("\n".join(texts), needs_vec_isa=True)


class NativeLibrary:
    """C++ files of kernels (`sources`) built and loaded as one library, at most once per process: by the first
    `built()` that asks, or ahead of it in a thread (`start()`), so that the compiler runs while the caller traces
    its graphs. `ready()` says whether building is worth trying here (a vector ISA for inductor)."""

    def __init__(self, sources: tuple, ready: Callable[[], bool]):
        self.sources, self.ready = sources, ready
        self.state: dict = {}  # "error": None once built and loaded, else why not
        self.lock = threading.Lock()  # held while building
        self.starting = threading.Lock()  # held while deciding whether to start the thread
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Build in a daemon thread unless that has begun or ended; `built()` then waits for it."""
        with self.starting:
            if self.thread is not None or "error" in self.state:
                return
            self.thread = threading.Thread(target=self._build, name="staticformers-kernels", daemon=True)
            self.thread.start()

    def _build(self) -> None:
        with self.lock:
            if "error" in self.state:
                return
            error: Optional[BaseException] = None
            if not self.ready():
                error = RuntimeError("inductor picked no vector instruction set for this CPU")
            else:
                try:
                    build_library(self.sources)
                except Exception as exc:  # no working C++ compiler here
                    error = exc
            self.state["error"] = error

    def built(self) -> Optional[BaseException]:
        """Build (or wait for the thread building) the library: None once it is loaded, else why it is not."""
        if "error" not in self.state:
            self._build()
        return self.state["error"]


class NativeKernels:
    """The kernels of one C++ file of `library`, loaded the first time `loaded()` asks.

    `ready()` says whether they are worth trying here (the kernels they call loaded) and `works()` whether the
    loaded kernels run; a failed build warns once with `fallback` (what runs instead). `state` holds "loaded" once
    decided."""

    def __init__(
        self, source: str, library: NativeLibrary, ready: Callable[[], bool], works: Callable[[], bool], fallback: str
    ):
        self.source, self.library, self.ready, self.works, self.fallback = source, library, ready, works, fallback
        self.state: dict = {}
        self.lock = threading.Lock()
        self.calling = threading.local()  # `again`: this thread is inside `first_call`'s re-dispatch

    def loaded(self) -> bool:
        if "loaded" in self.state:
            return self.state["loaded"]
        with self.lock:
            if "loaded" not in self.state:
                ok = False
                if self.ready():
                    error = self.library.built()
                    if error is None:
                        ok = self.works()
                    else:
                        warnings.warn(
                            f"staticformers: the CPU kernels of {os.path.basename(self.source)} could not be built "
                            f"({error!r}); {self.fallback}",
                            stacklevel=3,
                        )
                self.state["loaded"] = ok
        return self.state["loaded"]

    def first_call(self, name: str, instead: str, *args):
        """The kernel of operator `name` for every dispatch key without its own: on the CPU until the C++ kernel is
        loaded (a graph traced in another process calls it first), which this loads, then calls. Anything else
        gets one clear error; `instead` says what other devices, or a recompiled graph, run."""
        tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        if devices != {"cpu"}:
            raise RuntimeError(
                f"staticformers::{name} runs on the CPU only, and got tensors on {sorted(devices)}; "
                f"{instead} on other devices run their backend's own form."
            )
        if not self.loaded():
            raise RuntimeError(
                f"staticformers::{name} was called on a machine where its kernel cannot be built "
                f"(see the warning above); recompile the graph here, where {instead} run without it."
            )
        if getattr(self.calling, "again", False):  # loaded, yet dispatch came back here: the kernel did not register
            raise RuntimeError(
                f"staticformers::{name}'s CPU kernel was built but did not register; "
                "clear inductor's cache folder and run again."
            )
        self.calling.again = True
        try:
            return getattr(torch.ops.staticformers, name)(*args)
        finally:
            self.calling.again = False


__all__ = ["NativeKernels", "NativeLibrary", "build_library", "define"]
