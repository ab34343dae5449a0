"""Per-layer compiled regions, built from the model's own pieces: one home for every caller that compiles
the decoder a layer at a time (the CPU's generation steps, the Trainer, FSDP2's per-block compile).

Why this exists: a compiler's work grows with the graph, and a whole-model graph is no faster than a
one-layer graph run once per layer (BENCHMARKS.md). So each caller compiles one region per distinct
layer kind (`DecoderLayer.kind`: attention window, dense or sparse MLP) that every layer of that kind
runs, its weights (and its slice of a KV cache) being graph inputs, not constants; plus small regions
around the layers. The regions call the model's pieces and nothing else, so the decoder's forward is
written once (`models/decoder.py`):

- `DecoderModel.prepare`: embedding, masks, rotary tables (`prepare_region`);
- `DecoderLayer.forward`, routed or not (`layer_region`, `routed_layer_region`; over a prompt-only
  cache, `prefill_layer_region`); `DecoderLayer.keys_values`: a layer's keys and values alone;
- the decoder's final norm, then `CausalLM.head`: logits, the loss and the load-balancing loss
  (`head_region` for generation, `loss_head_region` for training).

The callers, each with its own compile function (`compile_one(fn, name)`: the device's backend decides
how; every region is counted, one graph per declared shape):

- **generation**: `DecodeRegions` (`[B, 1]` over a static cache: `prepare`, the layers, the head) and
  `PrefillRegions` (`[b, L]`). *A prefill stops one layer early*: a prompt's logits are wanted at each
  row's last token only, so a prefill runs every layer but the last over the prompt (inserting each
  layer's keys and values into the cache rows of its requests as soon as the layer has run, so they
  never exist twice), computes the last layer's keys and values eagerly, and sends each row's last
  token through the last layer and the head with the decode step's own regions for the cache's shape
  (`DecodeRegions.last_row`; the last layer as the backend's one call where it runs the step's layers as one,
  `one_call`): one layer of prompt work saved, no graph added to the plan. The other
  rows of the batch take part in that decode-shaped call at position K-1, which a running row has not
  attended yet and writes before it does (a row's need never exceeds K), so nothing of theirs is
  changed. A prefill's `prepare` runs eagerly: a handful of small ops once per prompt, where a compile
  per prompt bucket would cost far more than it saves. Each step's `body(fns, ...)` takes its regions
  as an argument, so that a backend may run it with their raw forms once warm (`backends/cpu/`).
- **training**: `regional_loss` (the Trainer's `StepFunction`): `prepare` eagerly, the layers through
  `DecoderModel.run_layers` (gradient checkpointing included) with a region per kind, the head with the
  loss. AOTAutograd derives each region's backward.
- **FSDP2**: `compile_blocks` compiles each decoder block's module call in place, FSDP2's hooks inside
  its graph: its own code object per block, since each block's hooks differ.

A region's name tells its layer kind apart (`region_name`): the model knows no names.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from ..models.kv_cache import KVCache, PrefillKV
from ..models.kept_positions import take
from ..models.ops import PLAIN, Ops
from .compiler import CompiledFunction, compile_module_calls
from .prompt_scores import prompt_scores


# ---------------------------------------------------------------------------------------------
# the region functions (each compiled under its own code object and name)
# ---------------------------------------------------------------------------------------------
def prepare_region(model, input_ids, position_ids, kv):
    """Embedding, masks (from each row's position over `kv`'s length) and rotary tables."""
    return model.model.prepare(input_ids, None, position_ids, kv)


def layer_region(layer, x, cos, sin, masks, kv_cache=None, position_ids=None, ops: Ops = PLAIN):
    """One decoder layer (over its slice of a static cache, written in place at the rows' positions, when
    given)."""
    return layer(x, cos, sin, masks, kv_cache, position_ids, ops)


def routed_layer_region(layer, x, cos, sin, masks, kv_cache=None, position_ids=None, ops: Ops = PLAIN):
    """One decoder layer and its router logits (None for a dense layer): `(x, logits)`."""
    return layer(x, cos, sin, masks, kv_cache, position_ids, ops, routed=True)


def prefill_layer_region(layer, x, cos, sin, masks, kv: PrefillKV, ops: Ops):
    """One decoder layer over the prompt (`kv` a prompt-only cache); also returns the keys and values it
    produced."""
    x = layer(x, cos, sin, masks, kv, None, ops)
    return x, kv.key, kv.value


def head_region(model, hidden, ops: Ops):
    """Final norm and head on one position per row (`hidden` `[batch, 1, hidden]`), its argmax, and the
    normalised hidden states. Its shape depends on the batch alone, so one head serves every prefill and
    decode shape of a batch bucket.

    The normalised states are returned (callers drop them) so that inductor stores them once: a
    pointwise result with one consumer is otherwise inlined into that consumer, and a reduction over
    the vocabulary's rows would recompute the norm for each of them."""
    normed = model.model.norm(hidden)
    logits = model.head(normed, ops=ops).logits[:, -1]
    return logits.argmax(-1), logits, normed


