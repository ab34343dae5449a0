"""The generic backend: what every device kind can run, and the defaults each kind's backend overrides.

A backend answers, for one kind of device, every question whose answer differs between devices: how a
generation step is built and compiled, which compile backend and options it gets, the `torch.distributed`
backend and `set_device`, the generators' state, synchronisation, free memory, and the Trainer's choices
(fused optimizer, pinned memory, TF32, its formulation). Nothing outside `backends/` and device
resolution tests `device.type`: it asks `for_device(device)`.

Per model, a backend keeps its own state in a `StepBuilder` (`steps_for(model, tp)`): the formulation
chosen per shape and the compiled functions several steps share. The engine holds that object and
calls it; the backend never reads or writes the engine.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..compilation import inductor_cache_dir
from ..compilation.compiler import CompiledFunction, compile_function, enable_persistent_cache
from ..compilation.steps import (
    DecodeStep,
    ExtendStep,
    PrefillStep,
    ScoreStep,
    Step,
    whole_decode,
    whole_extend,
    whole_prefill,
    whole_score,
)
from ..models.ops import PLAIN, Ops


def host_available_memory() -> Optional[int]:
    """The host memory that can be allocated now (`psutil`), or None when the system hides it."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # pragma: no cover - psutil is a dependency; a sandbox may hide /proc
        return None


def step_name(kind: str, batch: int, dim, settings) -> str:
    """A step's compiled name; an extend step's `dim` is `(K, T, n)`."""
    if kind == "extend":
        kv, tokens, kept = dim
        return f"extend_b{batch}_t{tokens}_n{kept}_kv{kv}_{settings.backend}"
    return f"{kind}_b{batch}_{'kv' if kind == 'decode' else 'l'}{dim}_{settings.backend}"


def cuda_graphs(settings) -> bool:
    """Whether inductor will replay the graphs from CUDA graphs (`mode="reduce-overhead"` or the option)."""
    if not settings.enabled or settings.backend != "inductor":
        return False
    return settings.mode == "reduce-overhead" or bool(dict(settings.options).get("triton.cudagraphs"))


class StepBuilder:
    """One model's generation steps on one backend: whole-model graphs (see the module docstring).

    `context` (the engine's side of the interface) gives `cache(batch, kv)` and `decode_step(batch, kv,
    settings)`; `shared` holds compiled functions that several steps use (counted once by the engine)."""

    def __init__(self, backend: "Backend", model, tp: int = 1):
        self.backend, self.model, self.tp = backend, model, tp
        self.shared: dict[tuple, CompiledFunction] = {}

    def reset(self) -> None:
        """Forget per-weights choices (the engine drops its steps at the same time)."""
        self.shared.clear()

    def ops(self, kind: str, batch: int, settings) -> Ops:
        return PLAIN

    def build(self, kind: str, batch: int, dim, settings, context) -> Step:
        """The whole-model step of one shape: `prefill [batch, dim]`, `score [batch, dim]` (a prefill with the
        prompt's log-probabilities), `decode [batch, 1]` over `[batch, dim]`, or `extend [batch, T]` over
        `[batch, K]` keeping `n` positions (`dim` = `(K, T, n)`)."""
        model, ops = self.model, self.ops(kind, batch, settings)
        name = step_name(kind, batch, dim, settings)
        if kind == "prefill":
            fn = whole_prefill(model, dim, ops)
            compiled = self.backend.compile_one(fn, name, (batch, dim), settings) if settings.enabled else None
            return PrefillStep(fn, compiled)
        if kind == "score":
            fn = whole_score(model, dim, ops)
            compiled = self.backend.compile_one(fn, name, (batch, dim), settings) if settings.enabled else None
            return ScoreStep(fn, compiled)
        if kind == "extend":
            kv, tokens, _ = dim
            cache = context.cache(batch, kv)
            graphs = cuda_graphs(settings)
            if graphs:
                cache.mark_static()
            fn = whole_extend(model, cache, ops)
            compiled = self.backend.compile_one(fn, name, (batch, tokens, kv), settings) if settings.enabled else None
            return ExtendStep(fn, compiled, cache, cuda_graphs=graphs)
        cache = context.cache(batch, dim)
        graphs = cuda_graphs(settings)
        if graphs:
            cache.mark_static()  # written in place by every replay
        fn = whole_decode(model, cache, ops)
        compiled = self.backend.compile_one(fn, name, (batch, 1, dim), settings) if settings.enabled else None
        return DecodeStep(fn, compiled, cache, cuda_graphs=graphs)


