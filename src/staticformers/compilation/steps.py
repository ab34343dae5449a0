"""The step functions the generation engine runs: prefill and decode of one declared shape, as whole-model
graphs (what every device can run; a backend may supply others, `staticformers.backends`).

- **prefill** `[batch, prompt]`: the prompts at the start of their rows, padding after them (masked by
  causality: a real token never looks right). It returns the argmax and logits at each row's last
  token (`last_index`; the model's last layer computes its output there only) and every layer's keys
  and values over the prompt bucket, which `PrefillStep` then inserts into the rows (slots) of the
  batch's static cache. The graph depends on `[batch, prompt]` alone, not on the KV length.
- **score** `[batch, prompt]`: a prefill that also returns the prompt's log-probabilities and top
  tokens at every position (`prompt_scores.py`): the head runs over every position, so it is a step
  kind of its own, built and compiled when scoring is asked for; its cache insert is the prefill's.
- **decode** `[batch, 1]` over a `[batch, KV]` static cache: each row's token at its own position; the
  cache is written in place at those positions and attention masked from them (`models/kv_cache.py`).
- **extend** `[batch, T]` over a `[batch, KV]` static cache: T tokens per row at that row's positions
  (written in place like decode's, each attending to its row's cache up to itself), returning the
  argmax and logits at `n` kept positions per row (`keep_index` `[batch, n]`): a speculative step's
  verification (every position kept) or a chunk of a long prompt (its last token kept).

A step answers like a compiled function (`graphs`, `compile_seconds`, `first_call_seconds`,
`release`; `uses`: the engine's shared functions it calls) so the engine reports every step the same
way, whatever a backend built.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .compiler import CompiledFunction
from .prompt_scores import prompt_scores
from ..models.ops import PLAIN, Ops
from ..models.kept_positions import take
from ..models.kv_cache import KVCache, PrefillKV


def whole_prefill(model, length: int, ops: Ops = PLAIN) -> Callable:
    """`prefill(input_ids [b, length], last_index [b]) -> (argmax, logits, keys, values)`."""
    layers = model.config.num_hidden_layers

    def prefill(input_ids, last_index):
        kv = PrefillKV(length, layers, last_index)
        logits = model(
            input_ids=input_ids, kv_cache=kv, keep_index=last_index.view(-1, 1), ops=ops, output_router_logits=False
        ).logits[:, -1]  # a mixture's routing statistics: not wanted here
        return logits.argmax(-1), logits, tuple(kv.keys), tuple(kv.values)

    return prefill


def whole_score(model, length: int, ops: Ops = PLAIN) -> Callable:
    """`score(input_ids [b, length], last_index [b]) -> (argmax, logits, keys, values, token_logprobs,
    top_logprobs, top_ids)`: a prefill with the prompt's scores (`prompt_scores.py`)."""
    layers = model.config.num_hidden_layers

    def score(input_ids, last_index):
        kv = PrefillKV(length, layers, last_index)
        every = model(input_ids=input_ids, kv_cache=kv, ops=ops, output_router_logits=False).logits
        logits = take(every, last_index.view(-1, 1))[:, -1]
        return (logits.argmax(-1), logits, tuple(kv.keys), tuple(kv.values)) + prompt_scores(every, input_ids)

    return score


def whole_decode(model, cache: KVCache, ops: Ops = PLAIN) -> Callable:
    """`decode(input_ids [b, 1], position_ids [b, 1]) -> (argmax, logits)` over `cache`."""

    def decode(input_ids, position_ids):
        logits = model(
            input_ids=input_ids, position_ids=position_ids, kv_cache=cache, ops=ops, output_router_logits=False
        ).logits[:, -1]
        return logits.argmax(-1), logits

    return decode


def whole_extend(model, cache: KVCache, ops: Ops = PLAIN) -> Callable:
    """`extend(input_ids [b, T], position_ids [b, T], keep_index [b, n]) -> (argmax [b, n], logits [b, n, vocab])`
    over `cache`."""

    def extend(input_ids, position_ids, keep_index):
        logits = model(
            input_ids=input_ids,
            position_ids=position_ids,
            kv_cache=cache,
            keep_index=keep_index,
            ops=ops,
            output_router_logits=False,
        ).logits
        return logits.argmax(-1), logits

    return extend


class Step:
    """One step function for one shape: eager (`compiled` None) or compiled; reports its graphs."""

    def __init__(self, fn: Callable, compiled: Optional[CompiledFunction]):
        self.fn, self.compiled = fn, compiled

    uses: tuple = ()  # compiled functions of the engine's that this step shares with others

    @property
    def own(self) -> list[CompiledFunction]:
        """The compiled functions this step owns (shared ones are the engine's)."""
        return [self.compiled] if self.compiled is not None else []

    @property
    def graphs(self) -> int:
        return sum(f.graphs for f in self.own)

    @property
    def compile_seconds(self) -> float:
        return sum(f.compile_seconds for f in self.own)

    @property
    def first_call_seconds(self) -> float:
        return self.compiled.first_call_seconds if self.compiled is not None else 0.0

    def release(self) -> None:
        for f in self.own:
            f.release()
        self.fn = self.compiled = None

    def run(self, *args, checked: bool = False):
        if self.compiled is None:
            return self.fn(*args)
        return self.compiled(*args, checked=checked)


class PrefillStep(Step):
    """A whole prefill graph, then its keys and values inserted into the cache rows `slots`."""

    def __call__(self, input_ids, last_index, cache: KVCache, slots: torch.Tensor, checked: bool = False):
        argmax, logits, keys, values = self.run(input_ids, last_index, checked=checked)
        n = slots.shape[0]  # the rows after them fill the batch bucket
        for i, (k, v) in enumerate(zip(keys, values)):
            cache.insert(slots, i, k[:n], v[:n])
        return argmax, logits


class ScoreStep(Step):
    """A whole scoring prefill graph (`whole_score`), its keys and values inserted as `PrefillStep`'s;
    returns `(argmax, logits, scores)`, `scores` the prompt's `(token_logprobs, top_logprobs, top_ids)`."""

    def __call__(self, input_ids, last_index, cache: KVCache, slots: torch.Tensor, checked: bool = False):
        argmax, logits, keys, values, *scores = self.run(input_ids, last_index, checked=checked)
        n = slots.shape[0]
        for i, (k, v) in enumerate(zip(keys, values)):
            cache.insert(slots, i, k[:n], v[:n])
        return argmax, logits, tuple(scores)


class DecodeStep(Step):
    """A whole decode graph over its cache. `cuda_graphs`: the graph is replayed from a CUDA graph, whose
    outputs the next replay overwrites; each step is marked as a new one (the caller reads the outputs
    before the next step)."""

    def __init__(self, fn: Callable, compiled: Optional[CompiledFunction], cache: KVCache, cuda_graphs: bool = False):
        super().__init__(fn, compiled)
        self.cache, self.cuda_graphs = cache, cuda_graphs

    def __call__(self, input_ids, position_ids, checked: bool = False):
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self.run(input_ids, position_ids, checked=checked)

    def release(self) -> None:
        super().release()
        self.cache = None


class ExtendStep(DecodeStep):
    """A whole extend graph over its cache: `(input_ids [B, T], position_ids [B, T], keep_index [B, n])`."""

    def __call__(self, input_ids, position_ids, keep_index, checked: bool = False):
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self.run(input_ids, position_ids, keep_index, checked=checked)