def kept_head_region(model, hidden, keep_index, ops: Ops):
    """Final norm and head at each row's kept positions (`hidden` `[b, T, hidden]`, `keep_index` `[b, n]`): the
    argmax `[b, n]` and logits `[b, n, vocab]` (an extend step's; one per batch, tokens and kept count)."""
    logits = model.head(model.model.norm(take(hidden, keep_index)), ops=ops).logits
    return logits.argmax(-1), logits


def score_head_region(model, hidden, input_ids, last_index, ops: Ops):
    """Final norm and head over every prompt position (`hidden` `[b, L, hidden]`): the argmax and logits at
    each row's last token (`last_index` `[b]`) and the prompt's scores (`prompt_scores.py`)."""
    every = model.head(model.model.norm(hidden), ops=ops).logits
    logits = take(every, last_index.view(-1, 1))[:, -1]
    return (logits.argmax(-1), logits) + prompt_scores(every, input_ids)


def loss_head_region(model, hidden, labels, num_items_in_batch, ops: Ops = PLAIN, router_logits=None):
    """Final norm, head and loss (summed, divided by `num_items_in_batch`), plus the load-balancing loss of
    `router_logits` when given (`CausalLM.head`)."""
    return model.head(model.model.norm(hidden), labels, num_items_in_batch, ops, router_logits).loss


# ---------------------------------------------------------------------------------------------
# which models, which names
# ---------------------------------------------------------------------------------------------
def has_decoder_layout(model) -> bool:
    """Whether `model` is laid out as ours (`model.model.prepare`, `.run_layers`, `.layers`, `.norm`,
    `model.head`, `lm_head`): what the regions call."""
    decoder = getattr(model, "model", None)
    return (
        all(hasattr(decoder, a) for a in ("prepare", "run_layers", "layers", "norm"))
        and hasattr(model, "head")
        and hasattr(model, "lm_head")
    )


