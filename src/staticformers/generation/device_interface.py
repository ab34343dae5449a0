"""What the engine needs from a device's backend, declared on the engine's side.

The engine (`engine.py`) calls these and nothing else of a backend; `staticformers.backends` implements
them for each device kind without importing this package (the types here are structural). The context
object the engine passes in is the backend's only way back to the engine: the caches a step writes and
the decode step a prefill may finish with. A backend keeps what it decides per model (formulations,
compiled functions shared by several steps) in its own `StepBuilder`, which the engine holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..compilation.compiler import CompiledFunction
    from ..compilation.steps import Step
    from ..models.kv_cache import KVCache


class StepContext(Protocol):
    """The engine's side: the cache of one `(batch, kv)` shape and the decode step over it."""

    def cache(self, batch: int, kv: int) -> "KVCache": ...

    def decode_step(self, batch: int, kv: int, settings) -> "Step": ...


class StepBuilder(Protocol):
    """One model's steps on one backend; `shared` holds compiled functions several steps use."""

    shared: dict[tuple, "CompiledFunction"]

    def build(self, kind: str, batch: int, dim: int, settings, context: StepContext) -> "Step": ...

    def reset(self) -> None: ...


class DeviceBackend(Protocol):
    """The backend of one device kind, as generation sees it."""

    name: str

    def compile_defaults(self, compile_backend: str) -> dict: ...

    regional_by_default: bool

    def freezes_weights(self, settings) -> bool: ...

    def steps_for(self, model, tp: int = 1) -> StepBuilder: ...

    def arrange_weights(self, model, tp: int = 1) -> bool: ...

    def flush(self, device) -> None: ...

    host_generators: bool


__all__ = ["StepContext", "StepBuilder", "DeviceBackend"]
