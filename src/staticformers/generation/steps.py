"""The step functions the generation engine compiles: prefill and decode, whole or in regions.

Every step function has one declared shape (`engine.py`) and comes in one of two layouts:

- **whole**: `model(...)` inside one compiled function, one graph per shape. What a device that pays
  per graph launch wants (Neuron, CUDA), and what inductor's weight freezing needs.
- **regions** (the default on the CPU): per shape, a `prepare` function (embedding, masks, rotary
  tables; compiled for decode, eager for prefill) and a `layer` function (one decoder layer); per
  batch bucket, a `head` function (final norm, `lm_head` on the last position, argmax) that the
  bucket's prefill and decode shapes share. Every layer of the model runs the same layer graph: its
  weights and its slice of the KV cache (`cache.LayerKV`) are graph inputs, not constants, and the
  cache's `update` ignores the layer index, so nothing in the graph is specialised per layer (a model
  that mixes sliding-window and full layers gets one layer function per distinct window). The
  compiler's work then no longer grows with depth: on the 8-layer reference model a batch-1 decode
  shape compiles in about 4 s instead of 21 s, and a step runs as fast as the whole graph (measured
  A/B in one process, BENCHMARKS.md: the one fused whole-model kernel is no faster than eight calls
  of a per-layer one). The same regional layout makes the Trainer's first step short
  (`training/compiled.py`).

A regional prefill followed by a decode (the engine's, `Continuation`) stops one layer early: of the
last layer it computes the keys and values over the prompt (eagerly: two GEMMs and a few small
operations), and the prompt's last position goes through that layer and the head as a decode step
would, with the decode's compiled regions over the static cache its keys and values were written to.

A region's graph is traced on its first call and checked like any other compiled function
(`compile.CompiledFunction`): a second graph for one region is a plan violation. Once every region
has run, a step whose input shape the engine checked runs them all without Dynamo's guard
evaluation (each region has exactly one graph to choose) and through one Dynamo entry for the step:
the regions' own code objects are called under Dynamo's run-only mode, which maps each to its cached
graph, instead of through `torch.compile`'s wrapper per region (~25 us a call here, 10 calls a step).
On inductor each region is also precompiled (`precompiled.py`): saved whole and loaded by later
processes without a trace, and then the warmed step calls the compiled bodies as plain functions,
without the run-only entry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..compile import SKIP_GUARDS, CompiledFunction, unguarded
from ..modeling import project
from .cache import LayerSink, PrefillKV, StaticKVCache


# ---------------------------------------------------------------------------------------------
# whole-model steps
# ---------------------------------------------------------------------------------------------
def whole_prefill(model, length: int, form: tuple = (None, None, None)) -> Callable:
    """`prefill(input_ids, position_ids, attention_mask) -> (argmax, logits, keys, values)` over a
    prompt bucket of `length` positions (keys/values per layer, prompt only); `form` is the engine's
    (attention, linears, head's linear)."""
    layers = model.config.num_hidden_layers

    def prefill(input_ids, position_ids, attention_mask):
        kv = PrefillKV(layers, length)
        kv.decode_attention, kv.linears, kv.head_linear = form
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       kv_cache=kv, logits_to_keep=1).logits[:, -1]
        return logits.argmax(-1), logits, tuple(kv.keys), tuple(kv.values)

    return prefill


def whole_decode(model, cache: StaticKVCache) -> Callable:
    """`decode(input_ids, position_ids, attention_mask, cache_position) -> (argmax, logits)` over `cache`."""
    def decode(input_ids, position_ids, attention_mask, cache_position):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       kv_cache=cache, cache_position=cache_position).logits[:, -1]
        return logits.argmax(-1), logits

    return decode


# ---------------------------------------------------------------------------------------------
# the regions (each compiled once per shape, under its own code object)
# ---------------------------------------------------------------------------------------------
def prepare_region(model, input_ids, position_ids, attention_mask, kv_cache, cache_position):
    """Embedding, masks and rotary tables: what every layer takes besides the hidden states."""
    return model.model.prepare(input_ids, attention_mask, position_ids, kv_cache, cache_position)


def decode_layer_region(layer, x, cos, sin, masks, kv, cache_position):
    """One decoder layer over its slice of the static cache (written in place)."""
    return layer(x, cos, sin, masks, kv, cache_position)


def prefill_layer_region(layer, x, cos, sin, masks, sink):
    """One decoder layer over the prompt; also returns the keys and values it produced."""
    x = layer(x, cos, sin, masks, sink, None)
    return x, sink.key, sink.value