def routes_logits(model) -> bool:
    """Whether the model's loss includes the load-balancing loss (a mixture of experts with output_router_logits)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "is_moe", False) and config.output_router_logits)


def region_name(base: str, kind: tuple) -> str:
    """A layer region's name: `base`, and what tells its layer kind apart ("", "_window4096", "_moe", the RoPE
    a layer reads where sliding layers have their own: "_rope_local", "_norope" and "_sinks")."""
    window, mlp, *rest = kind
    return (
        base
        + ("" if window is None else f"_window{window}")
        + ("_moe" if mlp == "moe" else "")
        + "".join(f"_rope_{r}" if r in ("local", "global") else f"_{r}" for r in rest)
    )


def layer_regions(kinds, fn: Callable, base: str, compile_one: Callable) -> dict:
    """`fn` compiled once per layer kind in `kinds`: `{kind: compile_one(fn, region_name(base, kind))}`."""
    return {kind: compile_one(fn, region_name(base, kind)) for kind in kinds}


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
def regional_loss(
    model,
    input_ids,
    labels,
    position_ids,
    num_items_in_batch,
    layer_for: Optional[Callable] = None,
    head: Callable = loss_head_region,
    ops: Ops = PLAIN,
):
    """`CausalLM.forward`'s loss with labels, as regions: each layer run by `layer_for(layer)` (its
    compiled region; by default the plain region function, `routed_layer_region` when the loss has the
    load-balancing loss, `routes_logits`), the final norm, head and loss by `head` (`loss_head_region`,
    compiled)."""
    decoder = model.model
    routed = routes_logits(model)
    if layer_for is None:
        plain = routed_layer_region if routed else layer_region
        layer_for = lambda layer: plain  # noqa: E731
    x, cos, sin, masks = decoder.prepare(input_ids, position_ids=position_ids)
    if torch.is_grad_enabled() and not x.requires_grad and any(p.requires_grad for p in decoder.layers[0].parameters()):
        # a frozen embedding (LoRA) feeds the first layer a tensor without grad, every later layer one with:
        # the layer region would need two graphs; one graph it is, with the first input's gradient unused
        x = x.detach().requires_grad_(True)

    def call(layer, *args):
        return layer_for(layer)(layer, *args)

    router = [] if routed else None
    hidden = decoder.run_layers(x, cos, sin, masks, call=call, ops=ops, router_logits=router)
    return head(model, hidden, labels, num_items_in_batch, ops, tuple(router) if routed else None)


# ---------------------------------------------------------------------------------------------
# FSDP2's blocks
# ---------------------------------------------------------------------------------------------
def compile_blocks(model, backend, **kwargs) -> list:
    """Compile each decoder block's call in place (the unit FSDP2 gathers, its hooks inside the graph),
    through the one compile path (`compiler.compile_module_calls`): each block `block_{i}` has its own code
    object and graph counter (FSDP2's hooks may split a block into a few graphs, which are counted like the
    others). Returns the counters."""
    return compile_module_calls(list(model.model.layers), "block", backend, limit=None, fullgraph=False, **kwargs)


# ---------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------
class GenerationRegions:
    """What a regional generation step reports, as a compiled function does: the compiled functions it owns
    (`own`) and the shared ones it calls (`uses`), its graphs, compile seconds, calls, first call's time."""

    def __init__(self, model, head: Optional[CompiledFunction] = None, head_ops: Optional[Ops] = None):
        self.model = model
        self.runs = [(layer, layer.kind) for layer in model.model.layers]
        self.kinds = list(dict.fromkeys(k for _, k in self.runs))  # distinct, in layer order
        self.head, self.head_ops = head, head_ops
        self.own: list[CompiledFunction] = []
        self.uses: tuple = ()
        self.calls = 0
        self.first_call_seconds = 0.0

    @property
    def graphs(self) -> int:
        return sum(p.graphs for p in self.own)

    @property
    def compile_seconds(self) -> float:
        return sum(p.compile_seconds for p in self.own)

    def release(self) -> None:
        for p in self.own:
            p.release()
        self.runs, self.own = [], []

    def timed(self, start: float) -> None:
        """Count a call that began at `start` (`time.perf_counter()`)."""
        if not self.calls:  # the first call's wall time, regions compiled on the way included
            self.first_call_seconds = time.perf_counter() - start
        self.calls += 1


