"""The one compile path: backend choice, graph counting, strict shapes and the persistent on-disk cache.

Every compiled function in staticformers, the generation engine's steps, the Trainer's regions and the
distributed layer's per-block compile alike, goes through here, because each must be *countable* (how
many graphs, for which shapes, how many seconds each) and *bounded* (one graph per declared shape,
never PyTorch's recompile limit, never a silent fallback to eager):

- `compile_function(fn, name, shape, ...)` returns a `CompiledFunction`: a fresh code object per
  declared shape (so Dynamo's per-code recompile limit can never be reached by our own shapes), a
  counting backend (`GraphCounter`) that records each real compilation (seconds, example shapes),
  and a check that raises in strict mode (tests, `STATICFORMERS_STRICT_SHAPES=1`) or warns in
  production when a second graph appears for one shape.
- `compile_module_calls(modules, ...)` compiles each module's call (hooks included, as
  `nn.Module.compile` does) under its own code object and counter: what FSDP2's per-block compile needs.
- `cache_root()` is `~/.cache/staticformers` or `$STATICFORMERS_CACHE`; `enable_persistent_cache()`
  points inductor's FX-graph / AOTAutograd caches (and the Neuron compiler's cache) there, unless the
  user already chose a place, so a second process compiles nothing it compiled before.

What a device's backend adds (for instance the CPU's saved whole graphs and unguarded warm calls)
lives in `staticformers.backends`, which builds on the classes here.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import cache_safety, inductor_cache_dir

logger = logging.getLogger("staticformers")

CACHE_ENV = "STATICFORMERS_CACHE"
STRICT_ENV = "STATICFORMERS_STRICT_SHAPES"
BACKEND_ENV = "STATICFORMERS_COMPILE_BACKEND"


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
    inductor_cache_dir.usable()  # the user's folder, or ours, unusable: a temporary one, with one warning
    os.environ.setdefault("NEURON_COMPILE_CACHE_URL", os.path.join(root, "neuron"))
    try:
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = True
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = True
    except Exception:  # pragma: no cover - a torch without inductor
        pass
    _ENABLED_FOR = root
    return root


# ---------------------------------------------------------------------------------------------
# inductor
# ---------------------------------------------------------------------------------------------
def inductor_patches(mode: Optional[str], options: Optional[dict]) -> dict:
    """Inductor's config patches for a mode and options (the options win)."""
    patches: dict = {}
    if mode is not None and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode))
    if options:
        patches.update(options)
    return patches


def real_backend(backend, mode: Optional[str] = None, options: Optional[dict] = None) -> Callable:
    """The compiler function behind a backend name (or a callable backend), with mode/options applied
    (inductor only)."""
    if callable(backend):
        return backend
    if backend == "inductor":
        patches = inductor_patches(mode, options)

        def inductor(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx  # here: a saved graph never needs it

            return compile_fx(gm, example_inputs, config_patches=dict(patches))

        return inductor
    if mode is not None or options:
        logger.info("compile mode/options are ignored by the %r backend", backend)
    return torch._dynamo.lookup_backend(backend)


@dataclass
class GraphRecord:
    """One real compilation: what was compiled, from which shapes, and how long it took."""

    name: str
    input_shapes: list
    seconds: float
    loaded: bool = False  # read from a saved artifact (a backend's), not traced or compiled


class GraphCounter:
    """A `torch.compile` backend that records every graph it is handed (seconds, shapes) and delegates to
    the real one. With `limit`, a graph beyond it is a violation of the plan (strict: raises; else warns)."""

    def __init__(
        self,
        name: str,
        backend,
        mode: Optional[str] = None,
        options: Optional[dict] = None,
        limit: Optional[int] = 1,
        shape: tuple = (),
    ):
        self.name, self.limit, self.shape = name, limit, tuple(shape)
        self.backend_name = backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")
        self.real = real_backend(backend, mode, options)
        self.records: list[GraphRecord] = []

    def __call__(self, gm, example_inputs):
        shapes = [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)]
        if self.limit is not None and len(self.records) >= self.limit:
            shape_violation(
                f"{self.name} was about to compile graph {len(self.records) + 1} (inputs {shapes[:4]}...) although "
                f"its plan declares {self.limit} for shape {self.shape}: something outside the plan reached it."
            )
        start = time.perf_counter()
        out = self.real(gm, example_inputs)
        self.records.append(GraphRecord(self.name, shapes, time.perf_counter() - start))
        logger.info(
            "compiled %s %s with %s in %.2f s", self.name, self.shape, self.backend_name, self.records[-1].seconds
        )
        return out

    @property
    def graphs(self) -> int:
        return len(self.records)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)


