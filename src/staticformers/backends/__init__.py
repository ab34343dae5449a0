"""What a device kind changes about compiling and running the engine and the trainer.

The model is device-neutral (`modeling.py`, with the one `ops` seam) and the engine, the loop and the
trainer are too. Everything tuned for one kind of device lives in that kind's package, reached only
through `for_device(device)`, and no other module imports such a package: CUDA and Neuron never
import `backends/cpu/`. A backend answers these questions:

- `ops(engine, kind, batch, settings)`: the formulation of a generation step of that shape;
- `build_step(engine, kind, batch, dim, settings)`: the step function itself (whole-model graphs here;
  the CPU's are per-layer regions);
- `inductor_defaults()`: inductor options it wants unless the caller set them;
- `default_regional()`: whether generation compiles regions by default;
- `training_ops(dtype)`, `before_training()` and `before_compile(settings)`: the Trainer's formulation
  and what a process sets up before it trains or compiles.

`Backend` is the generic answer, used on CUDA, Neuron, XPU and MPS.
"""

from __future__ import annotations

import functools

import torch

from ..compile import CompiledFunction, compile_function, enable_persistent_cache
from ..generation.steps import DecodeStep, PrefillStep, Step, whole_decode, whole_prefill
from ..ops import PLAIN, Ops


class Backend:
    """The generic backend: whole-model graphs, the plain formulation (see the module docstring)."""

    name = "generic"

    def default_regional(self) -> bool:
        return False

    def inductor_defaults(self) -> dict:
        # the engine checks its inputs' shapes itself and owns the cache buffers: no per-call asserts
        return {"size_asserts": False, "alignment_asserts": False}

    def ops(self, engine, kind: str, batch: int, settings) -> Ops:
        return PLAIN

    def training_ops(self, dtype: torch.dtype) -> Ops:
        return PLAIN

    def before_training(self) -> None:
        pass

    def before_compile(self, settings) -> None:
        """What a process needs before its first compile under `settings` (the persistent caches)."""
        if settings.enabled and settings.backend not in ("eager", "aot_eager"):
            enable_persistent_cache()

    def compile_one(self, fn, name: str, shape: tuple, settings, precompile: bool = False) -> CompiledFunction:
        self.before_compile(settings)
        return compile_function(fn, name, shape, settings.backend, settings.mode, dict(settings.options),
                                settings.fullgraph, settings.dynamic)

    def build_step(self, engine, kind: str, batch: int, dim: int, settings) -> Step:
        """The whole-model step of one shape: `prefill [batch, dim]` or `decode [batch, 1]` over `[batch, dim]`."""
        model, ops = engine.model, self.ops(engine, kind, batch, settings)
        name = step_name(kind, batch, dim, settings)
        if kind == "prefill":
            fn = whole_prefill(model, dim, ops)
            compiled = self.compile_one(fn, name, (batch, dim), settings) if settings.enabled else None
            return PrefillStep(fn, compiled)
        cache = engine.cache(batch, dim)
        graphs = cuda_graphs(settings)
        if graphs:
            cache.mark_static()  # written in place by every replay
        fn = whole_decode(model, cache, ops)
        compiled = self.compile_one(fn, name, (batch, 1, dim), settings) if settings.enabled else None
        return DecodeStep(fn, compiled, cache, cuda_graphs=graphs)


def cuda_graphs(settings) -> bool:
    """Whether inductor will replay the graphs from CUDA graphs (`mode="reduce-overhead"` or the option)."""
    if not settings.enabled or settings.backend != "inductor":
        return False
    return settings.mode == "reduce-overhead" or bool(dict(settings.options).get("triton.cudagraphs"))


def step_name(kind: str, batch: int, dim: int, settings) -> str:
    return f"{kind}_b{batch}_{'l' if kind == 'prefill' else 'kv'}{dim}_{settings.backend}"


@functools.lru_cache(maxsize=None)
def _for_kind(kind: str) -> Backend:
    if kind == "cpu":
        from .cpu import CPUBackend

        return CPUBackend()
    return Backend()


def for_device(device) -> Backend:
    """The backend of a device (`torch.device`, or a string such as "cpu", "cuda:1", "neuron")."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return _for_kind(kind)


__all__ = ["Backend", "for_device", "step_name", "cuda_graphs"]