class DecodeRegions(GenerationRegions):
    """A decode step `[B, 1]` over `cache` as regions: `prepare`, one layer region per kind, and the batch
    bucket's `head` (shared with its other steps). Every layer runs over its own view of the cache
    (`KVCache.layer_views`), whose `update` ignores the layer's index."""

    def __init__(
        self, model, cache: KVCache, name: str, compile_one: Callable, head: CompiledFunction, head_ops: Ops, ops: Ops
    ):
        super().__init__(model, head, head_ops)
        self.cache, self.ops = cache, ops
        self.prepare = compile_one(prepare_region, f"{name}_prepare")
        self.layer = layer_regions(self.kinds, layer_region, f"{name}_layer", compile_one)
        self.own = [self.prepare] + list(self.layer.values())
        self.uses = (head,)
        self.parts = self.own + [head]  # what `body` runs
        self.fns = (self.prepare, self.layer, head)

    def release(self) -> None:
        super().release()
        self.cache, self.fns, self.parts = None, None, []

    def layers(self, fns: tuple, input_ids, position_ids):
        """`prepare` and every layer over the cache (each written at the rows' positions): the last hidden
        states. `fns` = (prepare, {kind: layer}, head): `self.fns`, or their raw forms."""
        prepare, layer = fns[:2]
        views = self.cache.layer_views()
        x, cos, sin, masks = prepare(self.model, input_ids, position_ids, views[0])
        return self.walk(layer, x, cos, sin, masks, views, position_ids)

    def walk(self, layer: dict, x, cos, sin, masks, views: list, position_ids):
        """Every layer in turn over its view of the cache, `layer` {kind: region}: the last hidden states."""
        for (module, kind), kv in zip(self.runs, views):
            x = layer[kind](module, x, cos, sin, masks, kv, position_ids, self.ops)
        return x

    def body(self, fns: tuple, input_ids, position_ids):
        """The step with `fns` (see `layers`): the argmax and logits at each row's one position."""
        argmax, logits, _ = fns[2](self.model, self.layers(fns, input_ids, position_ids), self.head_ops)
        return argmax, logits

    def last_row(self, x: torch.Tensor, position_ids: torch.Tensor, checked: bool):
        """The last layer and the head of this step over one position per row, whose keys and values of
        every earlier layer are in the cache (a prompt's last token; the layer rewrites its own): `x`
        `[B, 1, hidden]` is the last layer's input, `position_ids` `[B, 1]`. Returns `(argmax, logits)`.
        It runs this step's compiled regions (the embedding `prepare` computes is not used), or the last layer
        as the backend's one call where it has one (`one_call`), so it adds no graph to the plan's."""
        module, kind = self.runs[-1]
        views = self.cache.layer_views()
        dummy = torch.zeros_like(position_ids)
        _, cos, sin, masks = self.prepare(self.model, dummy, position_ids, views[0], checked=checked)
        stack = self.one_call(x.shape[0], len(self.runs) - 1)
        out = stack(x, cos, sin, masks, position_ids) if stack is not None else None
        if out is None:
            out = self.layer[kind](module, x, cos, sin, masks, views[-1], position_ids, self.ops, checked=checked)
        argmax, logits, _ = self.head(self.model, out, self.head_ops, checked=checked)
        return argmax, logits

    def one_call(self, rows: int, start: int = 0) -> Optional[Callable]:
        """Where a backend runs this step's layers from `start` on as one call instead of their regions, for `rows`
        rows: `stack(x, cos, sin, masks, position_ids) -> x` (None where it declines a call), else None. None
        here: every layer runs its region."""
        return None


class ExtendRegions(DecodeRegions):
    """An extend step `[B, T]` over `cache` as regions: `prepare` and a layer region per kind of this shape
    (the same region functions as decode's, T tokens per row), then `head` (`kept_head_region`, shared by
    every KV length of the batch, tokens and kept count) at each row's kept positions."""

    def body(self, fns: tuple, input_ids, position_ids, keep_index):
        """The step with `fns` (see `DecodeRegions.layers`): the argmax and logits at the kept positions."""
        return fns[2](self.model, self.layers(fns, input_ids, position_ids), keep_index, self.head_ops)

    def last_row(self, *args, **kwargs):
        raise TypeError("An extend step finishes no prefill: a prefill finishes with its cache's decode step.")


