"""The loop's speculative step: propose, verify in one extend step, keep what each row accepts.

A `GenerationLoop` built with a `Speculator` runs `Speculator.decode(loop)` where it would run a decode
step. Design choices:

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
  token goes through the loop's `_emit`, so stop ids, `min_new_tokens` and `max_new_tokens` hold at
  every position: a row that ends cuts its accepted run there. Proposals are capped at the tokens a
  row may still produce.
- **A hybrid model's linear-attention states** (Qwen3.5's Gated DeltaNet) cannot be rewritten like positions: the
  verify step keeps each row's states after every one of its tokens (the cache's `rollback`, sized by the
  plan's verify width, `models/state_rollback.py`), and a row that accepted `a` proposals takes the states after
  its token `a`. A prefilling row's states are not counted in the step.
- **Counters** for the server's metrics: `num_draft_tokens` (proposed), `num_accepted_tokens`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ...adapters.bank import bank_of
from ..loop import TokenEvent
from ..plan import ShapePlan
from ..chunking import decoding, prefilling
from ..constraints import unpack
from ..sampling import Choice
from .acceptance import verify

logger = logging.getLogger("staticformers")


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
        return engine.warm("extend", batch, (kv, self.width, self.width), settings) and \
            self.proposer.warm(batch, kv)

    def _allowed(self, packed: Optional[torch.Tensor], n: int, vocab: int, device) -> Optional[torch.Tensor]:
        """The rows' grammar masks at position 0 (`packed`: `[n, words]`, all ones for a free row), as the
        `[n, k+1, vocab]` bool mask `verify` takes; later positions are free (a row with a grammar proposes
        nothing, so it emits position 0 only)."""
        if packed is None:
            return None
        allowed = torch.ones(n, self.width, vocab, dtype=torch.bool, device=device)
        allowed[:, 0] = unpack(packed, vocab, device)
        return allowed

    # ---- the step --------------------------------------------------------------------------------
    def decode(self, loop) -> None:
        """One speculative step of `loop` (in place of `loop._decode()`)."""
        cache = loop.cache
        slots = decoding(loop.rows)  # rows still prefilling a chunked prompt take part harmlessly, below
        rows = [loop.rows[s] for s in slots]
        if any(r.length + self.k >= cache.max_length for r in rows):
            loop._decode()  # some row lacks room for k more positions
            return
        # A row with a grammar (structured outputs, waiting for its trigger or not) gets no proposals: masks
        # at later verified positions would need its matcher advanced along each proposal and rolled back
        # (not done yet). It takes its one token at position 0 under its mask, as a decode step gives it,
        # while the other rows speculate.
        grammars = loop.constraints
        held = {s for s in slots if grammars is not None and grammars.rows[s] is not None}
        pending = grammars.start(slots) if held else None  # filled while the proposals and the step run
        histories = [list(r.request.prompt) + r.tokens for r in rows]
        limits = [0 if s in held else max(0, min(self.k, r.request.max_new_tokens - r.generated - 1))
                  for s, r in zip(slots, rows)]
        try:
            proposals, q = self.proposer.propose(histories=histories, limits=limits, loop=loop, slots=slots)
        except Exception as exc:  # a draft model's step failed: the rows of this step fail, as a decode's would
            logger.exception("speculative proposals failed for %d request(s)", len(slots))
            self._fail(loop, rows, exc)
            return
        if not any(proposals):
            if pending is not None:
                pending.result()  # the decode step fills its own
            loop._decode()
            return
        self.num_steps += 1
        self.num_draft_tokens += sum(len(p) for p in proposals)
        width = self.width
        tokens = torch.zeros(cache.batch, width, dtype=torch.long)
        positions = torch.arange(width).repeat(cache.batch, 1)
        for slot, row, p in zip(slots, rows, proposals):
            tokens[slot, 0] = row.last
            tokens[slot, 1:1 + len(p)] = torch.as_tensor(p, dtype=torch.long)
            positions[slot] += row.length
        for slot in prefilling(loop.rows):  # at its length and after: its next chunk writes there again
            positions[slot] = (positions[slot] + loop.rows[slot].length).clamp_(max=cache.max_length - 1)
        keep = torch.arange(width).repeat(cache.batch, 1)
        cache.count({s: len(p) for s, p in zip(slots, proposals)})  # a hybrid's states: up to the last proposal
        device = loop.engine.model.device
        adapters = [loop.rows[s].adapter if s in loop.rows else 0 for s in range(cache.batch)] \
            if bank_of(loop.engine.model) is not None else None
        try:
            with torch.no_grad():
                argmax, logits = loop.engine.extend(loop.settings, cache, tokens.to(device), positions.to(device),
                                                    keep.to(device), adapters, plan=loop.plan)
                if len(slots) != cache.batch:
                    index = torch.tensor(slots, dtype=torch.long).to(device)
                    argmax, logits = argmax.index_select(0, index), logits.index_select(0, index)
                loop.engine.backend.flush(device)
                steps = [r.generated for r in rows]
                allowed = self._allowed(grammars.mask(pending), len(slots), logits.shape[-1], device) \
                    if pending is not None else None
                verdict = verify(loop.sampler, logits, argmax, slots, steps, proposals, q, allowed)
                if cache.rollback is not None:  # each row's linear-attention states after its last accepted token
                    index = torch.full((cache.batch,), -1, dtype=torch.long)
                    index[slots] = torch.tensor(verdict.accepted, dtype=torch.long)
                    cache.roll_back(index.to(device))
                    loop.engine.backend.flush(device)  # a graph of its own on a lazily traced device, not the next step's
                flat_rows = [s for s, out in zip(slots, verdict.tokens) for _ in out]
                flat_ids = torch.tensor([t for out in verdict.tokens for t in out], dtype=torch.long)
                loop.sampler.observe(flat_rows, flat_ids.to(loop.sampler.device))
                choice = self._logprobs(loop, logits, slots, verdict)
        except Exception as exc:  # every running request was in this step
            logger.exception("speculative step failed for %d request(s)", len(slots))
            self._fail(loop, rows, exc)
            return
        if hasattr(self.proposer, "accepted"):
            self.proposer.accepted(rows, verdict.accepted)
        self.num_accepted_tokens += sum(verdict.accepted)
        for i, (slot, row) in enumerate(zip(slots, rows)):
            for j, token in enumerate(verdict.tokens[i]):
                row.length += 1  # the token before it is now in the cache
                event = loop._emit(slot, row, token, choice, i * width + j)
                if row.request.output_logits:
                    event.logits = logits[i, j].clone()
                if event.finish_reason is not None:
                    break

    @staticmethod
    def _fail(loop, rows: list, exc: BaseException) -> None:
        """End every running request with an error event (their slots are freed), as a failed decode does."""
        loop._events += [TokenEvent(r.request.request_id, None, r.generated, "error", error=exc) for r in rows]
        loop.rows.clear()

    @staticmethod
    def _logprobs(loop, logits: torch.Tensor, slots: list, verdict) -> Choice:
        """The emitted tokens' log-probabilities (and top ones) where a row asked, `[n * T]` row-major."""
        t = loop.sampler._table(tuple(slots))
        if t["logprobs"] is None:
            return Choice(verdict.ids.flatten())
        n, width, vocab = logits.shape
        logp = torch.log_softmax(logits.float(), dim=-1).reshape(n * width, vocab)
        ids = verdict.ids.flatten().to(logp.device)
        choice = Choice(ids, logp.gather(1, ids.view(-1, 1)).squeeze(1))
        if t["logprobs"] > 0:
            choice.top_logprobs, choice.top_ids = torch.topk(logp, t["logprobs"], dim=-1)
        return loop._to_host(choice)


__all__ = ["Speculator"]
