"""The generation engine: compiled prefill and decode steps over the shape plan, and the static caches.

Design choices (the why of this file):

- **Every shape is declared.** Prefill is a function of `[B, L]` (batch bucket, prompt bucket), decode
  of `[B, 1]` over a `[B, K]` cache (K a KV length of the plan). Each (kind, shape, compile settings)
  gets its own step function with its own code objects (`compilation/compiler.py`), built by the device's backend
  (`staticformers.backends`, called through `device_interface.py`): whole-model graphs by default,
  per-layer regions on the CPU. Before a
  step runs, the engine checks its inputs have the declared shape (raise in tests, warn else).
- **Rows are slots.** A prompt is prefilled into rows (slots) of a `[B, K]` cache, the prompt at
  positions `0..n-1`, while the other rows keep their state (`prefill(..., cache, slots)`); a decode
  step takes one token and one position per row, the cache is written at each row's position and the
  mask is built from the positions on the device (`models/kv_cache.py`, `models/decoder.py`). The host sends
  `[B, 1]` token ids, `[B, 1]` positions and the slot indices of an insert, nothing that grows.
- **Several tokens per row over the cache: extend.** A step of the plan's extend widths (`plan.py`) runs
  `[B, T]` tokens, each row at its own positions over the `[B, K]` cache like decode, and returns the
  logits at `n` kept positions per row (`extend`): what speculative decoding verifies and a long prompt
  is prefilled by, in chunks. Its graphs are declared by the plan and compiled ahead like the others.
- **Prompt scores come from the prefill.** A prefill asked to score its prompts (`scores=True`) runs the
  step kind `"score"` of the same `[B, L]` shape instead: the same prefill, with the head over every
  position and the prompt's log-probabilities and top tokens as fixed-shape outputs
  (`compilation/prompt_scores.py`); not a second pass. Its graphs are built when first asked for, or
  by `precompile(..., scores=True)`.
- **Prefill graphs do not depend on the KV length.** They attend over the prompt bucket only and
  return each row's logits at its last token and every layer's keys/values, which are inserted into
  the cache rows: prefill graphs number `len(batch) * len(prompt)`, not times `len(kv)`.
- **The engine owns the caches, one per (B, K).** A step's graph may hold its cache (CUDA graphs
  need fixed addresses), so caches are allocated once per shape and reused; the generation loop
  (`loop.py`) borrows them, one loop at a time (`lock`): calls from several threads on one model are
  serialised, never interleaved.
- **Never stale weights.** Before each call the engine fingerprints the parameters (identity, data
  pointer, dtype, device, version counter), the module tree, the forward hooks and the adapters'
  state (active, disabled, scales, the adapter bank). A new identity, dtype, device, hook or adapter
  state drops steps and caches; an in-place change (training, an adapter loaded over another of the
  same shapes) drops only steps whose weights were frozen into them (inductor freezing).
- **Adapters per row.** With an adapter bank (`adapters/bank.py`) each call says which adapter each
  row uses (`adapters`: bank slots); the engine writes them into the bank's rows index, in place,
  around the step: a graph input, so mixing adapters compiles nothing.
- **Bad input loses nothing.** Requests are validated before any device work (`loop.py`); caches and
  steps are only created for shapes the plan declares.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..adapters.bank import routed
from ..adapters.lora import adapter_state
from ..backends import for_device
from ..compilation.compiler import CompiledFunction, shape_violation
from ..backends.memory_check import check_fits
from ..compilation.summary import cache_answers
from ..models.hooks import forward_hook_state
from ..models.block_kv_cache import BlockKVCache, KVBlocks
from ..models.kv_cache import KVCache
from ..models.linear_attention import GatedDeltaNet
from .plan import ShapePlan
from ..compilation.steps import Step
from .device_interface import DeviceBackend, StepBuilder

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
    fast_decode: bool = True  # let the backend choose faster formulations per shape
    regional: bool = False  # compile per-layer regions instead of the whole model (the backend's)

    @property
    def label(self) -> str:
        return self.backend if self.enabled else "eager (not compiled)"


@dataclass(eq=False)
class Graph:
    """One step of one shape under one compile setting, and how often it ran."""

    kind: str
    shape: tuple
    settings: CompileSettings
    step: Optional[Step]
    calls: int = 0


class _Fingerprint:
    """The parameters' identity (object, data pointer, dtype, device) and version counters, read from the
    modules' own parameter and submodule dicts: a parameter or module replaced, added or removed
    anywhere in the tree (assignment, `del`, `ModuleList.insert`, FSDP's swaps), or a tensor moved or
    converted in place, changes it. The list of modules is walked again only when one of their
    submodule dicts changed. Forward hooks registered or removed (on a module or globally) change it
    too: a compiled step would otherwise skip a hook added after it was built."""

    def __init__(self, model):
        self.model, self.modules, self.children = model, [], None

    def __call__(self) -> tuple:
        children = tuple(id(c) for m in self.modules for c in m._modules.values())
        if children != self.children or not self.modules:
            self.modules = list(self.model.modules())
            children = tuple(id(c) for m in self.modules for c in m._modules.values())
            self.children = children
        params = list({id(p): p for m in self.modules for p in m._parameters.values() if p is not None}.values())
        ident = (
            children,
            tuple((id(p), p.data_ptr(), p.dtype, p.device) for p in params),
            forward_hook_state(self.modules),
            adapter_state(self.modules),
        )
        return ident, tuple(p._version for p in params)


class _Context:
    """The engine's side of the step interface (`device_interface.StepContext`): its caches and steps."""

    def __init__(self, engine: "Engine"):
        self._engine = engine

    def cache(self, batch: int, kv: int) -> KVCache:
        return self._engine.cache(batch, kv)

    def decode_step(self, batch: int, kv: int, settings) -> Step:
        return self._engine.step("decode", batch, kv, settings).step


def verify_width(config, plan: ShapePlan) -> int:
    """The widest verification step of `plan` (an extend width keeping every position) whose linear-attention
    states a hybrid model's caches keep per position; 0 for a model without such layers or a plan without one."""
    if not getattr(config, "has_linear_attention", False):
        return 0
    return max((t for t, n in plan.extend_widths if t == n and t > 1), default=0)


class Engine:
    """One per model: the plan, the static caches per (batch bucket, KV length), the steps.

    `tp` is the tensor-parallel degree the model is partitioned with (a rank's cache holds its share of
    the KV heads); the device's backend (`backends.for_device`) builds the steps through the interface of
    `device_interface.py` and keeps its own per-model state (`self.steps`)."""

    def __init__(self, model, plan: Optional[ShapePlan] = None, tp: int = 1):
        self.model, self.tp = model, int(tp)
        self.plan = (plan or ShapePlan()).bind(model.config.max_position_embeddings)
        self.backend: DeviceBackend = for_device(model.device)
        self.backend.arrange_weights(model, self.tp)  # before the fingerprint: it reads where the weights are
        self.steps: StepBuilder = self.backend.steps_for(model, self.tp)
        self._context = _Context(self)
        self.caches: dict[tuple, KVCache] = {}
        self.block_spec: Optional[tuple] = None  # (blocks, block size, window group) while a loop runs on block caches
        self.pools: dict[tuple, KVBlocks] = {}  # each block spec's pool, made with its first cache (`use_blocks`)
        self.rollback = 0  # the widest verification whose linear-attention states the caches keep per position
        self.graphs: dict[tuple, Graph] = {}
        self.retired: list[dict] = []  # stats rows of steps dropped for new weights (the steps themselves are freed)
        self.lock = threading.RLock()  # held by the generation loop that uses the caches
        self._fingerprint = _Fingerprint(model)
        self._ident, self._versions = self._fingerprint()
        self.follow(self.plan)

    # ---- weights ---------------------------------------------------------------------------------
    def check_weights(self) -> None:
        """Drop whatever could run with stale weights (see the module docstring)."""
        ident, versions = self._fingerprint()
        if ident != self._ident:
            what = (
                "model weights or modules were replaced (new tensors, dtype, device or layers)"
                if ident[:2] != self._ident[:2]
                else "forward hooks were registered or removed"
                if ident[2] != self._ident[2]
                else "adapters were switched, enabled, disabled or batched"
            )
            logger.info("%s: dropping graphs and caches", what)
            self.reset()
            self.backend = for_device(self.model.device)
            self.steps = self.backend.steps_for(self.model, self.tp)
            if self.backend.arrange_weights(self.model, self.tp):
                ident, versions = self._fingerprint()
        elif versions != self._versions:
            frozen = [k for k, g in self.graphs.items() if self.backend.freezes_weights(g.settings)]
            if frozen:
                logger.info("weights changed in place: dropping %d graph(s) that froze the old weights", len(frozen))
                for k in frozen:
                    self._retire(self.graphs.pop(k))
        self._ident, self._versions = ident, versions

    def weights_fingerprint(self) -> tuple:
        """The weights' identity and version counters now (`_Fingerprint`): equal while nothing changed them."""
        return self._fingerprint()

    def reset(self) -> None:
        """Forget every step and cache (they are rebuilt on demand)."""
        for g in self.graphs.values():
            self._retire(g)
        for key, f in self.steps.shared.items():
            self.retired.append(self._shared_row(key, f, retired=True))
            f.release()
        self.graphs.clear()
        self.caches.clear()
        self.pools.clear()
        self.steps.reset()

    # ---- caches and steps --------------------------------------------------------------------------
    def follow(self, plan: ShapePlan) -> None:
        """What `plan` asks of a hybrid model beyond shapes: its caches keep the linear-attention states per
        position for the plan's verification widths (`models/state_rollback.py`), and its linear-attention layers
        run their chunked form `plan.linear_chunk` tokens at a time. Caches and steps made otherwise are dropped
        (rebuilt on demand): what a plan without speculation, then one with it, costs once."""
        width = verify_width(self.model.config, plan)
        layers = [m for m in self.model.modules() if isinstance(m, GatedDeltaNet)]
        chunk = plan.linear_chunk
        if width > self.rollback or any(m.chunk_size != chunk for m in layers):
            if self.caches or self.graphs:
                logger.info("a hybrid's plan changed its states or its chunk: dropping graphs and caches")
                self.reset()
            self.rollback = max(width, self.rollback)
            for m in layers:
                m.chunk_size = chunk

    def use_blocks(self, blocks: Optional[int], block_size: int = 32, window: Optional[tuple] = None) -> None:
        """Run the next steps on block caches over one pool of `blocks` blocks of `block_size` positions
        (`models/block_kv_cache.py`; `window`: (the window layers, their blocks) where those are a group of their
        own), or (None) on static caches. Caches and steps of each kind are kept apart (their keys hold the spec), so
        a loop of one kind after a loop of the other compiles nothing it compiled before. A pool's memory is checked
        the first time its spec is asked for and allocated with its first cache."""
        wanted = None
        if blocks is not None:
            wanted = (int(blocks), int(block_size), (tuple(window[0]), int(window[1])) if window is not None else None)
        if wanted is not None and wanted not in self.pools and wanted != self.block_spec:
            check_fits(
                KVBlocks.bytes_for(self.model, wanted[0], wanted[1], self.tp, wanted[2]),
                self.model.device,
                f"The KV block pool ({wanted[0]} blocks x {wanted[1]} positions)",
                "lower the number of KV blocks or the memory budget",
            )
        self.block_spec = wanted

    @property
    def blocks(self) -> Optional[KVBlocks]:
        """The pool of the current block spec (None on static caches, or before its first cache)."""
        return self.pools.get(self.block_spec) if self.block_spec is not None else None

    def cache(self, batch: int, kv: int) -> KVCache:
        cache = self.caches.get((batch, kv, self.block_spec))
        if cache is None and self.block_spec is not None:
            pool = self.pools.get(self.block_spec)
            if pool is None:
                blocks, size, window = self.block_spec
                pool = self.pools[self.block_spec] = KVBlocks.for_model(self.model, blocks, size, self.tp, window)
            cache = self.caches[(batch, kv, self.block_spec)] = BlockKVCache(pool, batch, kv)
            self.backend.flush(self.model.device)
        if cache is None:
            check_fits(
                KVCache.bytes_for(self.model, batch, kv, self.tp, self.rollback),
                self.model.device,
                f"The KV cache ({batch} sequences x {kv} positions)",
                "lower max_model_len or the batch buckets",
            )
            cache = self.caches[(batch, kv, None)] = KVCache.for_model(self.model, batch, kv, self.tp, self.rollback)
            self.backend.flush(self.model.device)  # allocated now on a lazily traced device, not inside a step
        return cache

    def step(self, kind: str, batch: int, dim, settings: CompileSettings) -> Graph:
        """The step of `kind` for `[batch, dim]` (prefill: dim = prompt bucket; decode: the KV length;
        extend: `(K, T, n)`, the KV length, tokens per row and kept positions)."""
        key = (kind, batch, dim, settings, self.block_spec)
        g = self.graphs.get(key)
        if g is None:
            step = self.steps.build(kind, batch, dim, settings, self._context)
            shape = (
                (batch, 1, dim)
                if kind == "decode"
                else (batch, dim[1], dim[0], dim[2])
                if kind == "extend"
                else (batch, dim)
            )
            g = self.graphs[key] = Graph(kind, shape, settings, step)
        return g

    # ---- running -------------------------------------------------------------------------------------
    def prefill(
        self,
        settings: CompileSettings,
        prompts: Sequence[Sequence[int]],
        cache: KVCache,
        slots: Sequence[int],
        plan: Optional[ShapePlan] = None,
        adapters: Optional[Sequence[int]] = None,
        scores: bool = False,
    ) -> tuple:
        """Prefill `prompts` (host token lists) into the rows `slots` of `cache`; the other rows keep their
        state. Returns the argmax and the logits at each prompt's last token, `[n]` and `[n, vocab]`, on the
        device. The buckets are `plan`'s (default: the engine's). `adapters`: each prompt's slot in the
        model's adapter bank (`adapters/bank.py`; None: the model as it is). `scores`: run the scoring
        prefill and return a third item, the prompts' `(token_logprobs [n, L], top_logprobs [n, L, TOP],
        top_ids [n, L, TOP])` (`compilation/prompt_scores.py`)."""
        plan = plan or self.plan
        n = len(prompts)
        longest = max(len(p) for p in prompts)
        b, length = plan.batch_bucket(n), plan.prompt_bucket(longest)
        if b > cache.batch:
            raise ValueError(f"{n} prompts cannot go into a cache of {cache.batch} rows.")
        ids = torch.zeros(b, length, dtype=torch.long)
        last = torch.zeros(b, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)
            last[i] = len(p) - 1
        g = self.step("score" if scores else "prefill", b, length, settings)
        checked = self._check(g, (b, length), ids)
        device = self.model.device
        g.calls += 1
        with routed(self.model, adapters, b, refresh=True):
            out = g.step(
                ids.to(device),
                last.to(device),
                cache,
                torch.tensor(list(slots), dtype=torch.long).to(device),
                checked=checked,
            )
        if scores:
            argmax, logits, scored = out
            return argmax[:n], logits[:n], tuple(t[:n] for t in scored)
        argmax, logits = out
        return argmax[:n], logits[:n]

    def decode(
        self,
        settings: CompileSettings,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        adapters: Optional[Sequence[int]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step over every row of `cache`: `tokens` and `positions` `[B, 1]` on the device;
        `adapters`: each row's adapter slot (as `prefill`'s)."""
        g = self.step("decode", cache.batch, cache.max_length, settings)
        checked = self._check(g, (cache.batch, 1), tokens)
        g.calls += 1
        with routed(self.model, adapters, cache.batch):
            return g.step(tokens, positions, checked=checked)

    def extend(
        self,
        settings: CompileSettings,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        keep: torch.Tensor,
        adapters: Optional[Sequence[int]] = None,
        plan: Optional[ShapePlan] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`T` tokens per row over every row of `cache`: `tokens` and `positions` `[B, T]`, `keep` `[B, n]`
        (indices into `0..T-1`), on the device; `adapters` as `prefill`'s. Every row's keys and values
        are written at its positions: a row with nothing to add is given positions at or after its
        length (a row writes a position before it attends to it, so what lands there is never read).
        Returns the argmax and logits at the kept positions, `[B, n]` and `[B, n, vocab]`. The width
        `(T, n)` must be one of the extend widths of `plan` (default: the engine's)."""
        plan = plan or self.plan
        t, n = tokens.shape[-1], keep.shape[-1]
        if (t, n) not in plan.widths_at(cache.batch):
            shape_violation(
                f"An extend step of {t} tokens keeping {n} is not among the plan's extend widths at batch "
                f"{cache.batch} {list(plan.widths_at(cache.batch))}: declare it (ShapePlan(extend_widths=...))."
            )
        g = self.step("extend", cache.batch, (cache.max_length, t, n), settings)
        checked = self._check(g, (cache.batch, t), tokens)
        g.calls += 1
        with routed(self.model, adapters, cache.batch):
            return g.step(tokens, positions, keep, checked=checked)

    @staticmethod
    def _check(g: Graph, expected: tuple, x: torch.Tensor) -> bool:
        """Whether `x` has the step's declared shape (a violation raises in strict mode, warns else)."""
        if tuple(x.shape) != expected:
            shape_violation(f"{g.kind} graph {g.shape} was handed inputs of shape {tuple(x.shape)}, outside the plan.")
            return False
        return True

    # ---- ahead of time ------------------------------------------------------------------------------
    def precompile(
        self, settings: CompileSettings, plan: Optional[ShapePlan] = None, progress=None, scores: bool = False
    ) -> list[dict]:
        """Compile (or load from the on-disk cache) every graph of the plan; one row per shape.

        Each row: kind, shape, seconds (first call: trace + compile or cache load), cache hit (inductor's
        FX-graph cache or a saved artifact answered), graphs compiled (shared functions count with the
        first shape that needed them). Decode shapes come first: a prefill may finish its prompt's last
        position with the decode step of its batch (the CPU's regions). `scores`: the scoring prefills
        too (the prompt's log-probabilities, `prefill(..., scores=True)`)."""
        plan = plan or self.plan
        device = self.model.device
        rows = []
        jobs = [("decode", b, k) for b, k in plan.decode_shapes()] + [
            ("prefill", b, n) for b, n in plan.prefill_shapes()
        ]
        if scores:
            jobs += [("score", b, n) for b, n in plan.prefill_shapes()]
        jobs += [("extend", b, (k, t, n)) for b, k, t, n in plan.extend_shapes()]
        with torch.no_grad():
            for kind, b, n in jobs:
                hits, before = cache_answers(), self.graph_count()
                start = time.perf_counter()
                g = self.step(kind, b, n, settings)
                with routed(self.model, None, b):
                    if kind == "extend":
                        k, t, kept = n
                        g.step(
                            torch.zeros(b, t, dtype=torch.long).to(device),
                            torch.arange(t).repeat(b, 1).to(device),
                            torch.arange(t - kept, t).repeat(b, 1).to(device),
                            checked=True,
                        )
                    elif kind != "decode":
                        cache = self.cache(b, plan.kv_bucket(min(n, plan.kv_lengths[-1])))
                        # inputs made on the host and sent, as a real call's are (made on a lazily traced
                        # device, they would be a graph of their own)
                        g.step(
                            torch.zeros(b, n, dtype=torch.long).to(device),
                            torch.full((b,), n - 1, dtype=torch.long).to(device),
                            cache,
                            torch.arange(b).to(device),
                            checked=True,
                        )
                    else:
                        # two tensors, never one passed twice: Dynamo would guard on the aliasing
                        g.step(
                            torch.zeros(b, 1, dtype=torch.long).to(device),
                            torch.zeros(b, 1, dtype=torch.long).to(device),
                            checked=True,
                        )
                self.backend.flush(device)  # a lazily traced device runs what the step queued (a prefill's insert)
                row = {
                    "kind": kind,
                    "shape": list(g.shape),
                    "seconds": round(time.perf_counter() - start, 2),
                    "cache_hit": cache_answers() > hits,
                    "graphs": self.graph_count() - before,
                }
                rows.append(row)
                if progress is not None:
                    progress(row)
        return rows

    def warm(self, kind: str, batch: int, dim, settings: CompileSettings) -> bool:
        """Whether the step of this shape exists and has run (its graphs are built)."""
        g = self.graphs.get((kind, batch, dim, settings, self.block_spec))
        return (
            g is not None
            and g.step is not None
            and (not settings.enabled or g.step.first_call_seconds > 0 or g.calls > 0)
        )

    # ---- reporting ---------------------------------------------------------------------------------
    def graph_count(self) -> int:
        return sum(g.step.graphs for g in self.graphs.values() if g.step is not None) + sum(
            f.graphs for f in self.steps.shared.values()
        )

    def _retire(self, g: Graph) -> None:
        """Keep the step's stats row; free its compiled code, which may hold a KV cache and weights."""
        self.retired.append(self._row(g, retired=True))
        if g.step is not None:
            g.step.release()
        g.step = None

    def stats(self) -> list[dict]:
        """One row per step (its own graphs), one per shared function, and the retired ones."""
        return (
            [self._row(g) for g in self.graphs.values()]
            + [self._shared_row(k, f) for k, f in self.steps.shared.items()]
            + list(self.retired)
        )

    def _shared_row(self, key: tuple, f: CompiledFunction, retired: bool = False) -> dict:
        calls = sum(g.calls for g in self.graphs.values() if g.step is not None and any(u is f for u in g.step.uses))
        return {
            "kind": key[0],
            "shape": list(f.shape),
            "backend": f.backend,
            "graphs": f.graphs,
            "functions": 1,
            "compile_seconds": round(f.compile_seconds, 3),
            "first_call_seconds": round(f.first_call_seconds, 3),
            "calls": calls,
            "retired": retired,
        }

    @staticmethod
    def _row(g: Graph, retired: bool = False) -> dict:
        s = g.step
        return {
            "kind": g.kind,
            "shape": list(g.shape),
            "backend": g.settings.label,
            "graphs": s.graphs if s is not None else 0,
            "functions": len(s.own) if s is not None else 0,
            "compile_seconds": round(s.compile_seconds, 3) if s is not None else 0.0,
            "first_call_seconds": round(s.first_call_seconds, 3) if s is not None else 0.0,
            "calls": g.calls,
            "retired": retired,
        }
