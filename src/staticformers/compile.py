"""Compiling for a device that compiles one graph per shape: backend choice, graph counting, and the
persistent on-disk compile cache. Shared by the generation engine and the trainer.

Why a module of its own: every compiled function in staticformers must be *countable* (how many graphs,
for which shapes, how many seconds each) and *bounded* (one graph per declared shape, never PyTorch's
recompile limit, never a silent fallback to eager). This module gives both:

- `compile_function(fn, name, ...)` returns a `CompiledFunction`: a fresh code object per declared shape
  (so Dynamo's per-code recompile limit can never be reached by our own shapes), a counting backend that
  records each real compilation (seconds, example shapes), and a check that raises in strict mode (tests,
  `STATICFORMERS_STRICT_SHAPES=1`) or warns in production when a second graph appears for one shape.
- `cache_root()` is `~/.cache/staticformers` or `$STATICFORMERS_CACHE`; `enable_persistent_cache()`
  points inductor's FX-graph / AOTAutograd caches (and the Neuron compiler's cache) there, unless the
  user already chose a place, so a second process compiles nothing it compiled before; inductor's
  per-process CPU instruction-set probes are remembered there too (`isa_probes.py`, ~1 s a process).
- `compile_function(..., precompile=True)` (inductor) compiles through Dynamo's `aot_compile` and saves
  the result whole under the cache root, so a later process loads the graph instead of tracing it
  again (`precompiled.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import cache_safety, precompiled

logger = logging.getLogger("staticformers")

CACHE_ENV = "STATICFORMERS_CACHE"
STRICT_ENV = "STATICFORMERS_STRICT_SHAPES"


class ShapePlanViolation(RuntimeError):
    """A shape the plan did not declare reached a compiled function (a bug in the caller)."""


def strict_shapes() -> bool:
    """True when a shape outside the plan must raise (tests) rather than warn (production)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() not in ("", "0", "false", "no")


def shape_violation(message: str) -> None:
    """Raise in strict mode, warn otherwise."""
    if strict_shapes():
        raise ShapePlanViolation(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    logger.warning(message)


# ---------------------------------------------------------------------------------------------
# the persistent cache
# ---------------------------------------------------------------------------------------------
def cache_root() -> str:
    """Where staticformers keeps compiled artefacts: `$STATICFORMERS_CACHE` or `~/.cache/staticformers`."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "staticformers")
    return os.path.abspath(root)


_ENABLED_FOR: Optional[str] = None


def _user_inductor_dir() -> bool:
    """Whether `TORCHINDUCTOR_CACHE_DIR` holds a choice of the user's: set, and not inductor's own default,
    which inductor writes into the variable itself the first time it looks up its cache."""
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not value:
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(value) != os.path.abspath(default_cache_dir())
    except ImportError:  # pragma: no cover - a torch without inductor
        return True


def enable_persistent_cache() -> str:
    """Point inductor's on-disk caches (and Neuron's) under `cache_root()`; return the root.

    A location the user set explicitly (`TORCHINDUCTOR_CACHE_DIR`, `NEURON_COMPILE_CACHE_URL`) wins.
    Idempotent; cheap to call before every compile.
    """
    global _ENABLED_FOR
    root = cache_root()
    if _ENABLED_FOR == root:
        return root
    cache_safety.make_private_folder(root)
    if not cache_safety.trusted_folder(root):  # inductor's caches are pickles too: never point them at it
        return root
    if _ENABLED_FOR is not None or not _user_inductor_dir():
        # ours (first time, or the root moved since): inductor reads this variable at each lookup
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    os.environ.setdefault("NEURON_COMPILE_CACHE_URL", os.path.join(root, "neuron"))
    try:
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = True
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = True
    except Exception:  # pragma: no cover - a torch without inductor
        pass
    from .isa_probes import RECORD, remember_isa_probes

    remember_isa_probes(lambda: os.path.join(cache_root(), RECORD))
    _ENABLED_FOR = root
    return root


# ---------------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------------
BACKEND_ENV = "STATICFORMERS_COMPILE_BACKEND"


def default_backend(device: torch.device) -> str:
    """`$STATICFORMERS_COMPILE_BACKEND` when set (e.g. "eager" to debug), else the device's own."""
    from .devices import compile_backend_for

    return os.environ.get(BACKEND_ENV) or compile_backend_for(device)


