"""The loop's speculative step: propose, verify in one extend step, keep what each row accepts.

A `GenerationLoop` built with a `Speculator` asks `Speculator.plan_verify(loop)` for a verify step where it would
run a decode step, and the loop's `runner.py:StepRunner` runs it (the acceptance is sampling, `acceptance.py`).
Design choices:

- **One verify shape.** Every row feeds `[last, d_1 .. d_k]` at positions `length .. length + k` of its
  own row, padded when it has fewer proposals; the target runs the extend step `[B, k+1]` with logits at
  every position (`Engine.extend`, `n = k+1`), declared in the plan (`plan_for`) and compiled ahead like
  every other shape.
- **Rejected tokens cost no copy.** The keys and values of all k+1 tokens are written; a row that
  accepted `a` proposals advances its length by `a + 1`, so the positions past it are simply written
  again by the next step, before anything attends to them (attention is causal by position).
- **The KV need grows by k** (`need`): a verify writes up to k positions past the row's last accepted
  one. It is capped at the plan's largest KV length; a step where some row has fewer than k positions
  left in the cache is a plain decode step instead, as is a step where no row has a proposal (the
  `[B, 1]` decode graph is in the plan too, and cheaper).
- **Exactness per row** (`acceptance.py`): greedy rows emit the tokens they would emit without
  speculation; sampling rows keep the target's distribution by the rejection rule. Each accepted
  token is emitted by the loop as a decode step's is, so stop ids, `min_new_tokens` and `max_new_tokens` hold at
  every position: a row that ends cuts its accepted run there. Proposals are capped at the tokens a
  row may still produce.
- **A hybrid model's linear-attention states** (Qwen3.5's Gated DeltaNet) cannot be rewritten like positions: the
  verify step keeps each row's states after every one of its tokens (the cache's `rollback`, sized by the
  plan's verify width, `models/state_rollback.py`), and a row that accepted `a` proposals takes the states after
  its token `a`. A prefilling row's states are not counted in the step.
- **Counters** for the server's metrics: `num_draft_tokens` (proposed), `num_accepted_tokens`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...adapters.bank import bank_of
from ..chunking import decoding, prefilling
from ..plan import ShapePlan
from ..step_plan import StepPlan


class Speculator:
    """Speculative decoding for one loop (see the module docstring); `proposer`: a `PromptLookup` or a
    `DraftModel`, which knows its k."""

    def __init__(self, proposer: Any):
        self.proposer = proposer
        self.k = int(proposer.k)
        self.num_draft_tokens = 0  # proposed
        self.num_accepted_tokens = 0
        self.num_steps = 0  # verify steps run

    @property
    def width(self) -> int:
        return self.k + 1

    # ---- what the loop asks before it runs ----------------------------------------------------------
    def plan_for(self, plan: ShapePlan) -> ShapePlan:
        """`plan` with the verify step's extend width `(k+1, k+1)` (every position's logits)."""
        return plan.with_extend_widths((self.width, self.width))

    def need(self, need: int, plan: ShapePlan) -> int:
        """A row's cache positions with speculation: k more, up to the plan's largest KV length."""
        return min(need + self.k, plan.kv_lengths[-1])

    def warm(self, engine, batch: int, kv: int, settings) -> bool:
        """Whether a batch may move to `(batch, kv)` without compiling: its verify step is built, and the
        proposer's own steps."""
        return engine.warm("extend", batch, (kv, self.width, self.width), settings) and self.proposer.warm(batch, kv)

    # ---- the step --------------------------------------------------------------------------------
    def plan_verify(self, loop) -> Optional[StepPlan]:
        """The verify step of `loop`'s decoding rows (`runner.py` runs it), or None where a plain decode step
        should run: some row lacks room for k more positions, or no row has a proposal. Reads the loop's public
        state only (`rows`, `cache`, `constraints`, `engine`); a proposer's failure propagates (the loop fails the
        step's rows)."""
        cache = loop.cache
        slots = decoding(loop.rows)  # rows still prefilling a chunked prompt take part harmlessly, below
        rows = [loop.rows[s] for s in slots]
        if any(r.length + self.k >= cache.max_length for r in rows):
            return None
        # A row with a grammar (structured outputs, waiting for its trigger or not) gets no proposals: masks
        # at later verified positions would need its matcher advanced along each proposal and rolled back
        # (not done yet). It takes its one token at position 0 under its mask, as a decode step gives it,
        # while the other rows speculate.
        grammars = loop.constraints
        held = {s for s in slots if grammars is not None and grammars.rows[s] is not None}
        histories = [list(r.request.prompt) + r.tokens for r in rows]
        limits = [
            0 if s in held else max(0, min(self.k, r.request.max_new_tokens - r.generated - 1))
            for s, r in zip(slots, rows)
        ]
        proposals, q = self.proposer.propose(histories=histories, limits=limits, loop=loop, slots=slots)
        if not any(proposals):
            return None
        self.num_steps += 1
        self.num_draft_tokens += sum(len(p) for p in proposals)
        width = self.width
        tokens = torch.zeros(cache.batch, width, dtype=torch.long)
        positions = torch.arange(width).repeat(cache.batch, 1)
        for slot, row, p in zip(slots, rows, proposals):
            tokens[slot, 0] = row.last
            tokens[slot, 1 : 1 + len(p)] = torch.as_tensor(p, dtype=torch.long)
            positions[slot] += row.length
        for slot in prefilling(loop.rows):  # at its length and after: its next chunk writes there again
            positions[slot] = (positions[slot] + loop.rows[slot].length).clamp_(max=cache.max_length - 1)
        keep = torch.arange(width).repeat(cache.batch, 1)
        adapters = (
            [loop.rows[s].adapter if s in loop.rows else 0 for s in range(cache.batch)]
            if bank_of(loop.engine.model) is not None
            else None
        )
        return StepPlan(
            "verify",
            slots,
            slots,
            slots,
            [r.generated for r in rows],
            tokens,
            positions,
            keep,
            adapters,
            counts={s: len(p) for s, p in zip(slots, proposals)},  # a hybrid's states: to the last proposal
            fails=sorted(loop.rows),
            proposals=proposals,
            draft_probs=q,
        )

    def verified(self, rows: list, accepted: list) -> None:
        """Count what a verify step's `rows` (the plan's choosing rows) accepted, and tell the proposer."""
        if hasattr(self.proposer, "accepted"):
            self.proposer.accepted(rows, accepted)
        self.num_accepted_tokens += sum(accepted)


__all__ = ["Speculator"]