@dataclass
class CompiledFunction:
    """A function compiled for exactly one declared shape, with its compile record and call count."""

    name: str
    shape: tuple
    backend: str
    fn: Callable
    compiled: Callable
    counter: Optional[GraphCounter] = None
    calls: int = 0
    first_call_seconds: float = 0.0  # wall time of the first call (trace + compile, or a cache hit)
    code: Optional[Callable] = None  # the fresh function whose code object holds Dynamo's cache
    extra_records: list = field(default_factory=list)  # graphs a backend added (saved artifacts)

    @property
    def records(self) -> list:
        return (self.counter.records if self.counter is not None else []) + self.extra_records

    @property
    def graphs(self) -> int:
        return len(self.records)

    @property
    def compile_seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    @property
    def raw(self) -> Callable:
        """The fresh code object that holds Dynamo's cache (what a backend may run under Dynamo's
        run-only mode once the one graph exists)."""
        return self.code

    def release(self) -> None:
        """Drop the compiled graph and what it holds (a KV cache, weights): Dynamo keeps its cache on the
        code object, and its guards reference the closure, so clear that cache, then the references."""
        if self.code is not None:
            from torch._dynamo.eval_frame import reset_code

            reset_code(self.code.__code__)
        self.fn = self.compiled = self.code = None

    def __call__(self, *args, checked: bool = False):
        """Run the graph. `checked=True` says the caller verified the inputs' declared shape; backends that
        can use that (skipping guard evaluation) override `run`."""
        if self.calls == 0:
            start = time.perf_counter()
            out = self.first_call(args)
            self.first_call_seconds = time.perf_counter() - start
        else:
            out = self.run(args, checked)
        self.calls += 1
        return out

    def first_call(self, args: tuple):
        return self.compiled(*args)

    def run(self, args: tuple, checked: bool):
        return self.compiled(*args)


def fresh_code(fn: Callable, name: str) -> Callable:
    """A copy of `fn` with its own code object, so Dynamo keeps a separate cache (and limit) for it."""
    safe = "".join(c if c.isalnum() else "_" for c in name)
    code = (
        fn.__code__.replace(co_name=safe, co_qualname=safe)
        if hasattr(fn.__code__, "co_qualname")
        else fn.__code__.replace(co_name=safe)
    )
    out = types.FunctionType(code, fn.__globals__, safe, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def compile_function(
    fn: Callable,
    name: str,
    shape: tuple,
    backend,
    mode: Optional[str] = None,
    options: Optional[dict] = None,
    fullgraph: bool = True,
    dynamic: bool = False,
    function_class: type = CompiledFunction,
    **extra,
) -> CompiledFunction:
    """Compile `fn` for one declared shape; every real compilation is counted and timed.

    `backend="eager"` / `"aot_eager"` still trace one Dynamo graph per shape (what tests count).
    A second compilation of the same function (a guard failed: a shape or a weight object changed)
    is a violation of the plan: it raises in strict mode and warns otherwise. `function_class` (a
    `CompiledFunction` subclass a backend provides) and `extra` (its own fields) let a backend add
    behaviour to the call, never to what is counted.
    """
    inductor_cache_dir.usable()  # before Dynamo is imported: an unusable folder would end the run
    if backend not in ("eager", "aot_eager") and not callable(backend):
        enable_persistent_cache()
    counter = GraphCounter(name, backend, mode, options, limit=1, shape=shape)
    code = fresh_code(fn, name)
    compiled = torch.compile(code, backend=counter, fullgraph=fullgraph, dynamic=dynamic)
    return function_class(
        name=name,
        shape=tuple(shape),
        backend=counter.backend_name,
        fn=fn,
        compiled=compiled,
        counter=counter,
        code=code,
        **extra,
    )


def _module_call(module, *args, **kwargs):
    return module._call_impl(*args, **kwargs)


def compile_module_calls(modules, name: str, backend, limit: Optional[int] = None, **kwargs) -> list[GraphCounter]:
    """Compile each module's call in place (its hooks inside the graph, as `nn.Module.compile` does), each
    under its own code object and `GraphCounter`, so that the graphs are counted and no module shares
    Dynamo's per-code recompile limit with the others (`nn.Module.compile` puts every module of one class
    on one code object, and past that limit they would silently run eagerly). Returns the counters."""
    counters = []
    inductor_cache_dir.usable()  # before Dynamo is imported: an unusable folder would end the run
    for i, module in enumerate(modules):
        counter = GraphCounter(f"{name}_{i}", backend, limit=limit)
        if not callable(backend) and backend not in ("eager", "aot_eager"):
            enable_persistent_cache()
        compiled = torch.compile(fresh_code(_module_call, f"{name}_{i}"), backend=counter, **kwargs)
        module._compiled_call_impl = functools.partial(compiled, module)
        counters.append(counter)
    return counters


def dynamo_counters() -> dict:
    """A copy of Dynamo's counters (frames compiled, graphs) for tests and benchmarks."""
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items()}
