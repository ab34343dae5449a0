"""The CPU's generation steps: each shape compiled as small regions that every layer shares.

Why this exists: on the CPU, inductor's compile time grows with the graph, and a whole-model graph is
no faster than a per-layer one run once per layer (BENCHMARKS.md). So per shape:

- a decode step compiles a `prepare` region (embedding, masks from the rows' positions, rotary
  tables) and a `layer` region (one decoder layer); every layer runs the same layer graph, its weights
  and its slice of the KV cache (`cache.LayerKV`) being graph inputs, not constants, and the cache's
  `update` ignoring the layer index (a model that mixes layer kinds, sliding-window and full attention
  or dense and mixture-of-experts MLPs, gets one layer region per distinct kind, `DecoderLayer.kind`);
- a prefill compiles a `layer` region over the prompt (its `prepare` runs eagerly: a handful of small
  ops once per prompt, where a compile per prompt bucket would cost far more than it saves);
- per batch bucket one `head` region (final norm, `lm_head` on one position per row, argmax), shared
  by the bucket's prefill and decode shapes and kept by the engine (`engine.shared`).

The compiler's work then no longer grows with depth, and each region is saved whole between
processes (`compiled.CPUCompiledFunction`, `precompiled.py`).

**A prefill stops one layer early.** The prompt's logits are wanted at each row's last token only,
so a prefill runs every layer but the last over the prompt (inserting each layer's keys and values
into the cache rows of its requests as soon as the layer has run, so they never exist twice), then
computes the last layer's keys and values eagerly, and sends each row's last token through the last
layer and the head with the decode step's own regions for the cache's shape (`RegionalDecode.last_row`):
one layer of prompt work saved, no graph added to the plan. The other rows of the batch take part in
that decode-shaped call at position K-1, which a running row has not attended yet and writes before it
does (a row's need never exceeds K), so nothing of theirs is changed.

**Warm steps skip Dynamo.** Once every region a step runs has its one graph and the engine checked
the step's inputs, the step calls the regions' raw forms: the saved functions' bodies as plain
functions, or the code objects holding Dynamo's cached graphs under one run-only entry with guards
unevaluated, instead of `torch.compile`'s wrapper per region.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from ...compilation.compiler import CompiledFunction
from ...models.kv_cache import KVCache
from ...models.decoder import kind_suffix, take
from .compiled import SKIP_GUARDS, unguarded
from .formulations import CPUOps


# ---------------------------------------------------------------------------------------------
# the regions (each compiled once per shape, under its own code object)
# ---------------------------------------------------------------------------------------------
def prepare_region(model, input_ids, position_ids, kv):
    """Embedding, masks (from each row's position over `kv`'s length) and rotary tables."""
    return model.model.prepare(input_ids, None, position_ids, kv)


def decode_layer_region(layer, x, cos, sin, masks, kv, position_ids, ops):
    """One decoder layer over its slice of the static cache (written in place at the rows' positions)."""
    return layer(x, cos, sin, masks, kv, position_ids, ops)


def prefill_layer_region(layer, x, cos, sin, masks, sink, ops):
    """One decoder layer over the prompt; also returns the keys and values it produced."""
    x = layer(x, cos, sin, masks, sink, None, ops)
    return x, sink.key, sink.value


def head_region(model, hidden, ops):
    """Final norm and `lm_head` on one position per row (`hidden` `[batch, 1, hidden]`), its argmax, and
    the normalised hidden states. Its shape depends on the batch alone, so one head serves every prefill
    and decode shape of a batch bucket.

    The normalised states are returned (callers drop them) so that inductor stores them once: a
    pointwise result with one consumer is otherwise inlined into that consumer, and a reduction over
    the vocabulary's rows would recompute the norm for each of them."""
    normed = model.model.norm(hidden)
    logits = ops.head(model.lm_head, normed)[:, -1]
    return logits.argmax(-1), logits, normed


class LayerSink:
    """One layer's prefill keys and values, kept as they are produced (the prompt-only cache of one layer)."""

    def __init__(self, max_length: int):
        self.max_length = int(max_length)
        self.key = self.value = None

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, position_ids: Optional[torch.Tensor]):
        self.key, self.value = k, v
        return k, v


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """Canonical strides, as a decode step's inputs have them (Dynamo guards on strides)."""
    return t.clone(memory_format=torch.contiguous_format)


