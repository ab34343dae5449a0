"""Chunked prefill on fixed slots: a prompt runs as chunks of C tokens at its row's own positions, in steps that
also give every decoding row its next token.

Why this exists: one long prefill used to stall every running row for its whole length, and a prompt longer
than the largest prompt bucket could not run at all. With a chunk width C (`chunked_prefill=C` on the loop,
`--max-num-batched-tokens` in the server):

- A joining prompt longer than C has its first C tokens prefilled as usual (the plan's `[b, L]` prefill,
  the token it would give dropped) and the rest, C tokens at a time, through the engine's **extend step**
  with `T = C`, `n = 1`: chunk k writes positions `s..s+C-1` of the row (s = what the row holds so far) and
  attends to everything before it; the logits come back at the chunk's last real token only, and the
  last chunk's choose the first new token. A prompt whose prefix came from the prefix cache
  (`prefix_cache.py`) starts its chunks after the copied blocks. Every chunk is one `[B, C]` extend graph of
  the batch's cache, a shape the plan declares (`ShapePlan(extend_widths=((C, 1),))`): no new shape for
  any prompt length up to `max_model_len`.
- **A chunk budget** (`ShapePlan(chunk_tokens=N)`, the server's `--max-num-batched-tokens`) declares one width per
  batch bucket instead: a step of batch bucket B chunks `N // B` tokens a row (at most the largest prompt bucket),
  and a joining prefill's first chunk is the budget over the bucket of the rows it may take. So every chunk step
  computes at most N tokens, and fewer rows chunk wider (`loop.py` passes `chunked_prefill=True`; a width passed
  as a number is every batch's).
- **Every prefilling row advances in the same call.** The step is `[B, C]` whatever the number of rows that
  chunk, so every row with prompt left takes its next chunk in it.
- **Every decoding row decodes in it too.** A decoding row feeds its last token at position 0 of its row of the
  step, at its next cache position, with its logits kept there: the token it chooses is the one a decode step
  would have given it, and a chunk step is a decode step for it. Its other positions, and those after a last
  chunk's tokens, repeat its last token at its last position: the copies compute what that token computes (the
  mask is by position) and write the same keys and values in the same place, so a step writes nothing past a
  row's tokens, even when its last position is K-1. The steps a long prompt takes are therefore not stalls: the
  rows already decoding take a token from each of them, instead of waiting for a decode step between chunks.
- **On block caches the chunks run apart** (`chunk_apart_plan`): a step of the whole batch computes a chunk's
  width for every decoding row to keep one token, while a block cache can run any subset of rows as a view of
  its pool. So the prefilling rows run alone, row i of a view of the smallest batch and KV buckets that hold them
  (shapes the plan already has), after a decode step of the batch in the same loop step; the mixed step stays
  where that view would be the batch's own shape.
- **Bounded inter-token latency.** A running row waits at most one chunk of prompt work per token: a chunk step
  gives it a token, and after an admission's prefill the next step is a decode step (`scheduler.py`'s step rule).
- A row is *prefilling* while `row.length < len(prompt)`; the decode step leaves it out (it takes part at
  its length, harmlessly, like a free slot).
- **A hybrid model's linear-attention state** (Qwen3.5's Gated DeltaNet) is carried from chunk to chunk in the
  cache: each chunk starts from the row's state and leaves the state after its last real token; a decoding row's
  state counts its one token. Free slots, and the padding after a last chunk or a decoding row's token, are not
  counted (`KVCache.count`), so their states stay as they were; likewise a decode step does not count a
  prefilling row.
"""

from __future__ import annotations

from typing import Optional

import torch

from .plan import PlanError, ShapePlan
from .step_plan import StepPlan


def chunk_width(plan: ShapePlan, width: Optional[int]) -> int:
    """The extend width the loop chunks with: `width`, checked against the plan, or (None) the widest the
    plan declares with one kept position, or with a chunk budget its widest chunk (a batch of 1's; each chunk step
    then runs its batch's width, `ShapePlan.chunk_width_at`). Refuses a plan without one, in one sentence."""
    declared = [t for t, n in getattr(plan, "extend_widths", ()) if n == 1]
    if width is None:
        if getattr(plan, "chunk_tokens", None) is not None:
            return plan.chunk_width_at(plan.batch_sizes[0])
        if not declared:
            raise PlanError(
                "Chunked prefill and prefix caching run the rest of a prompt through the extend step, "
                "and this plan declares no extend width with one kept position: pass "
                "ShapePlan(extend_widths=((C, 1),)) with a chunk width C."
            )
        return max(declared)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise PlanError(f"chunked_prefill={width!r} must be a positive chunk width in tokens.")
    if width not in declared:
        raise PlanError(
            f"chunked_prefill={width}: the plan declares no extend width ({width}, 1) (it declares "
            f"{list(getattr(plan, 'extend_widths', ()))}): add it to ShapePlan(extend_widths=...)."
        )
    if width > plan.prompt_lengths[-1]:
        raise PlanError(
            f"chunked_prefill={width} is wider than the largest prompt bucket "
            f"({plan.prompt_lengths[-1]}), which prefills a prompt's first chunk: lower it."
        )
    return width


