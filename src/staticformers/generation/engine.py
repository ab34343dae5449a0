"""The generation engine: compiled prefill and decode over the shape plan, host bookkeeping around them.

Design choices (the why of this file):

- **Every shape is declared.** A request is split into sub-batches of at most the largest batch
  bucket; each sub-batch runs at one plan `Entry` (batch bucket B, prompt bucket L, KV length K).
  Prefill is a function of `[B, L]`, decode of `[B, 1]` over a `[B, K]` cache. Each (kind, shape,
  compile settings) gets its own compiled function with its own code object (see `compile.py`), so
  graphs never exceed the plan and PyTorch's recompile limit is never approached. Before a compiled
  function runs, the engine checks its inputs have the declared shape (raise in tests, warn else).
- **One shape, one graph or a few small ones.** On the CPU a shape compiles as regions (`steps.py`):
  one decoder layer that every layer runs, and for decode the embedding and masks; one head per
  batch bucket serves all its shapes. The compiler's work stops growing with depth (a batch-1 decode
  shape of the 8-layer reference model: ~4-6 s instead of ~21 s) and steps run as fast. Elsewhere,
  with weight freezing, for a tensor-parallel or foreign model, or while forward hooks are set (one
  layer graph for every layer cannot carry one layer's hook), a shape is one whole-model graph.
  `CompileConfig(regional=...)` chooses explicitly.
- **Prefill graphs do not depend on the KV length.** They attend over the prompt bucket only and give
  each layer's keys/values, which go into the `[B, K]` static cache. So prefill graphs number
  `len(batch) * len(prompt)`, not times `len(kv)`.
- **Only the last position leaves the last layer.** Logits are wanted at the prompt's last position
  alone, so a regional prefill computes the last layer's keys and values over the prompt and its
  attention and MLP at that position only, through the decode step's own graphs for `[B, K]`
  (`Regions.last_position`): one layer's worth of prompt GEMMs saved (an eighth on the reference
  model), no graph added to the plan. (So a one-token call compiles its shape's decode graphs too.)
  Whole-graph and eager prefills do the same inside the model: `logits_to_keep=1` makes the last
  layer compute its output at the last position only (`DecoderModel.run_layers(keep=...)`).
- **Host bookkeeping, device math.** Generated ids, the stop flags and the output live on the host.
  Per step the device receives `[B, 1]` token ids, `[B, 1]` RoPE positions and a `[1]` slot index;
  the `[B, K]` mask over the cache is sent once per call (future slots are hidden by causality).
  Graphs return the argmax and the last logits; greedy uses the argmax, anything else runs
  `sampling.Sampler` on the device. Only chosen ids come back.
- **Each shape picks its formulation.** Under inductor, batch-1 decode runs every linear as a
  weight-streaming multiply-and-sum reduction (`modeling.project`) and attention as fused reductions
  over the cache (`modeling.attend_decode`: no matmul calls); batches 2-8 keep GEMMs for the linears
  and, in bf16, attend with reductions instead of the CPU SDPA kernel (`decode_formulation`); a
  batch-1 bf16 prefill attends with grouped matmuls, and a batch's prefill shares its decode's head
  (`prefill_formulation`). Float32 GEMMs on the CPU run oneDNN's kernel (`gemm_kernel`). Chosen
  through attributes of the cache object; other backends run the model's plain path.
- **Never stale weights.** Before each call the engine fingerprints the parameters (identity, data
  pointer, dtype, device, version counter) and the module tree. A new identity, dtype or device drops graphs and caches;
  an in-place change (training) drops graphs whose weights were frozen into them (inductor freezing).
- **Bad input loses nothing.** Everything is validated before any device work; caches and graphs are
  only created for shapes the plan declares.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..compile import CompiledFunction, compile_function, shape_violation
from ..kernels import onednn_available
from ..modeling import global_hook_ids, global_hooks, has_decoder_layout, hooked
from .cache import StaticKVCache
from .plan import Entry, ShapePlan
from .steps import Continuation, Regions, head_region, whole_decode, whole_prefill

# the largest batch bucket whose decode uses the reduction formulation (see Engine.cache)
FAST_DECODE_MAX_BATCH = 8
PLAIN = (None, None, None)  # a formulation (attention, linears, head's linear): the model's own path


def gemm_kernel(dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """The GEMM behind a formulation's linears that are not reductions: oneDNN's (`kernels.py`) for
    float32 on the CPU, where this PyTorch's MKL sgemm measured 10-35% slower (BENCHMARKS.md: float32
    prefill of 128 tokens 55 -> 47 ms, batch-8 decode step -10%); the module's own everywhere else
    (bfloat16 already runs oneDNN's)."""
    if (dtype == torch.float32 and torch.device(device).type == "cpu" and onednn_available()
            and torch.backends.mkldnn.enabled):
        return "onednn"
    return None


def decode_formulation(batch: int, dtype: torch.dtype, gemm: Optional[str] = None) -> tuple:
    """(attention, linears, head's linear) for an inductor decode graph; `gemm` is `gemm_kernel(...)`.

    Measured on the 41.6M reference model (BENCHMARKS.md): at batch 1 every linear is a weight-
    streaming reduction ("reduce") and attention fused reductions (no matmul calls). At batch 2-8 the
    linears stay GEMMs: inductor fuses the producing norm or activation into a reduction and
    recomputes it for each weight row (4-6x slower in float32), and the BLAS's bf16 GEMMs beat our
    reductions. Attention there is fused reductions in bf16 (the CPU's SDPA kernel costs ~1.2 ms per
    layer at batch 8 in bf16); float32 batches keep the model's plain attention (reductions measured
    slower, grouped matmuls no clearer gain than the noise). The `lm_head` (32,000 x 512 on the
    reference model) is a reduction in float32 at every batch up to 8 and in bf16 up to batch 2: this
    PyTorch's fp32 GEMM reads that weight at ~5 GB/s with 2-8 rows (12.1-14.2 ms against 2.2-3.6 ms
    for the reduction, head alone, A/B), while its bf16 GEMM wins from batch 4 (2.5 vs 3.4 ms); the
    regional head stores the normalised input once (`steps.head_region`), so nothing is recomputed per
    weight row. Past batch 8 everything is a GEMM."""
    if batch > FAST_DECODE_MAX_BATCH:
        return None, gemm, gemm
    head = "reduce" if dtype == torch.float32 or batch <= 2 else gemm
    if batch == 1:
        return "reduce", "reduce", head
    return (None if dtype == torch.float32 else "reduce"), gemm, head


def prefill_formulation(batch: int, dtype: torch.dtype, gemm: Optional[str] = None) -> tuple:
    """(attention, linears, head's linear) for an inductor prefill graph: GEMMs through `gemm`; grouped
    matmuls for one bf16 prompt's attention (the CPU SDPA kernel with a mask is ~20% slower there),
    SDPA otherwise, where it measured equal or faster; the head (one position per row) as decode's
    at this batch, since the two share it."""
    attention = "matmul" if batch == 1 and dtype != torch.float32 else None
    return attention, gemm, decode_formulation(batch, dtype, gemm)[2]

logger = logging.getLogger("staticformers")


@dataclass(frozen=True)
class CompileSettings:
    """How the engine's graphs are built for one call (part of every graph's key)."""

    enabled: bool = True
    backend: str = "inductor"
    mode: Optional[str] = None
    options: tuple = ()
    fullgraph: bool = True
    dynamic: bool = False
    fast_decode: bool = True  # small-batch decode as weight-streaming reductions (inductor only)
    regional: bool = False  # compile prepare / one layer / head per shape instead of the whole model (steps.py)

    @property
    def freezing(self) -> bool:
        return self.enabled and self.backend == "inductor" and dict(self.options).get("freezing", False)

    @property
    def label(self) -> str:
        return self.backend if self.enabled else "eager (not compiled)"


@dataclass(eq=False)
class Graph:
    """One step function for one shape under one compile setting: compiled or eager."""

    kind: str
    shape: tuple
    settings: CompileSettings
    fn: Callable
    compiled: Optional[Union[CompiledFunction, Regions]]
    calls: int = 0

    def __call__(self, *args, checked: bool = False, into: Optional[Continuation] = None):
        """Run the step; `into` (regional prefill only, see `Regions`): the decode that follows."""
        self.calls += 1
        if self.compiled is None:
            return self.fn(*args)
        if into is not None:
            return self.compiled(*args, checked=checked, into=into)
        return self.compiled(*args, checked=checked)


class _Fingerprint:
    """The parameters' identity (object, data pointer, dtype, device) and version counters, read from the
    modules' own parameter and submodule dicts: a parameter or module replaced, added or removed
    anywhere in the tree (assignment, `del`, `ModuleList.insert`, FSDP's swaps), or a tensor moved or
    converted in place, changes it. The list of modules is walked again only when one of their
    submodule dicts changed (walking the tree through `model.modules()` costs ~0.15 ms a call).

    Forward hooks registered or removed (on a module or globally) change it too: warmed steps run their
    graphs without Dynamo's guards, which would otherwise notice, so a hook added after the first call
    would be skipped silently; graphs are rebuilt with it instead."""

    def __init__(self, model):
        self.model, self.modules, self.children = model, [], None

    def __call__(self) -> tuple:
        children = tuple(id(c) for m in self.modules for c in m._modules.values())
        if children != self.children or not self.modules:
            self.modules = list(self.model.modules())
            children = tuple(id(c) for m in self.modules for c in m._modules.values())
            self.children = children
        params = list({id(p): p for m in self.modules for p in m._parameters.values() if p is not None}.values())
        hooks = tuple((i, tuple(m._forward_hooks), tuple(m._forward_pre_hooks))
                      for i, m in enumerate(self.modules) if m._forward_hooks or m._forward_pre_hooks)
        ident = (children, tuple((id(p), p.data_ptr(), p.dtype, p.device) for p in params), hooks, global_hook_ids())
        return ident, tuple(p._version for p in params)


def plain_projections(model) -> bool:
    """Whether every projection the formulations may compute themselves is a plain `nn.Linear` with no
    hooks: reductions and oneDNN read `weight` and `bias` directly, which would skip what a wrapper
    (LoRA, quantisation) or a forward hook does."""
    if global_hooks():
        return False
    return not any(isinstance(m, torch.nn.Linear) and (type(m) is not torch.nn.Linear or hooked(m))
                   for m in model.modules())


class Engine:
    """One per model: the plan, the static caches per (batch bucket, KV length), the graphs."""

    def __init__(self, model, plan: Optional[ShapePlan] = None):
        self.model = model
        self.plan = (plan or ShapePlan()).bind(model.config.max_position_embeddings)
        self.caches: dict[tuple, StaticKVCache] = {}
        self.graphs: dict[tuple, Graph] = {}
        self.heads: dict[tuple, CompiledFunction] = {}  # regional layout: one head per (batch, formulation, settings)
        self.retired: list[dict] = []  # stats rows of graphs dropped for new weights (the graphs themselves are freed)
        self.forms: dict[tuple, tuple] = {}  # (kind, batch, settings) -> formulation, until the weights change
        self._fingerprint = _Fingerprint(model)
        self._ident, self._versions = self._fingerprint()

    # ---- weights ---------------------------------------------------------------------------------
    def check_weights(self) -> None:
        """Drop whatever could run with stale weights (see the module docstring)."""
        ident, versions = self._fingerprint()
        if ident != self._ident:
            what = ("model weights or modules were replaced (new tensors, dtype, device or layers)"
                    if ident[:2] != self._ident[:2] else "forward hooks were registered or removed")
            logger.info("%s: dropping graphs and caches", what)
            self.reset()
        elif versions != self._versions:
            frozen = [k for k, g in self.graphs.items() if g.settings.freezing]
            if frozen:
                logger.info("weights changed in place: dropping %d graph(s) that froze the old weights", len(frozen))
                for k in frozen:
                    self._retire(self.graphs.pop(k))
        self._ident, self._versions = ident, versions

    def reset(self) -> None:
        """Forget every graph and cache (they are rebuilt on demand)."""
        for g in self.graphs.values():
            self._retire(g)
        for key, head in self.heads.items():
            self.retired.append(self._head_row(key, head, retired=True))
            head.release()
        self.graphs.clear()
        self.heads.clear()
        self.caches.clear()
        self.forms.clear()

    # ---- caches and graphs -------------------------------------------------------------------------
    def cache(self, batch: int, kv: int, settings: CompileSettings) -> StaticKVCache:
        form = self._formulation("decode", batch, settings)
        key = (batch, kv, form)
        cache = self.caches.get(key)
        if cache is None:
            cache = StaticKVCache.for_model(self.model, batch, kv)
            cache.formulate(*form)
            self.caches[key] = cache
        return cache

    def _formulation(self, kind: str, batch: int, settings: CompileSettings) -> tuple:
        """(attention, linears, head's linear) of a `kind` step at this batch under `settings`: the one
        measured fastest (`decode_formulation`, `prefill_formulation`) on inductor, else the model's
        plain path. The formulations read weights directly, bypassing tensor parallel's module hooks
        and any wrapper or hook on a projection (`plain_projections`), so not there. With freezing,
        GEMMs stay `F.linear`: inductor then packs the frozen weights for oneDNN itself, which an
        opaque operator would prevent."""
        key = (kind, batch, settings)
        form = self.forms.get(key)
        if form is None:
            if not self._fast(settings) or self._tensor_parallel() or not plain_projections(self.model):
                form = PLAIN
            else:
                chooser = decode_formulation if kind == "decode" else prefill_formulation
                gemm = None if settings.freezing else gemm_kernel(self.model.dtype, self.model.device)
                form = chooser(batch, self.model.dtype, gemm)
            self.forms[key] = form  # once per shape: `plain_projections` walks the module tree
        return form

    def _tensor_parallel(self) -> bool:
        return getattr(getattr(self.model, "parallel_dims", None), "tp", 1) > 1

    def regional(self, settings: CompileSettings) -> bool:
        """Whether graphs under `settings` are compiled as regions (`steps.py`): asked for, and the model
        is our decoder, unsharded, its weights are not frozen into graphs (a layer graph that every
        layer shares must take its weights as inputs) and no forward hook is set (a hook on one layer
        cannot be in a graph every layer runs, and a prefill's last layer would show hooks one
        position). Hooks registered or removed later rebuild the graphs (`_Fingerprint`)."""
        return (settings.enabled and settings.regional and not settings.freezing
                and has_decoder_layout(self.model) and not self._tensor_parallel()
                and not global_hooks() and not any(hooked(m) for m in self.model.modules()))

    @staticmethod
    def _fast(settings: CompileSettings) -> bool:
        return settings.enabled and settings.backend == "inductor" and settings.fast_decode

    def graph(self, kind: str, batch: int, dim: int, settings: CompileSettings) -> Graph:
        key = (kind, batch, dim, settings)
        g = self.graphs.get(key)
        if g is not None:
            return g
        cache = None
        form = self._formulation(kind, batch, settings)
        head_linear = form[2]  # the same for a batch's prefill and decode: they share the head
        if kind == "prefill":
            fn, shape = whole_prefill(self.model, dim, form), (batch, dim)
        else:
            cache = self.cache(batch, dim, settings)
            fn, shape = whole_decode(self.model, cache), (batch, 1, dim)
        compiled = None
        if settings.enabled:
            name = f"{kind}_b{batch}_{'l' if kind == 'prefill' else 'kv'}{dim}_{settings.backend}"

            regional = self.regional(settings)

            def compile_one(f: Callable, label: str, at: tuple = shape) -> CompiledFunction:
                return compile_function(f, label, at, settings.backend, settings.mode, dict(settings.options),
                                        settings.fullgraph, settings.dynamic, precompile=regional)

            if regional:
                head_key = (batch, head_linear, settings)
                if head_key not in self.heads:
                    label = f"head_b{batch}{'_' + head_linear if head_linear else ''}_{settings.backend}"
                    self.heads[head_key] = compile_one(head_region, label, (batch, 1))
                compiled = Regions(kind, self.model, name, compile_one, self.heads[head_key], head_linear,
                                   cache=cache, length=dim, prefill_form=form)
            else:
                compiled = compile_one(fn, name)
        g = Graph(kind, shape, settings, fn, compiled)
        self.graphs[key] = g
        return g

    # ---- running one sub-batch ---------------------------------------------------------------------
    def prefill(self, entry: Entry, ids: torch.Tensor, mask: torch.Tensor, settings: CompileSettings):
        """Run the prompt (host `[b, s]`, left-aligned to the bucket).

        Returns (argmax ids, last logits) on the device, `fill_cache` (a call that puts the prompt's
        keys and values into the entry's static cache and returns it; the caller makes it before the
        first decode step), the host mask over the cache and each row's next RoPE position. Regional
        prefills write each layer's keys and values into the cache as the layer finishes (the
        prompt's keys and values never exist twice) and finish the last position with the decode's
        regions (module docstring); a whole-graph prefill returns them all and `fill_cache` copies
        them, after the first token is out.
        """
        b, s = ids.shape
        B, L, K = entry.batch, entry.prompt, entry.kv
        device = self.model.device
        x = torch.zeros(B, L, dtype=torch.long)
        m = torch.zeros(B, L, dtype=torch.bool)
        x[:b, L - s:] = ids
        m[:b, L - s:] = mask
        pos = (m.long().cumsum(-1) - 1).clamp(min=0)
        full = torch.zeros(B, K, dtype=torch.bool)
        full[:, :L] = m
        full[:b, L:] = True
        g = self.graph("prefill", B, L, settings)
        checked = self._check(g, (B, L), x)
        inputs = (x.to(device), pos.to(device), m.to(device))
        if isinstance(g.compiled, Regions):
            # the last layer's attention and MLP run at the last position alone, as the decode step does
            decode = self.graph("decode", B, K, settings).compiled
            cache = decode.cache
            last = (x[:, -1:].clone(memory_format=torch.contiguous_format).to(device),
                    pos[:, -1:].clone(memory_format=torch.contiguous_format).to(device), full.to(device),
                    torch.tensor([L - 1], dtype=torch.long).to(device))  # the decode's (canonical) strides
            argmax, logits = g(*inputs, checked=checked, into=Continuation(decode, last))

            def fill_cache() -> StaticKVCache:
                return cache
        else:
            argmax, logits, keys, values = g(*inputs, checked=checked)
            produced = [_Collected(keys, values)]  # dropped once copied: the decode must not keep it
            del keys, values

            def fill_cache() -> StaticKVCache:
                filled = self.cache(B, K, settings)
                if produced:
                    filled.load_prefill(produced.pop())
                return filled

        next_pos = m.long().sum(-1)
        return argmax, logits, fill_cache, full, next_pos

    def decode(self, entry: Entry, tokens: torch.Tensor, positions: torch.Tensor, mask_dev: torch.Tensor,
               slot: torch.Tensor, settings: CompileSettings):
        g = self.graph("decode", entry.batch, entry.kv, settings)
        checked = self._check(g, (entry.batch, 1), tokens)
        return g(tokens, positions, mask_dev, slot, checked=checked)

    @staticmethod
    def _check(g: Graph, expected: tuple, x: torch.Tensor) -> bool:
        """Whether `x` has the graph's declared shape (a violation raises in strict mode, warns else)."""
        if tuple(x.shape) != expected:
            shape_violation(f"{g.kind} graph {g.shape} was handed inputs of shape {tuple(x.shape)}, outside the plan.")
            return False
        return True

    # ---- ahead of time ------------------------------------------------------------------------------
    @staticmethod
    def _cache_answers() -> int:
        """Graphs the on-disk caches answered so far: inductor's FX-graph cache, precompiled artifacts."""
        from torch._dynamo.utils import counters

        return counters["inductor"]["fxgraph_cache_hit"] + counters["staticformers"]["artifacts_loaded"]

    def precompile(self, settings: CompileSettings, plan: Optional[ShapePlan] = None, progress=None) -> list[dict]:
        """Compile (or load from the on-disk cache) every graph of the plan; one row per graph.

        Each row: kind, shape, seconds (first call: trace + compile or cache load), cache hit (inductor's
        FX-graph cache or a precompiled artifact answered), graphs compiled (a batch bucket's shared head
        counts with its first shape).
        """
        plan = plan or self.plan
        device = self.model.device
        rows = []
        jobs = [("prefill", b, n) for b, n in plan.prefill_shapes()] + [("decode", b, k) for b, k in plan.decode_shapes()]
        with torch.no_grad():
            for kind, b, n in jobs:
                hits, before = self._cache_answers(), self._graph_count()
                start = time.perf_counter()
                g = self.graph(kind, b, n, settings)
                ids = torch.zeros(b, n if kind == "prefill" else 1, dtype=torch.long, device=device)
                if kind == "prefill":
                    g(ids, torch.zeros_like(ids), torch.ones(b, n, dtype=torch.bool, device=device))
                else:
                    g(ids, torch.zeros_like(ids), torch.ones(b, n, dtype=torch.bool, device=device),
                      torch.zeros(1, dtype=torch.long, device=device))
                g.calls -= 1  # a warm-up, not a use
                row = {"kind": kind, "shape": list(g.shape), "seconds": round(time.perf_counter() - start, 2),
                       "cache_hit": self._cache_answers() > hits,
                       "graphs": self._graph_count() - before}  # with a shared head compiled on the way
                rows.append(row)
                if progress is not None:
                    progress(row)
        return rows

    # ---- reporting ---------------------------------------------------------------------------------
    def _graph_count(self) -> int:
        return sum(g.compiled.graphs for g in self.graphs.values() if g.compiled is not None) + \
            sum(h.graphs for h in self.heads.values())

    def _retire(self, g: Graph) -> None:
        """Keep the graph's stats row; free its compiled code, which holds a KV cache and weights."""
        self.retired.append(self._row(g, retired=True))
        if g.compiled is not None:
            g.compiled.release()
        g.fn = g.compiled = None

    def stats(self) -> list[dict]:
        """One row per step function (its own graphs), one per shared head, and the retired ones."""
        return ([self._row(g) for g in self.graphs.values()]
                + [self._head_row(k, h) for k, h in self.heads.items()] + list(self.retired))

    def _head_row(self, key: tuple, head: CompiledFunction, retired: bool = False) -> dict:
        users = [g for g in self.graphs.values() if isinstance(g.compiled, Regions) and g.compiled.head is head]
        return {"kind": "head", "shape": list(head.shape), "backend": key[2].label, "graphs": head.graphs,
                "functions": 1, "compile_seconds": round(head.compile_seconds, 3),
                "first_call_seconds": round(head.first_call_seconds, 3), "calls": sum(g.calls for g in users),
                "retired": retired}

    @staticmethod
    def _row(g: Graph, retired: bool = False) -> dict:
        c = g.compiled
        return {
            "kind": g.kind,
            "shape": list(g.shape),
            "backend": g.settings.label,
            "graphs": c.graphs if c is not None else 0,
            "functions": (len(c.own) if isinstance(c, Regions) else 1) if c is not None else 0,
            "compile_seconds": round(c.compile_seconds, 3) if c is not None else 0.0,
            "first_call_seconds": round(c.first_call_seconds, 3) if c is not None else 0.0,
            "calls": g.calls,
            "retired": retired,
        }


@dataclass
class _Collected:
    keys: tuple
    values: tuple


def now() -> float:
    return time.perf_counter()