class _Regions:
    """What a regional step shares: its regions, the run over the layers, stats, the warm path."""

    def __init__(self, model, head: Optional[CompiledFunction] = None, head_ops: Optional[CPUOps] = None):
        self.model = model
        self.runs = [(layer, layer.kind) for layer in model.model.layers]
        self.kinds = list(dict.fromkeys(w for _, w in self.runs))  # distinct, in layer order
        self.head, self.head_ops = head, head_ops
        self.own: list[CompiledFunction] = []
        self.uses: tuple = ()
        self.calls = 0
        self.first_call_seconds = 0.0
        self._warm: dict = {}

    @property
    def graphs(self) -> int:
        return sum(p.graphs for p in self.own)

    @property
    def compile_seconds(self) -> float:
        return sum(p.compile_seconds for p in self.own)

    def release(self) -> None:
        for p in self.own:
            p.release()
        self.runs, self.own, self._warm = [], [], {}

    @staticmethod
    def _ready(parts: list, checked: bool) -> bool:
        return checked and SKIP_GUARDS and all(p.graphs == 1 for p in parts)

    def _warm_step(self, key, parts: list, body: Callable, raw: Callable[[], tuple]) -> Callable:
        """`body(raw(), *args)` as a warmed step (see the module docstring): plain when every part is a saved
        function, else under Dynamo's run-only mode with guards unevaluated. Built once per key (the raw
        forms are fixed once each part has its one graph)."""
        step = self._warm.get(key)
        if step is None:
            raw = raw()
            if all(getattr(p, "aot", None) is not None for p in parts):
                def step(*args):
                    return body(raw, *args)
            else:
                run_only = torch._dynamo.run(body)

                def step(*args):
                    with unguarded():
                        return run_only(raw, *args)
            self._warm[key] = step
        return step

    def _timed(self, start: float) -> None:
        if not self.calls:  # the first call's wall time, regions compiled on the way included
            self.first_call_seconds = time.perf_counter() - start
        self.calls += 1


class RegionalDecode(_Regions):
    """A decode step `[B, 1]` over `cache` as regions (see the module docstring)."""

    def __init__(self, model, cache: KVCache, name: str, compile_one: Callable, head: CompiledFunction,
                 head_ops: CPUOps, ops: CPUOps):
        super().__init__(model, head, head_ops)
        self.cache, self.ops = cache, ops
        self.prepare = compile_one(prepare_region, f"{name}_prepare")
        self.layer = {w: compile_one(decode_layer_region, f"{name}_layer" + kind_suffix(w)) for w in self.kinds}
        self.own = [self.prepare] + list(self.layer.values())
        self.uses = (head,)
        self._parts = self.own + [head]
        self._fns = (self.prepare, self.layer, head)

    def release(self) -> None:
        super().release()
        self.cache, self._fns, self._parts = None, None, []

    def __call__(self, input_ids, position_ids, checked: bool = False):
        start = time.perf_counter()
        if self.calls and self._ready(self._parts, checked):
            raw = lambda: (self.prepare.raw, {w: f.raw for w, f in self.layer.items()}, self.head.raw)  # noqa: E731
            out = self._warm_step("decode", self._parts, self._body, raw)(input_ids, position_ids)
        else:
            out = self._body(self._fns, input_ids, position_ids)  # guarded: each layer's first call checks
        self._timed(start)
        return out

    def _body(self, fns: tuple, input_ids, position_ids):
        prepare, layer, head = fns
        views = self.cache.layer_views()
        x, cos, sin, masks = prepare(self.model, input_ids, position_ids, views[0])
        for (module, kind), kv in zip(self.runs, views):
            x = layer[kind](module, x, cos, sin, masks, kv, position_ids, self.ops)
        argmax, logits, _ = head(self.model, x, self.head_ops)
        return argmax, logits

    def last_row(self, x: torch.Tensor, position_ids: torch.Tensor, checked: bool):
        """The last layer and the head of this step over one position per row, whose keys and values of
        every earlier layer are in the cache (a prompt's last token; the layer rewrites its own): `x`
        `[B, 1, hidden]` is the last layer's input, `position_ids` `[B, 1]`. Returns `(argmax, logits)`.
        It runs this step's compiled regions (the embedding `prepare` computes is not used), so it adds
        no graph to the plan's."""
        module, kind = self.runs[-1]
        views = self.cache.layer_views()
        dummy = torch.zeros_like(position_ids)
        _, cos, sin, masks = self.prepare(self.model, dummy, position_ids, views[0], checked=checked)
        x = self.layer[kind](module, x, cos, sin, masks, views[-1], position_ids, self.ops, checked=checked)
        argmax, logits, _ = self.head(self.model, x, self.head_ops, checked=checked)
        return argmax, logits