DEFAULT_BATCHED_TOKENS = 512


def serving_chunk_tokens(plan: ShapePlan, max_num_batched_tokens: Optional[int]) -> int:
    """The server's chunk budget from `--max-num-batched-tokens` (vLLM's name: the tokens one step computes,
    default 512), checked against the plan. An extend step computes `[B, C]` tokens, so a chunk step of batch
    bucket B runs chunks of the budget over B, at most the largest prompt bucket (which prefills a prompt's first
    chunk): `ShapePlan(chunk_tokens=...)`."""
    budget = DEFAULT_BATCHED_TOKENS if max_num_batched_tokens is None else int(max_num_batched_tokens)
    largest = plan.batch_sizes[-1]
    if budget < largest:
        raise PlanError(
            f"--max-num-batched-tokens {budget} is less than the largest batch bucket ({largest}): a chunk "
            f"step computes a chunk for every row, so give at least one token per row."
        )
    return budget


def widest_steps(plan: ShapePlan, width: Optional[int], budgeted: bool):
    """A row's widest steps after its prefill, for sizing a window layers' pool (`kv_blocks.window_pool_blocks`):
    with the plan's chunk budget, `(B, its width at B)` for each batch bucket B (B rows chunk that wide together);
    else `width` for every row (None: no chunks, 1)."""
    if budgeted and plan.chunk_tokens is not None:
        return tuple((b, plan.chunk_width_at(b)) for b in plan.batch_sizes)
    return width or 1


def positions_needed(plan: ShapePlan, prompt_len: int, max_new_tokens: int, chunked: bool) -> int:
    """`plan.positions_needed`, except that a chunked prompt may be longer than the largest prompt bucket
    (it never runs as one prefill): only `max_model_len` and the largest KV length bound it."""
    if not chunked or prompt_len <= plan.prompt_lengths[-1]:
        return plan.positions_needed(prompt_len, max_new_tokens)
    total = prompt_len + max_new_tokens
    if total > plan.max_model_len:
        raise PlanError(
            f"The prompt has {prompt_len} token{'s' if prompt_len != 1 else ''} and max_new_tokens={max_new_tokens}: {total} positions exceed "
            f"max_model_len={plan.max_model_len}; lower max_new_tokens to at most "
            f"{max(plan.max_model_len - prompt_len, 0)} or raise max_model_len."
        )
    need = prompt_len + max_new_tokens - 1
    if need > plan.kv_lengths[-1]:
        raise PlanError(
            f"The prompt has {prompt_len} token{'s' if prompt_len != 1 else ''} and max_new_tokens={max_new_tokens} needs {need} cache "
            f"positions, more than the largest KV length ({plan.kv_lengths[-1]}): lower max_new_tokens to at "
            f"most {plan.kv_lengths[-1] - prompt_len + 1} or add a larger KV length to the plan."
        )
    return need


def prefilling(rows: dict) -> list[int]:
    """The slots whose prompt is not all in the cache yet."""
    return sorted(s for s, r in rows.items() if r.length < len(r.prompt))


def decoding(rows: dict) -> list[int]:
    """The slots whose prompt is in the cache (they take part in decode steps)."""
    return sorted(s for s, r in rows.items() if r.length >= len(r.prompt))