class PrefillRegions(GenerationRegions):
    """A prefill step `[b, L]` as regions, finished through the decode step of the cache it fills
    (`decode_for(cache)`; see the module docstring)."""

    def __init__(
        self,
        model,
        length: int,
        name: str,
        compile_one: Callable,
        ops: Ops,
        decode_for: Callable[[KVCache], DecodeRegions],
    ):
        super().__init__(model)
        self.ops, self.decode_for = ops, decode_for
        # every layer but the last runs a layer region: a kind only the last layer has gets none (Qwen3.5's one
        # full-attention kind when its full layers are every fourth of four)
        kinds = list(dict.fromkeys(k for _, k in self.runs[:-1]))
        self.layer = layer_regions(kinds, prefill_layer_region, f"{name}_layer", compile_one)
        self.own = list(self.layer.values())
        self.parts = list({id(self.layer[k]): self.layer[k] for _, k in self.runs[:-1]}.values())
        self.kv = PrefillKV(length)

    def release(self) -> None:
        super().release()
        self.decode_for, self.parts, self.kv = None, [], None

    def body(self, layer: dict, input_ids, cache: KVCache, slots: torch.Tensor):
        """Every layer but the last over the prompt (`layer`: `{kind: region}`, `self.layer` or their raw
        forms), each one's keys and values inserted as it finishes; of the last, only the keys and values.
        Returns the last layer's input."""
        n = slots.shape[0]
        x, cos, sin, masks = self.model.model.prepare(input_ids, kv_cache=self.kv)  # kv: each row's last token
        *layers, (last, _) = self.runs
        for i, (module, kind) in enumerate(layers):
            x, k, v = layer[kind](module, x, cos, sin, masks, self.kv, self.ops)
            cache.insert(slots, i, k[:n], v[:n])
        k, v = last.keys_values(x, cos, sin, self.ops)
        cache.insert(slots, len(layers), k[:n], v[:n])
        return x

    def finish(self, x, last_index, cache: KVCache, slots: torch.Tensor, checked: bool):
        """Each inserted row's last token (`last_index` `[b]`) through the last layer and the head, as one
        decode step of the cache's shape: the argmax and logits `[n]`, `[n, vocab]` of the rows `slots`."""
        n = slots.shape[0]
        last = take(x, last_index.view(-1, 1))[:n]  # [n, 1, hidden]
        rows = torch.zeros(cache.batch, 1, x.shape[-1], dtype=x.dtype, device=x.device)
        rows.index_copy_(0, slots, last)
        positions = torch.full((cache.batch, 1), cache.max_length - 1, dtype=torch.long, device=x.device)
        positions.index_copy_(0, slots, last_index[:n].view(-1, 1))
        argmax, logits = self.decode_for(cache).last_row(rows, positions, checked)
        return argmax.index_select(0, slots), logits.index_select(0, slots)


class ScoreRegions(GenerationRegions):
    """A scoring prefill `[b, L]` as regions (`prompt_scores.py`): every layer over the prompt with a layer
    region per kind (keys and values inserted as each finishes, as `PrefillRegions`), then the final norm
    and head over every position in one region of this shape. It does not stop a layer early: every
    position's logits are wanted. Returns `(argmax, logits, scores)` of the rows `slots`."""

    def __init__(self, model, length: int, name: str, compile_one: Callable, ops: Ops):
        super().__init__(model)
        self.ops = ops
        self.layer = layer_regions(self.kinds, prefill_layer_region, f"{name}_layer", compile_one)
        self.score_head = compile_one(score_head_region, f"{name}_head")
        self.own = list(self.layer.values()) + [self.score_head]
        self.kv = PrefillKV(length)

    def release(self) -> None:
        super().release()
        self.kv, self.score_head = None, None

    def __call__(self, input_ids, last_index, cache: KVCache, slots: torch.Tensor, checked: bool = False):
        start = time.perf_counter()
        n = slots.shape[0]
        self.kv.last_index = last_index  # what linear-attention layers count
        x, cos, sin, masks = self.model.model.prepare(input_ids, kv_cache=self.kv)
        for i, (module, kind) in enumerate(self.runs):
            x, k, v = self.layer[kind](module, x, cos, sin, masks, self.kv, self.ops, checked=checked)
            cache.insert(slots, i, k[:n], v[:n])
        argmax, logits, *scores = self.score_head(self.model, x, input_ids, last_index, self.ops, checked=checked)
        self.timed(start)
        return argmax, logits, tuple(scores)


__all__ = [
    "prepare_region",
    "layer_region",
    "routed_layer_region",
    "prefill_layer_region",
    "head_region",
    "score_head_region",
    "kept_head_region",
    "ScoreRegions",
    "ExtendRegions",
    "loss_head_region",
    "has_decoder_layout",
    "routes_logits",
    "region_name",
    "layer_regions",
    "regional_loss",
    "compile_blocks",
    "GenerationRegions",
    "DecodeRegions",
    "PrefillRegions",
]
