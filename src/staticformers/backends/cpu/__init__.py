"""Everything tuned for running on the CPU under inductor, behind one `Backend` (`backends.for_device`).

Nothing outside `staticformers.backends` imports this package, so CUDA and Neuron never load it. It
holds the formulations measured fastest per shape (`formulations.py`: weight-streaming reductions, oneDNN's
float32 GEMM in `onednn.py`, grouped and blocked attention), the generation steps as per-layer regions
(`compilation/regions.py`) run without Dynamo once warm (`regions.py`), compiled functions saved whole
between processes and run without guard evaluation once warm (`compiled.py`, `precompiled.py`),
inductor's instruction-set probes remembered across processes (`isa_probes.py`), the host-memory
setting of a training process (`host_memory.py`), the kernels' thread count (`threads.py`, applied
when the backend is made) and the weights' one block of huge pages (`weight_arena.py`, made before a model's
first step); the C++ kernels' one library starts building in a thread when the first generation step under inductor is
made (`kernel_library.py`). Every choice is measured in BENCHMARKS.md.
"""

from __future__ import annotations

import os

import torch

from ...adapters.bank import bank_of
from ...compilation.compiler import cache_root
from ...compilation.regions import ScoreRegions, has_decoder_layout, head_region, kept_head_region
from ...models.hooks import any_hooked, global_hooks, hooked
from ..base import Backend, StepBuilder, host_available_memory, step_name
from .compiled import CPUCompiledFunction, compile_region
from .host_memory import keep_freed_host_memory
from .isa_probes import RECORD, remember_isa_probes
from .kernel_library import build_ahead
from ...models.block_kv_cache import BlockKVCache
from ...models.quantization import QuantLinear
from .formulations import PLAIN_CPU, CPUOps, decode_formulation, gemm_kernel, prefill_formulation
from .regions import RegionalDecode, RegionalExtend, RegionalPrefill
from .thresholds import threshold
from .threads import apply_thread_choice
from . import weight_arena


def plain_projections(model) -> bool:
    """Whether every projection a formulation may compute itself is a plain `nn.Linear` with no hooks:
    reductions and oneDNN read `weight` and `bias` directly, which would skip what a Linear subclass or a
    forward hook does. The one subclass they know is a quantized projection (`QuantLinear`: the
    formulations compute it through the CPU's int8 kernel). A LoRA layer is no Linear: its `base_layer` is,
    which the formulations compute, the layer adding its adapters (`ops.project`)."""
    if global_hooks():
        return False
    return not any(
        isinstance(m, torch.nn.Linear) and (type(m) not in (torch.nn.Linear, QuantLinear) or hooked(m))
        for m in model.modules()
    )


class CPUStepBuilder(StepBuilder):
    """One model's steps on the CPU: per-layer regions where they apply (`regions.py`), the formulation
    measured fastest per shape, and the head regions every KV length of a batch bucket shares (`shared`)."""

    def __init__(self, backend: "CPUBackend", model, tp: int = 1):
        super().__init__(backend, model, tp)
        self.memo: dict = {}  # the formulation per (kind, batch, settings), until the weights change

    def reset(self) -> None:
        super().reset()
        self.memo.clear()

    def ops(self, kind: str, batch: int, settings, blocks: bool = False) -> CPUOps:
        """The formulation measured fastest for this step under inductor; the modules' own path (with
        query-blocked attention) otherwise, and wherever the formulations would bypass something:
        tensor parallel's module hooks, wrappers or hooks on a projection (`plain_projections`). With
        freezing, GEMMs stay `F.linear`: inductor then packs the frozen weights for oneDNN itself."""
        key = (kind, batch, settings, blocks)
        ops = self.memo.get(key)
        if ops is None:
            model = self.model
            fast = settings.enabled and settings.backend == "inductor" and settings.fast_decode
            if not fast or self.tp > 1 or not plain_projections(model):
                ops = PLAIN_CPU
            else:
                frozen = self.backend.freezes_weights(settings)
                gemm = None if frozen else gemm_kernel(model.dtype)
                if kind == "decode":
                    ops = decode_formulation(batch, model.dtype, gemm, blocks)
                else:
                    ops = prefill_formulation(batch, model.dtype, gemm)
            self.memo[key] = ops  # once per shape: `plain_projections` walks the module tree
        return ops

    def regional(self, settings) -> bool:
        """Whether steps under `settings` are regions: asked for, and the model is our decoder, unsharded,
        its weights not frozen into graphs (a layer graph every layer shares takes weights as inputs) and
        no forward hook set (a hook on one layer cannot be in a graph every layer runs), and no adapter bank
        (a regional prefill finishes its prompts with the decode step's regions, whose rows are the cache's
        slots, not the prompts: one rows index cannot route both). Hooks registered or removed later, and
        a bank made later, rebuild the steps (the engine's fingerprint)."""
        model = self.model
        return (
            settings.enabled
            and settings.regional
            and not self.backend.freezes_weights(settings)
            and has_decoder_layout(model)
            and self.tp == 1
            and not any_hooked(model)
            and bank_of(model) is None
        )

    def build(self, kind: str, batch: int, dim: int, settings, context):
        if settings.enabled and settings.backend == "inductor":  # a generation step: its kernels' C++ compiles
            self.backend.before_compile(settings)  # while it is traced (training's steps do not call them)
            build_ahead()
        if not self.regional(settings):
            return super().build(kind, batch, dim, settings, context)
        cache = context.cache(batch, dim) if kind == "decode" else None
        ops = self.ops(kind, batch, settings, isinstance(cache, BlockKVCache))
        name = step_name(kind, batch, dim, settings)
        backend = self.backend

        if kind == "extend":
            return self._extend(batch, dim, settings, context, ops, name)

        def compile_one(fn, label):
            return backend.compile_one(fn, label, (batch, 1 if kind == "decode" else dim), settings, precompile=True)

        if kind == "prefill":

            def decode_for(cache):  # the decode step of the cache a prefill fills finishes its last tokens
                return context.decode_step(cache.batch, cache.max_length, settings)

            return RegionalPrefill(self.model, dim, name, compile_one, ops, decode_for)
        if kind == "score":
            return ScoreRegions(self.model, dim, name, compile_one, ops)
        head_key = ("head", batch, ops.head_linear, settings)
        if head_key not in self.shared:  # one per batch bucket and head formulation: every KV length shares it
            label = f"head_b{batch}{'_' + ops.head_linear if ops.head_linear else ''}_{settings.backend}"
            self.shared[head_key] = backend.compile_one(head_region, label, (batch, 1), settings, precompile=True)
        return RegionalDecode(
            self.model,
            cache,
            name,
            compile_one,
            self.shared[head_key],
            CPUOps(None, None, ops.head_linear),
            ops,
        )

    def _extend(self, batch: int, dim: tuple, settings, context, ops: CPUOps, name: str) -> RegionalExtend:
        """An extend step `[batch, T]` over the `[batch, K]` cache keeping `n` positions (`dim` = `(K, T, n)`) as
        regions: its own `prepare` and layer regions, and a kept-position head that every K shares."""
        kv, tokens, kept = dim
        backend = self.backend
        # the head is a GEMM like the step's linears: over several kept rows a reduction per weight row
        # (decode's head at small batches) is slower than the GEMM (BENCHMARKS.md, speculative decoding)
        head = ops.linears

        def compile_one(fn, label):
            return backend.compile_one(fn, label, (batch, tokens), settings, precompile=True)

        head_key = ("extend_head", batch, tokens, kept, head, settings)
        if head_key not in self.shared:
            label = f"extend_head_b{batch}_t{tokens}_n{kept}{'_' + head if head else ''}_{settings.backend}"
            self.shared[head_key] = compile_one(kept_head_region, label)
        return RegionalExtend(
            self.model,
            context.cache(batch, kv),
            name,
            compile_one,
            self.shared[head_key],
            CPUOps(None, None, head),
            ops,
        )