class RegionalPrefill(_Regions):
    """A prefill step `[b, L]` as regions, finished through the decode step of the cache it fills."""

    def __init__(self, model, length: int, name: str, compile_one: Callable, ops: CPUOps,
                 decode_for: Callable[[KVCache], RegionalDecode]):
        super().__init__(model)
        self.ops, self.decode_for = ops, decode_for
        self.layer = {w: compile_one(prefill_layer_region, f"{name}_layer" + kind_suffix(w)) for w in self.kinds}
        self.own = list(self.layer.values())
        # every layer but the last runs a layer region: a kind only the last layer has is not among them
        self._parts = list({id(self.layer[w]): self.layer[w] for _, w in self.runs[:-1]}.values())
        self.sink = LayerSink(length)

    def release(self) -> None:
        super().release()
        self.decode_for, self._parts = None, []

    def __call__(self, input_ids, last_index, cache: KVCache, slots: torch.Tensor, checked: bool = False):
        """Prefill `input_ids` `[b, L]` into the rows `slots` (`[n]`, n <= b) of `cache`; returns the argmax and
        logits at each inserted row's last token (`last_index` `[b]`), `[n]` and `[n, vocab]`."""
        start = time.perf_counter()
        if self.calls and self._ready(self._parts, checked):
            raw = lambda: {w: f.raw for w, f in self.layer.items()}  # noqa: E731
            x = self._warm_step("prefill", self._parts, self._body, raw)(input_ids, cache, slots)
        else:
            x = self._body(self.layer, input_ids, cache, slots)
        # each row's last token through the last layer and the head, as one decode step of the cache's shape
        n = slots.shape[0]
        last = take(x, last_index.view(-1, 1))[:n]  # [n, 1, hidden]
        rows = torch.zeros(cache.batch, 1, x.shape[-1], dtype=x.dtype, device=x.device)
        rows.index_copy_(0, slots, last)
        positions = torch.full((cache.batch, 1), cache.max_length - 1, dtype=torch.long, device=x.device)
        positions.index_copy_(0, slots, last_index[:n].view(-1, 1))
        argmax, logits = self.decode_for(cache).last_row(rows, positions, checked)
        self._timed(start)
        return argmax.index_select(0, slots), logits.index_select(0, slots)

    def _body(self, layer: dict, input_ids, cache: KVCache, slots: torch.Tensor):
        """Every layer but the last over the prompt, each one's keys and values inserted as it finishes; of
        the last, only the keys and values. Returns the last layer's input."""
        n = slots.shape[0]
        x, cos, sin, masks = self.model.model.prepare(input_ids)
        *layers, (last, _) = self.runs
        for i, (module, kind) in enumerate(layers):
            x, k, v = layer[kind](module, x, cos, sin, masks, self.sink, self.ops)
            cache.insert(slots, i, k[:n], v[:n])
        k, v = last.self_attn.keys_values(last.input_layernorm(x), cos, sin, self.ops)
        cache.insert(slots, len(layers), k[:n], v[:n])
        return x