def _inductor_patches(mode: Optional[str], options: Optional[dict]) -> dict:
    """Inductor's config patches for a mode and options (the options win)."""
    patches: dict = {}
    if mode is not None and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode))
    if options:
        patches.update(options)
    return patches


def _real_backend(backend: str, mode: Optional[str], options: Optional[dict]) -> Callable:
    """The compiler function behind a backend name, with mode/options applied (inductor only)."""
    if backend == "inductor":
        patches = _inductor_patches(mode, options)

        def inductor(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx  # here: a precompiled graph never needs it

            return compile_fx(gm, example_inputs, config_patches=dict(patches))

        return inductor
    if mode is not None or options:
        logger.info("compile mode/options are ignored by the %r backend", backend)
    return torch._dynamo.lookup_backend(backend)


SKIP_GUARDS = os.environ.get("STATICFORMERS_SKIP_GUARDS", "1") != "0"


def unguarded():
    """A context in which compiled functions run their cached graph without evaluating Dynamo's guards
    (for functions that have exactly one graph and inputs the caller has checked; see
    `CompiledFunction.__call__`). A no-op context when `STATICFORMERS_SKIP_GUARDS=0`."""
    if not SKIP_GUARDS:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)


@dataclass
class GraphRecord:
    """One real compilation: what was compiled, from which shapes, and how long it took."""

    name: str
    input_shapes: list
    seconds: float
    loaded: bool = False  # read from a precompiled artifact (`precompiled.py`), not traced or compiled


@dataclass
class CompiledFunction:
    """A function compiled for exactly one declared shape, with its compile record and call count."""

    name: str
    shape: tuple
    backend: str
    fn: Callable
    compiled: Callable
    records: list = field(default_factory=list)
    calls: int = 0
    first_call_seconds: float = 0.0  # wall time of the first call (trace + compile, or a cache hit)
    code: Optional[Callable] = None  # the fresh function whose code object holds Dynamo's cache
    precompile: Optional[dict] = None  # inductor patches when the graph goes through an artifact
    aot: Optional[Callable] = None  # the precompiled function (loaded or made), when there is one

    def release(self) -> None:
        """Drop the compiled graph and what it holds (a KV cache, weights): Dynamo keeps its cache on the
        code object, and its guards reference the closure, so clear that cache, then the references."""
        if self.code is not None:
            from torch._dynamo.eval_frame import reset_code

            reset_code(self.code.__code__)
        self.fn = self.compiled = self.code = self.aot = None

    def __call__(self, *args, checked: bool = False):
        """Run the graph. `checked=True` says the caller has verified that the inputs have the declared
        shape, dtype and device (the plan's contract): once the one graph exists, Dynamo's guards are
        then not evaluated (~0.3 ms per call on the 41.6M reference model's decode step, every
        parameter being a guarded input), since with one graph per function there is nothing for
        them to choose between."""
        if self.calls == 0:
            start = time.perf_counter()
            out = self._first_call(args)
            self.first_call_seconds = time.perf_counter() - start
        elif self.aot is not None:
            out = self._call_precompiled(args, checked)
        elif checked and len(self.records) == 1 and SKIP_GUARDS:
            with unguarded():
                out = self.compiled(*args)
        else:
            out = self.compiled(*args)
        self.calls += 1
        return out

    @property
    def graphs(self) -> int:
        return len(self.records)

    @property
    def raw(self) -> Callable:
        """What a warmed step calls for this function's one graph: the precompiled function's own body
        (a plain function; guards not evaluated), else the fresh code object that holds Dynamo's cache
        (called under Dynamo's run-only mode)."""
        return self.aot.fn if self.aot is not None else self.code

    def _first_call(self, args: tuple):
        """The first call: through a precompiled artifact when this function has one (loaded if an
        earlier process saved it, else compiled with `aot_compile` and saved), else `torch.compile`.
        A graph is recorded once the call has succeeded, so a first call that failed (and is made
        again) does not count two."""
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
                self.records.append(GraphRecord(self.name, shapes, time.perf_counter() - start, loaded=True))
                counters["staticformers"]["artifacts_loaded"] += 1
                return out
        if self.aot is None:
            try:
                self.aot = torch.compile(self.code, backend="inductor", options=dict(self.precompile),
                                         fullgraph=True, dynamic=False).aot_compile((args, {}))
            except Exception as exc:  # a graph Dynamo's precompile does not support: compile the usual way
                logger.info("%s cannot be precompiled (%s); compiling without an artifact", self.name, exc)
                return self.compiled(*args)
            precompiled.save(self.aot, path)
        out = self.aot(*args)
        self.records.append(GraphRecord(self.name, shapes, time.perf_counter() - start))
        return out

    def _call_precompiled(self, args: tuple, checked: bool):
        """A call of the precompiled graph: guards unevaluated when the engine checked the inputs and the
        function has its one graph (nothing for them to choose), else evaluated; inputs they refuse are
        outside the plan and go to `torch.compile`, which counts and reports the extra graph once."""
        if checked and SKIP_GUARDS and len(self.records) == 1:
            return self.aot.fn(*args)
        if self.aot.guard_check(*args):
            return self.aot.fn(*args)
        return self.compiled(*args)

    @property
    def compile_seconds(self) -> float:
        return sum(r.seconds for r in self.records)