def head_region(model, hidden, how: Optional[str]):
    """Final norm and `lm_head` on one position per row (`hidden` `[batch, 1, hidden]`; computed `how`,
    see `modeling.project`), its argmax, and the normalised hidden states. Its shape depends on the batch
    alone, so one head serves every prefill and decode shape of a batch bucket (the engine keeps them).

    The normalised states are returned (callers drop them) so that inductor stores them once: a
    pointwise result with one consumer is otherwise inlined into that consumer, and the reduction
    would recompute the norm for each of the vocabulary's rows (bf16 batch-1 head 1.45 -> 1.1 ms)."""
    normed = model.model.norm(hidden)
    logits = project(model.lm_head, normed, how)[:, -1]
    return logits.argmax(-1), logits, normed


class Regions:
    """The compiled regions of one step function and the step that runs them; it answers like a
    `CompiledFunction` (`graphs`, `compile_seconds`, `first_call_seconds`, `release`, calls with
    `checked=`).

    `compile_one(fn, name)` compiles one region for this shape; `head` is the compiled `head_region`
    of the batch bucket, shared with the bucket's other shapes (not counted here) and `head_linear`
    its argument. `cache` (decode) is the static cache the step writes; `length` and `prefill_form`
    (prefill) are the prompt bucket and the engine's formulation of it (attention, linears, head).

    A prefill's `prepare` runs eagerly: a handful of small ops once per prompt, where compiling them
    would cost ~1.4 s per prompt bucket for ~0.1 ms saved per call. A decode's runs every step and is
    compiled."""

    def __init__(self, kind: str, model, name: str, compile_one: Callable[[Callable, str], CompiledFunction],
                 head: CompiledFunction, head_linear: Optional[str], cache: Optional[StaticKVCache] = None,
                 length: Optional[int] = None, prefill_form: tuple = (None, None, None)):
        self.model, self.kind = model, kind
        layers = list(model.model.layers)
        windows = dict.fromkeys(layer.self_attn.window for layer in layers)  # distinct, in layer order
        region = decode_layer_region if kind == "decode" else prefill_layer_region
        self.prepare = compile_one(prepare_region, f"{name}_prepare") if kind == "decode" else None
        self.layer = {w: compile_one(region, f"{name}_layer" + ("" if w is None else f"_window{w}")) for w in windows}
        self.head = head
        self.runs = [(layer, layer.self_attn.window) for layer in layers]
        self.cache, self.head_linear = cache, head_linear
        self.sink = LayerSink(length or 0, *prefill_form[:2])
        self.calls = 0
        self.first_call_seconds = 0.0
        # the regions as counted, guarded compiled functions; and (once warm) as what a warmed step calls
        # without a wrapper per call: the code objects that hold the cached graphs (under Dynamo's
        # run-only mode), or the precompiled functions' bodies (`CompiledFunction.raw`)
        self._compiled = (self.prepare or prepare_region, self.layer, self.head)
        self._warm: dict[bool, tuple] = {}  # continued (prefill with `into`) or not -> (step, raw regions)
        # the regions compiled for this shape alone (the shared head is the engine's); fixed once built,
        # so the per-step warm check below reads a list instead of building one
        self.own: list[CompiledFunction] = ([self.prepare] if self.prepare else []) + list(self.layer.values())
        # every region a step runs; a continued prefill runs the layer regions of all layers but the
        # last (and no head), so a window only the last layer has is not among them
        self._parts = {False: self.own + [self.head],
                       True: list({id(self.layer[w]): self.layer[w] for _, w in self.runs[:-1]}.values())}

    @property
    def graphs(self) -> int:
        return sum(p.graphs for p in self.own)

    @property
    def compile_seconds(self) -> float:
        return sum(p.compile_seconds for p in self.own)

    def release(self) -> None:
        for p in self.own:
            p.release()
        self.runs, self.cache, self._compiled, self._warm = [], None, None, {}
        self.own, self._parts = [], {False: [], True: []}

    def __call__(self, *args, checked: bool = False, into: Optional["Continuation"] = None):
        """Run the step. A prefill given `into` (the decode that follows it, see `Continuation`) copies
        each layer's keys and values into that decode's static cache as soon as the layer has run, so
        the prompt's keys and values of all layers never exist twice (for a long prompt at batch 8 that
        is the size of the cache itself), and returns `(argmax, logits)` of the last position; without
        `into` it also returns every layer's keys and values, as a whole prefill graph does."""
        start = time.perf_counter()
        continued = into is not None
        if checked and SKIP_GUARDS and self.calls and all(len(p.records) == 1 for p in self._parts[continued]):
            # warmed, one graph each, inputs checked by the engine: no guards, no wrapper per region
            warm = self._warm.get(continued) or self._warmed(continued)
            out = warm[0](warm[1], into, *args)
        else:
            out = self._step(self._compiled, into, *args)
        if continued:  # the prompt's last position through the last layer, as a decode step
            out = into.decode.last_position(out, into.last, checked)
        if not self.calls:  # the first call's wall time, a decode's regions compiled on the way included
            self.first_call_seconds = time.perf_counter() - start
        self.calls += 1
        return out

    def _warmed(self, continued: bool) -> tuple:
        """The step over the regions' raw forms, and those forms (fixed once each region the step runs
        has its one graph). Precompiled bodies are plain functions, called as they are (0.4-3% of a
        batch-1 decode step saved against the run-only entry); code objects that hold Dynamo's cached
        graphs run under one Dynamo run-only entry for the whole step, guards unevaluated, instead of
        `torch.compile`'s wrapper per region (~25 us each on this CPU)."""
        raw = (self.prepare.raw if self.prepare else prepare_region,
               {w: f.raw for w, f in self.layer.items()}, self.head.raw)
        if all(p.aot is not None for p in self._parts[continued]):
            step = self._step
        else:
            run_only = torch._dynamo.run(self._step)

            def step(*args):
                with unguarded():
                    return run_only(*args)

        self._warm[continued] = (step, raw)
        return step, raw

    def _step(self, fns: tuple, into: Optional["Continuation"], *args):
        return self._decode(fns, *args) if self.kind == "decode" else self._prefill(fns, into, *args)

    def _decode(self, fns: tuple, input_ids, position_ids, attention_mask, cache_position):
        prepare, layer, head = fns
        cache = self.cache
        x, cos, sin, masks = prepare(self.model, input_ids, position_ids, attention_mask, cache, cache_position)
        for (module, window), kv in zip(self.runs, cache.layer_views()):
            x = layer[window](module, x, cos, sin, masks, kv, cache_position)
        argmax, logits, _ = head(self.model, x, self.head_linear)
        return argmax, logits

    def _prefill(self, fns: tuple, into: Optional["Continuation"], input_ids, position_ids, attention_mask):
        prepare, layer, head = fns
        x, cos, sin, masks = prepare(self.model, input_ids, position_ids, attention_mask, None, None)
        if into is not None:
            # every layer but the last over the whole prompt; of the last, only the keys and values
            # (the cache needs them): its attention and MLP are wanted at the last position alone,
            # which `Regions.last_position` computes after this (1/layers of the prompt's GEMMs saved)
            *layers, (last, _) = self.runs
            cache = into.decode.cache
            for i, (module, window) in enumerate(layers):
                x, k, v = layer[window](module, x, cos, sin, masks, self.sink)
                cache.load_layer(i, k, v)
            k, v = prompt_keys_values(last, x, cos, sin, self.sink.linears)
            cache.load_layer(len(layers), k, v)
            return x[:, -1:].clone(memory_format=torch.contiguous_format)  # the decode's layout
        keys, values = [], []
        for module, window in self.runs:
            x, k, v = layer[window](module, x, cos, sin, masks, self.sink)
            keys.append(k)
            values.append(v)
        # canonical strides, as decode passes: the head is shared and Dynamo guards on strides
        argmax, logits, _ = head(self.model, x[:, -1:].clone(memory_format=torch.contiguous_format), self.head_linear)
        return argmax, logits, tuple(keys), tuple(values)

    def last_position(self, x, last: tuple, checked: bool):
        """A decode step's last layer and head over one position whose keys and values of every layer
        are already in the cache (a prompt's last position; the layer rewrites its own): `x` `[batch, 1,
        hidden]` is that layer's input, `last` the step's `(input_ids, position_ids, attention_mask,
        cache_position)`. Returns `(argmax, logits)`. It runs this step's compiled regions (the
        embedding `prepare` computes is not used), so it adds no graph to the plan's."""
        input_ids, position_ids, attention_mask, cache_position = last
        module, window = self.runs[-1]
        _, cos, sin, masks = self.prepare(self.model, input_ids, position_ids, attention_mask, self.cache,
                                          cache_position, checked=checked)
        x = self.layer[window](module, x, cos, sin, masks, self.cache.layer_views()[-1], cache_position,
                               checked=checked)
        argmax, logits, _ = self.head(self.model, x, self.head_linear, checked=checked)
        return argmax, logits


def prompt_keys_values(layer, x, cos, sin, how: Optional[str]):
    """A decoder layer's keys and values over a prompt (`x` the layer's input), computed eagerly: a few
    small operations and two GEMMs, where compiling them would be one more graph per prompt bucket."""
    return layer.self_attn.keys_values(layer.input_layernorm(x), cos, sin, how)


@dataclass
class Continuation:
    """What a regional prefill needs when a decode follows it (see `Regions.__call__`): the decode step
    `decode` (a `Regions`: each layer's keys and values go to its static cache) and `last`, the prompt's
    last position as that step's inputs `(input_ids [B, 1], position_ids [B, 1], attention_mask [B, kv],
    cache_position [1])`."""

    decode: Regions
    last: tuple
