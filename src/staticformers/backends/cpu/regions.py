"""The CPU's generation steps: the regional steps of `compilation/regions.py`, run without Dynamo once warm.

Why this exists: on the CPU, inductor's compile time grows with the graph, and a whole-model graph is
no faster than a per-layer one run once per layer (BENCHMARKS.md), so the CPU's steps are regions
(`compilation.regions.DecodeRegions`, `PrefillRegions`: per shape a `prepare` region, a layer region per
layer kind, and per batch bucket one `head` region that its prefill and decode shapes share, kept in
the step builder's `shared`; a prefill stops one layer early). Each region is saved whole between
processes (`compiled.CPUCompiledFunction`, `precompiled.py`).

What is the CPU's own here: a decode step is short enough that Dynamo's wrapper and guard evaluation,
once per region and layer, are a measurable share of it. So **warm steps skip Dynamo**: once every
region a step runs has its one graph and the engine checked the step's inputs, the step calls the
regions' raw forms: the saved functions' bodies as plain functions, or the code objects holding
Dynamo's cached graphs under one run-only entry with guards unevaluated, instead of `torch.compile`'s
wrapper per region.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from ...compilation.regions import DecodeRegions, ExtendRegions, PrefillRegions
from .compiled import SKIP_GUARDS, unguarded
from . import decode_layers


class _Warm:
    """The warm path of a regional step (see the module docstring); `parts`: the regions its body runs."""

    _warm: dict

    def _ready(self, checked: bool) -> bool:
        return checked and SKIP_GUARDS and all(p.graphs == 1 for p in self.parts)

    def _warm_step(self, key, body: Callable, raw: Callable[[], tuple]) -> Callable:
        """`body(raw(), *args)` as a warmed step: plain when every part is a saved function, else under
        Dynamo's run-only mode with guards unevaluated. Built once per key (the raw forms are fixed once
        each part has its one graph)."""
        step = self._warm.get(key)
        if step is None:
            raw = raw()
            if all(getattr(p, "aot", None) is not None for p in self.parts):

                def step(*args):
                    return body(raw, *args)
            else:
                run_only = torch._dynamo.run(body)

                def step(*args):
                    with unguarded():
                        return run_only(raw, *args)

            self._warm[key] = step
        return step

    def release(self) -> None:
        super().release()
        self._warm = {}


class RegionalDecode(_Warm, DecodeRegions):
    """A decode step `[B, 1]` over its cache as regions, warmed (see the module docstring). Where its layers are all
    the plain kind of a bf16 model, a call runs them as one operator call instead (`decode_layers.py`), the first
    (guarded) one and a prefill's last row (`last_row`) too, so the layer regions are compiled only if a later call
    may not take it (a gradient wanted, a global hook, `STATICFORMERS_DECODE_LAYERS=0`), by that call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._warm = {}
        self._stacks: dict = {}  # (rows, first layer): `layers_stack`'s call, or None
        self.stacked = False  # whether the last call ran its layers as one call

    def one_call(self, rows: int, start: int = 0) -> Optional[Callable]:
        if not decode_layers.allowed():  # asked each call: what it checks may change between two
            return None
        key = (rows, start)
        if key not in self._stacks:
            x = torch.empty(rows, 1, self.model.config.hidden_size, dtype=self.model.dtype)
            self._stacks[key] = decode_layers.layers_stack(self.model, self.cache, self.ops, x, start)
        return self._stacks[key]

    def release(self) -> None:
        super().release()
        self._stacks = {}  # their calls hold the cache's tensors and the weights

    def layers(self, fns: tuple, input_ids, position_ids):
        """`DecodeRegions.layers`, with a fourth part in `fns`: this step's one call of every layer (or None),
        which runs where it takes the step; the layer regions otherwise."""
        prepare, layer, _, stack = fns
        views = self.cache.layer_views()
        x, cos, sin, masks = prepare(self.model, input_ids, position_ids, views[0])
        out = stack(x, cos, sin, masks, position_ids) if stack is not None else None
        self.stacked = out is not None
        return out if out is not None else self.walk(layer, x, cos, sin, masks, views, position_ids)

    def __call__(self, input_ids, position_ids, checked: bool = False):
        start = time.perf_counter()
        rows = input_ids.shape[0]
        stack = self.one_call(rows)
        # what this call runs, and must have compiled to be warm: `prepare`, the one call and the head, or every region
        self.parts = [self.prepare, self.head] if stack is not None else [*self.own, self.head]
        if self.calls and self._ready(checked):

            def raw():
                # with the one call, the layer regions as they are: they run only should it decline a call, which
                # the guarded call below has ruled out for this step
                layers = {k: f.raw for k, f in self.layer.items()} if stack is None else dict(self.layer)
                return (self.prepare.raw, layers, self.head.raw, stack)

            out = self._warm_step(("decode", stack is not None), self.body, raw)(input_ids, position_ids)
        else:  # guarded: each region's first call checks
            out = self.body((*self.fns, stack), input_ids, position_ids)
            if stack is not None and not self.stacked:  # it declined this step's tables or masks: so it always will
                self._stacks[(rows, 0)] = None
        self.timed(start)
        return out


class RegionalExtend(_Warm, ExtendRegions):
    """An extend step `[B, T]` over its cache as regions, warmed (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._warm = {}

    def __call__(self, input_ids, position_ids, keep_index, checked: bool = False):
        start = time.perf_counter()
        if self.calls and self._ready(checked):
            raw = lambda: (self.prepare.raw, {k: f.raw for k, f in self.layer.items()}, self.head.raw)  # noqa: E731
            out = self._warm_step("extend", self.body, raw)(input_ids, position_ids, keep_index)
        else:
            out = self.body(self.fns, input_ids, position_ids, keep_index)
        self.timed(start)
        return out


class RegionalPrefill(_Warm, PrefillRegions):
    """A prefill step `[b, L]` as regions, warmed, finished through the decode step of the cache it fills."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._warm = {}

    def __call__(self, input_ids, last_index, cache, slots: torch.Tensor, checked: bool = False):
        """Prefill `input_ids` `[b, L]` into the rows `slots` (`[n]`, n <= b) of `cache`; returns the argmax and
        logits at each inserted row's last token (`last_index` `[b]`), `[n]` and `[n, vocab]`."""
        start = time.perf_counter()
        self.kv.last_index = last_index  # what linear-attention layers count (`body` reads it through `self.kv`)
        if self.calls and self._ready(checked):
            raw = lambda: {k: f.raw for k, f in self.layer.items()}  # noqa: E731
            x = self._warm_step("prefill", self.body, raw)(input_ids, cache, slots)
        else:
            x = self.body(self.layer, input_ids, cache, slots)
        out = self.finish(x, last_index, cache, slots, checked)
        self.timed(start)
        return out


__all__ = ["RegionalDecode", "RegionalExtend", "RegionalPrefill"]
