"""Each model's one engine, found from the model, and the compile settings a call gives it.

Why a module of its own: `generate()`, the pipeline, the server, the command line, the benchmarks and the tests all
need "the engine of this model" and "its compile settings for this call", and the engine is generation's own object:
keeping its registry in the transformers-named surface (`api/`) made every layer above generation reach into `api/`
for it. A model's engine is created on first use and kept on the model (`engine_for`); `compile_settings` turns a
`GenerationConfig` and a `CompileConfig` into the engine's `CompileSettings`, the device's backend adding its
defaults.
"""

from __future__ import annotations

from typing import Optional

from ..backends.devices import default_backend
from .engine import CompileSettings, Engine
from .generation_config import CompileConfig, GenerationConfig
from .plan import ShapePlan

ENGINE_ATTR = "_staticformers_engine"  # where a model keeps its engine (`model.__dict__`)


def engine_for(model, plan: Optional[ShapePlan] = None) -> Engine:
    """The model's engine (created on first use); `plan` replaces its plan.

    It is kept in the model's `__dict__`, not in a map keyed by the model: its compiled steps call the
    model's modules, so a value of such a map would keep its key alive and no model would ever be freed;
    on the model, the two form a cycle that Python's collector frees together."""
    engine = model.__dict__.get(ENGINE_ATTR)
    if engine is None:
        dims = getattr(model, "parallel_dims", None)  # the layout a partitioned model was loaded with
        engine = Engine(model, plan, tp=dims.tp if dims is not None else 1)
        model.__dict__[ENGINE_ATTR] = engine
    elif plan is not None:
        engine.plan = plan.bind(model.config.max_position_embeddings)
        engine.follow(engine.plan)
    return engine


def compile_stats(model) -> list[dict]:
    """Each graph the engine built: kind, shape, backend, graphs compiled, seconds, calls."""
    engine = model.__dict__.get(ENGINE_ATTR)
    return engine.stats() if engine is not None else []


# ---------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------
def compile_settings(
    model, config: GenerationConfig, compile_config: Optional[CompileConfig] = None
) -> CompileSettings:
    """The engine's compile settings for a call: the config's, the device's backend and its defaults."""
    cc = compile_config if compile_config is not None else CompileConfig()
    if not isinstance(cc, CompileConfig):
        raise TypeError(f"compile_config must be a staticformers.CompileConfig, got {type(cc).__name__}.")
    engine = engine_for(model)
    backend = cc.backend or default_backend(model.device)
    options = {**engine.backend.compile_defaults(backend), **(cc.options or {})}
    return CompileSettings(
        enabled=not config.disable_compile,
        backend=backend,
        mode=cc.mode,
        options=tuple(sorted(options.items())),
        fullgraph=cc.fullgraph,
        dynamic=cc.dynamic,
        fast_decode=bool(cc.fast_decode),
        regional=bool(cc.regional) if cc.regional is not None else engine.backend.regional_by_default,
    )


def forget_engine(model) -> None:
    """Drop the model's engine (its graphs and caches): the next call builds a new one, for weights that changed
    their layout."""
    model.__dict__.pop(ENGINE_ATTR, None)


__all__ = ["ENGINE_ATTR", "compile_settings", "compile_stats", "engine_for", "forget_engine"]