def chunk_inputs(rows: dict, batch: int, kv: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """The extend step's host inputs over a `[batch, kv]` cache: tokens, positions `[B, C]`, keep `[B, 1]`, and each
    prefilling slot's chunk length. A prefilling row runs its next chunk, a decoding row its last token; every
    position after a row's own repeats its last token at its last position. The copies compute what that token
    computes (the mask is by position) and write the same keys and values in the same place, so the step writes
    nothing past a row's tokens: padding clamped to the KV length used to land on a last position at K-1 and
    overwrite it. A free row writes position 0 (its own row, or on block caches the null block)."""
    tokens = torch.zeros(batch, width, dtype=torch.long)
    positions = torch.zeros(batch, width, dtype=torch.long)
    keep = torch.zeros(batch, 1, dtype=torch.long)
    taken = {}
    for slot, row in rows.items():
        chunk = row.length < len(row.prompt)
        piece = row.prompt[row.length : row.length + width] if chunk else [row.last]
        n = len(piece)
        if row.length + n > kv:
            raise ValueError(
                f"a chunk step over a KV length of {kv} cannot hold row {slot}'s tokens at positions "
                f"{row.length}..{row.length + n - 1}: the batch must move to a longer KV length first."
            )
        tokens[slot, :n] = torch.as_tensor(piece, dtype=torch.long)
        tokens[slot, n:] = piece[-1]
        positions[slot, :n] = torch.arange(row.length, row.length + n)
        positions[slot, n:] = row.length + n - 1
        keep[slot, 0] = n - 1
        if chunk:
            taken[slot] = n
    return tokens, positions, keep, taken


def chunk_progress(rows: dict, taken: dict) -> tuple[list, dict]:
    """Of a chunk step's prefilling rows (`rows` {row of the step: row}, `taken` {row of the step: tokens its chunk
    takes}): the ones whose prompt the chunk finishes, in order, and what each one's linear-attention state counts
    (its chunk only: `KVCache.count`)."""
    done = [i for i in sorted(taken) if rows[i].length + taken[i] >= len(rows[i].prompt)]
    return done, {i: n - 1 for i, n in taken.items()}


def chunk_plan(rows: dict, batch: int, kv: int, width: int, adapters: Optional[list]) -> StepPlan:
    """The extend step of the next chunk of every prefilling row of `rows` {slot: row} over a `[batch, kv]` cache, in
    which every decoding row takes its next token: its last token at position 0 of its row of the step, kept there
    (`runner.py` runs the plan). A row whose prompt the chunk finishes chooses its first token. If the step fails,
    every row fails: each one's tokens were in it."""
    tokens, positions, keep, taken = chunk_inputs(rows, batch, kv, width)
    chunking = sorted(taken)
    decoding_rows = decoding(rows)  # their last token at their next position, kept: a decode step's token
    done, counts = chunk_progress(rows, taken)
    choosing = sorted(done + decoding_rows)
    counts.update({s: 0 for s in decoding_rows})  # a decoding row counts its one token
    return StepPlan(
        "chunk",
        sorted(chunking + decoding_rows),
        choosing,
        choosing,
        [rows[s].generated for s in choosing],
        tokens,
        positions,
        keep,
        adapters,
        counts=counts,
        advance={**taken, **{s: 1 for s in decoding_rows}},
        fails=sorted(rows),
        completes=done,
    )


def chunk_apart_plan(rows: dict, plan, width_at, adapters: Optional[dict], own: tuple) -> Optional[StepPlan]:
    """The next chunk of every prefilling row of `rows` {slot: row} in a step of their own (block caches): row i of
    the step is the i-th prefilling slot, over a view of the pool of the smallest batch and KV buckets that hold
    them (`StepPlan.view`), so the decoding rows decode in their own step and the chunk computes no padded row; its
    chunks are `width_at(batch)` wide (with a chunk budget, the budget over the view's batch).
    `adapters`: each slot's adapter bank slot (None: the model batches none). If the step fails, its rows fail.
    None when the view would be `own`, the batch's own shape (the mixed step runs instead)."""
    chunking = prefilling(rows)
    apart = {i: rows[s] for i, s in enumerate(chunking)}
    batch = plan.batch_bucket(len(chunking))
    width = width_at(batch)
    kv = plan.kv_bucket(max(min(len(r.prompt), r.length + width) for r in apart.values()))
    if (batch, kv) == tuple(own):
        return None
    tokens, positions, keep, taken = chunk_inputs(apart, batch, kv, width)
    done, counts = chunk_progress(apart, taken)
    choosing = [chunking[i] for i in done]
    return StepPlan(
        "chunk",
        chunking,
        choosing,
        done,
        [rows[s].generated for s in choosing],
        tokens,
        positions,
        keep,
        None if adapters is None else [adapters[s] for s in chunking] + [0] * (batch - len(chunking)),
        counts=counts,
        advance={chunking[i]: n for i, n in taken.items()},
        fails=chunking,
        completes=choosing,
        view=(batch, kv),
    )


__all__ = [
    "serving_chunk_tokens",
    "chunk_width",
    "widest_steps",
    "positions_needed",
    "prefilling",
    "decoding",
    "chunk_inputs",
    "chunk_progress",
    "chunk_plan",
    "chunk_apart_plan",
]
