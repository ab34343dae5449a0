"""A compiled function for the CPU's regions: saved whole between processes, run without guard evaluation.

Why this exists: on the CPU a warm start is dominated by Dynamo itself (re-tracing each region and
evaluating its guards), not by compiling, and a decode step is short enough that guard evaluation is
a measurable share of it (every weight is a guarded input). `CPUCompiledFunction` is the shared
`compile.CompiledFunction` (counted, one graph per declared shape) with two additions:

- **saved artifacts** (`precompiled.py`): with `precompile` set (inductor patches), the first call loads
  the region's compiled function from `$STATICFORMERS_CACHE/precompiled/` when an earlier process saved
  it, else compiles it with Dynamo's `aot_compile` and saves it; a loaded artifact whose guards refuse
  the call is deleted and the region compiles as usual.
- **unguarded calls**: when the caller checked the inputs' declared shape (`checked=True`) and the
  function has its one graph, Dynamo's guards are not evaluated (there is nothing for them to choose
  between). `STATICFORMERS_SKIP_GUARDS=0` keeps them always.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...compilation.compiler import CompiledFunction, GraphRecord, cache_root, compile_function, inductor_patches
from . import precompiled

logger = logging.getLogger("staticformers")

SKIP_GUARDS = os.environ.get("STATICFORMERS_SKIP_GUARDS", "1") != "0"


def unguarded():
    """A context in which compiled functions run their cached graph without evaluating Dynamo's guards
    (for functions that have exactly one graph and inputs the caller has checked). A no-op context when
    `STATICFORMERS_SKIP_GUARDS=0`."""
    if not SKIP_GUARDS:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)


@dataclass
class CPUCompiledFunction(CompiledFunction):
    """See the module docstring."""

    precompile: Optional[dict] = None  # inductor patches when the graph goes through an artifact
    aot: Optional[Callable] = None  # the precompiled function (loaded or made), when there is one

    @property
    def raw(self) -> Callable:
        """What a warmed step calls for this function's one graph: the precompiled function's own body
        (a plain function; guards not evaluated), else the fresh code object that holds Dynamo's cache
        (called under Dynamo's run-only mode)."""
        return self.aot.fn if self.aot is not None else self.code

    def release(self) -> None:
        super().release()
        self.aot = None

    def run(self, args: tuple, checked: bool):
        if self.aot is not None:
            if checked and SKIP_GUARDS and self.graphs == 1:
                return self.aot.fn(*args)
            if self.aot.guard_check(*args):
                return self.aot.fn(*args)
            return self.compiled(*args)  # outside the plan: torch.compile counts and reports the extra graph
        if checked and self.graphs == 1 and SKIP_GUARDS:
            with unguarded():
                return self.compiled(*args)
        return self.compiled(*args)

    def first_call(self, args: tuple):
        """Through a saved artifact when this function may have one (loaded if an earlier process saved it,
        else compiled with `aot_compile` and saved), else `torch.compile`. A graph is recorded once the
        call has succeeded, so a first call that failed (and is made again) does not count two."""
        if self.precompile is None or not precompiled.enabled() or not precompiled.usable(self.fn, args):
            return self.compiled(*args)
        from torch._dynamo.utils import counters

        shapes = [tuple(t.shape) for t in args if isinstance(t, torch.Tensor)]
        path = precompiled.artifact_path(cache_root(), self.name, sorted(self.precompile.items()), args)
        start = time.perf_counter()
        loaded = self.aot is None and precompiled.load(path)
        if loaded:
            try:
                if not loaded.guard_check(*args):
                    raise RuntimeError("its guards refuse this call")
                out = loaded.fn(*args)
            except Exception as exc:  # refused, or failing here: never again, compile instead
                logger.info("precompiled artifact %s not used (%s); compiling", path, exc)
                precompiled.discard(path)
            else:
                self.aot = loaded
                self.extra_records.append(GraphRecord(self.name, shapes, time.perf_counter() - start, loaded=True))
                counters["staticformers"]["artifacts_loaded"] += 1
                return out
        if self.aot is None:
            try:
                self.aot = torch.compile(
                    self.code, backend="inductor", options=dict(self.precompile), fullgraph=True, dynamic=False
                ).aot_compile((args, {}))
            except Exception as exc:  # a graph Dynamo's precompile does not support: compile the usual way
                logger.info("%s cannot be precompiled (%s); compiling without an artifact", self.name, exc)
                return self.compiled(*args)
            precompiled.save(self.aot, path)
        out = self.aot(*args)
        self.extra_records.append(GraphRecord(self.name, shapes, time.perf_counter() - start))
        return out


def compile_region(
    fn: Callable,
    name: str,
    shape: tuple,
    backend: str = "inductor",
    mode: Optional[str] = None,
    options: Optional[dict] = None,
    fullgraph: bool = True,
    dynamic: bool = False,
    precompile: bool = True,
) -> CPUCompiledFunction:
    """`compile.compile_function` with this module's additions; saved whole when `precompile` and the
    graph can be (inductor, full graph, static shapes)."""
    saved = precompile and backend == "inductor" and fullgraph and not dynamic
    return compile_function(
        fn,
        name,
        shape,
        backend,
        mode,
        options,
        fullgraph,
        dynamic,
        function_class=CPUCompiledFunction,
        precompile=inductor_patches(mode, options) if saved else None,
    )