class Backend:
    """The generic backend (see the module docstring): whole-model graphs, the plain formulation, and the
    device kind's compile and `torch.distributed` backends from the device table (`devices.py`)."""

    name = "generic"
    kind = "generic"
    regional_by_default = False  # whether generation compiles per-layer regions unless asked otherwise
    # whether a server compiles its whole shape plan before traffic unless told otherwise: where a graph
    # compiles for minutes (Neuron, XLA), a first request must not pay for one
    precompile_by_default = False
    per_rank_device = True  # each torchrun rank takes the device of its LOCAL_RANK (False: the ranks share one)
    hosts_memory = False  # tensors live in host memory (reads may land in them directly; offload is moot)
    fused_optimizer = False  # torch's fused AdamW kernel exists on this kind
    pin_memory = False  # host batches are pinned for faster copies to this device
    tf32 = False  # this kind has TF32 matmul modes (`TrainingArguments.tf32`)
    host_generators = False  # sampling draws noise with CPU generators and sends it (a device draw would recompile)
    trains_where_loaded = False  # the Trainer keeps a model loaded on this kind there ("auto" would not pick it)
    torch_load_maps = True  # torch.load(map_location=device) works for this kind (XLA's: it does not)
    # how a quantized linear's product is computed here (`models/quantization.py`), said in `doctor` and docs
    int8_linear = "the int8 weight widened to the activations' dtype in the graph, the product, then the row scales"

    def fp8_arithmetic(self, device: torch.device) -> bool:
        """Whether `device` computes in fp8 (e4m3), so that fp8 weights are worth storing there."""
        return False

    # ---- compiling -------------------------------------------------------------------------------
    def compile_defaults(self, compile_backend: str) -> dict:
        """Options a compile backend gets here unless the caller set them."""
        if compile_backend == "inductor":
            # the engine checks its inputs' shapes itself and owns the cache buffers: no per-call asserts
            return {"size_asserts": False, "alignment_asserts": False}
        return {}

    def freezes_weights(self, settings) -> bool:
        """Whether graphs built under `settings` hold the weights as constants (inductor's `freezing`):
        such graphs are stale after any in-place change of a weight."""
        return (
            settings.enabled and settings.backend == "inductor" and bool(dict(settings.options).get("freezing", False))
        )

    def before_compile(self, settings) -> None:
        """What a process needs before its first compile under `settings`: a usable inductor cache folder
        (checked before Dynamo is imported) and the persistent caches."""
        if settings.enabled:
            inductor_cache_dir.usable()
        if settings.enabled and settings.backend not in ("eager", "aot_eager"):
            enable_persistent_cache()

    def compile_one(self, fn, name: str, shape: tuple, settings, precompile: bool = False) -> CompiledFunction:
        self.before_compile(settings)
        return compile_function(
            fn,
            name,
            shape,
            settings.backend,
            settings.mode,
            dict(settings.options),
            settings.fullgraph,
            settings.dynamic,
        )

    def steps_for(self, model, tp: int = 1) -> StepBuilder:
        """This backend's per-model step builder (its own state; the engine holds it)."""
        return StepBuilder(self, model, tp)

    def arrange_weights(self, model, tp: int = 1) -> bool:
        """Lay the model's weights out for this device's steps, before the engine builds any (the CPU copies
        them into one block of huge pages); True if they moved now, so the caller's view of them is stale."""
        return False

    # ---- running ---------------------------------------------------------------------------------
    def flush(self, device: torch.device) -> None:
        """End of one loop step, before its ids are read: on a lazily traced device, run what is queued as
        one graph (so each step's leftovers form the same graph every time); nothing elsewhere."""

    def synchronize(self, device: torch.device) -> None:
        """Wait for the device to finish queued work (timers and benchmarks)."""
        mod = getattr(torch, device.type, None)
        if mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()

    def available_memory(self, device: torch.device) -> Optional[int]:
        """Bytes that can be allocated on `device` now, or None when this kind cannot tell."""
        return None

    def rng_state(self, device: torch.device) -> Optional[torch.Tensor]:
        """The device's own generator state (beside the CPU's), or None when it has none of its own."""
        return None

    def set_rng_state(self, device: torch.device, state: torch.Tensor) -> None:
        pass

    # ---- distributed -----------------------------------------------------------------------------
    def before_process_group(self, device: torch.device) -> None:
        """What must happen before `init_process_group` on this kind (register the c10d backend, set the device)."""

    # ---- training --------------------------------------------------------------------------------
    def training_ops(self, dtype: torch.dtype) -> Ops:
        return PLAIN

    def before_training(self) -> None:
        pass

    def set_tf32(self, enabled: bool) -> None:
        raise ValueError(f"TF32 is a CUDA matmul mode and this is a {self.kind} device")


__all__ = ["Backend", "StepBuilder", "step_name", "cuda_graphs"]