_lock = threading.Lock()


def fresh_code(fn: Callable, name: str) -> Callable:
    """A copy of `fn` with its own code object, so Dynamo keeps a separate cache (and limit) for it."""
    safe = "".join(c if c.isalnum() else "_" for c in name)
    code = fn.__code__.replace(co_name=safe, co_qualname=safe) if hasattr(fn.__code__, "co_qualname") else \
        fn.__code__.replace(co_name=safe)
    out = types.FunctionType(code, fn.__globals__, safe, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def compile_function(
    fn: Callable,
    name: str,
    shape: tuple,
    backend: str,
    mode: Optional[str] = None,
    options: Optional[dict] = None,
    fullgraph: bool = True,
    dynamic: bool = False,
    precompile: bool = False,
) -> CompiledFunction:
    """Compile `fn` for one declared shape; every real compilation is counted and timed.

    `backend="eager"` / `"aot_eager"` still trace one Dynamo graph per shape (what tests count).
    A second compilation of the same function (a guard failed: a shape or a weight object changed)
    is a violation of the plan: it raises in strict mode and warns otherwise. `precompile=True` (inductor,
    full graph, static shapes) saves the compiled function whole under the cache root and loads it in
    later processes instead of tracing again (`precompiled.py`).
    """
    if backend not in ("eager", "aot_eager"):
        enable_persistent_cache()
    real = _real_backend(backend, mode, options)
    entry = CompiledFunction(name=name, shape=tuple(shape), backend=backend, fn=fn, compiled=None)

    def counting_backend(gm, example_inputs):
        shapes = [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)]
        if entry.records:
            shape_violation(
                f"{name} was about to compile a second graph (inputs {shapes[:4]}...) although its plan "
                f"declares one shape {entry.shape}: something outside the plan reached it."
            )
        start = time.perf_counter()
        out = real(gm, example_inputs)
        entry.records.append(GraphRecord(name, shapes, time.perf_counter() - start))
        logger.info("compiled %s %s with %s in %.2f s", name, entry.shape, backend, entry.records[-1].seconds)
        return out

    entry.code = fresh_code(fn, name)
    entry.compiled = torch.compile(entry.code, backend=counting_backend, fullgraph=fullgraph, dynamic=dynamic)
    if precompile and backend == "inductor" and fullgraph and not dynamic:
        entry.precompile = _inductor_patches(mode, options)
    return entry


def dynamo_counters() -> dict:
    """A copy of Dynamo's counters (frames compiled, graphs) for tests and benchmarks."""
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items()}