class CPUBackend(Backend):
    """The CPU's answers (see the module docstring and `backends.base.Backend`)."""

    name = kind = "cpu"
    regional_by_default = True
    per_rank_device = False
    hosts_memory = fused_optimizer = True
    int8_linear = (
        "one decode row (`int8_gemv_max_rows`): a streaming C++ kernel built with inductor's toolchain "
        "(`gemv.py`), several projections of one input in one call; a few rows (up to "
        "`int8_kernel_max_rows`): ATen's weight-only int8 kernel (`_weight_int8pack_mm`), in bf16 for "
        "float32 activations (`formulations.int8_linear`); a prompt's rows, and a gradient wanted (an "
        "adapter training over it), through the int8 weight widened in the graph, then the GEMM"
    )

    def __init__(self):
        super().__init__()
        self.threads = apply_thread_choice()  # before any saved function is looked up: they are keyed by it

    def compile_defaults(self, compile_backend: str) -> dict:
        if compile_backend != "inductor":
            return {}
        # realize a pointwise result read by two or more consumers (inductor's default: more than four):
        # otherwise the RMSNorm before q/k/v and before gate/up is recomputed inside each weight-streaming
        # reduction, for every weight row (BENCHMARKS.md)
        return {
            **super().compile_defaults(compile_backend),
            "realize_reads_threshold": threshold("realize_reads_threshold"),
        }

    def steps_for(self, model, tp: int = 1) -> CPUStepBuilder:
        return CPUStepBuilder(self, model, tp)

    def arrange_weights(self, model, tp: int = 1) -> bool:
        if tp > 1:  # a rank's shards are DTensors, laid out by their own parallel plan
            return False
        return weight_arena.arrange_weights(model, host_available_memory())

    def training_ops(self, dtype: torch.dtype) -> CPUOps:
        return PLAIN_CPU  # causal bf16 attention in query blocks

    def before_training(self) -> None:
        keep_freed_host_memory()

    def before_compile(self, settings) -> None:
        super().before_compile(settings)
        if settings.backend == "inductor":
            remember_isa_probes(lambda: os.path.join(cache_root(), RECORD))

    def compile_one(self, fn, name: str, shape: tuple, settings, precompile: bool = False) -> CPUCompiledFunction:
        self.before_compile(settings)
        return compile_region(
            fn,
            name,
            shape,
            settings.backend,
            settings.mode,
            dict(settings.options),
            settings.fullgraph,
            settings.dynamic,
            precompile,
        )

    # ---- the host ----------------------------------------------------------------------------------
    def synchronize(self, device: torch.device) -> None:
        pass  # CPU kernels have returned when the call returns

    def available_memory(self, device: torch.device):
        return host_available_memory()


__all__ = ["CPUBackend", "CPUStepBuilder", "plain_projections"]
