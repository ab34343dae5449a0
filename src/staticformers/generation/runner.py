"""Running one step: a `StepPlan` in, the engine's step run over the batch's cache, its rows masked and sampled, a
`StepResult` out.

Why a module of its own: building device inputs, calling the engine, masking by grammar, sampling and reading the
choice back are the same work for every kind of step, and the loop (which decides steps and emits their tokens),
chunked prefill and speculation each used to do it their own way (`step_plan.py` says who plans which kind).

Design choices:

- **One read-back per step.** The step's outputs stay on the device; grammar masks are filled on the host while it
  runs (`constraints.RowConstraints.start`), the sampler chooses on the device, and only the chosen ids (and
  log-probabilities when asked) cross, after the backend has run what the step queued (`to_host`: one graph on a
  lazily traced device). A step where no row chooses (a prefill of first chunks only) still runs what it queued.
- **Only the choosing rows are sampled.** A step computes every row of its shape; the rows that choose are picked
  out of its output (`StepPlan.picks`) before the sampler sees them, and only when they are not all of them.
- **Verification is sampling too.** A verify step's logits go through `speculative/acceptance.py:verify` (the
  rows' processors at every position, the rejection rule for sampling rows); a hybrid model's linear-attention
  states are then rolled back to each row's last accepted token, as the step's own device work.
- **The runner holds no rows.** The batch's cache, sampler and grammars are passed in; an exception propagates to
  the caller, which knows whose requests it ends (`StepPlan.fails`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..models.kv_cache import KVCache
from .constraints import RowConstraints, unpack
from .engine import CompileSettings, Engine
from .plan import ShapePlan
from .sampling import Choice, RowSampler
from .speculative.acceptance import verify
from .step_plan import StepPlan, StepResult


class StepRunner:
    """Runs the steps of one loop's engine, settings and shape plan (see the module docstring)."""

    def __init__(self, engine: Engine, settings: CompileSettings, plan: ShapePlan):
        self.engine, self.settings, self.plan = engine, settings, plan

    @property
    def device(self) -> torch.device:
        return self.engine.model.device

    def run(self, step: StepPlan, cache: KVCache, sampler: RowSampler, constraints: RowConstraints) -> StepResult:
        """Run `step` over `cache` (its rows' sampling in `sampler`, grammars in `constraints`)."""
        if step.counts is not None:
            cache.count(step.counts)
        if step.kind == "verify":
            return self._verify(step, cache, sampler, constraints)
        pending = constraints.start(step.choosing)  # the host fills the masks while the device computes
        scores = None
        with torch.no_grad():
            if step.kind == "prefill":
                out = self.engine.prefill(
                    self.settings, step.tokens, cache, step.slots, self.plan, step.adapters, scores=step.scores
                )
                argmax, logits = out[:2]
                scores = out[2] if step.scores else None
            elif step.kind == "decode":
                tokens, positions, _ = self._inputs(step)
                argmax, logits = self.engine.decode(self.settings, cache, tokens, positions, step.adapters)
            else:  # a chunk: one kept position per row
                argmax, logits = self.engine.extend(
                    self.settings, cache, *self._inputs(step), step.adapters, plan=self.plan
                )
                argmax, logits = argmax[:, 0], logits[:, 0]
            if not step.choosing:
                self.engine.backend.flush(self.device)
                return StepResult([], prompt_scores=[])
            allowed = constraints.mask(pending)
            if len(step.picks) != logits.shape[0]:
                index = torch.tensor(step.picks, dtype=torch.long).to(logits.device)
                argmax = argmax.index_select(0, index)
                if step.kind != "decode" or allowed is not None or sampler.needs_logits(step.choosing):
                    logits = logits.index_select(0, index)
                    picked = None
                else:  # greedy rows choose by the graph's argmax: their logits are picked only if a request asks
                    picked = index
            else:
                picked = None
            choice = sampler.choose(logits, argmax, step.choosing, step.steps, allowed)
            sampler.observe(step.choosing, choice.ids)
        choice = self.to_host(choice)
        rows = logits if picked is None else _Picked(logits, picked)
        prompt_scores = _prompt_scores(step, scores) if scores is not None else [None] * len(step.choosing)
        return StepResult([[t] for t in choice.ids.tolist()], choice, 1, rows, prompt_scores)

    def _verify(self, step: StepPlan, cache: KVCache, sampler: RowSampler, constraints: RowConstraints) -> StepResult:
        """The verify step: the target's logits at every position of every decoding row, each row's accepted run."""
        slots, width = step.choosing, step.width
        held = [s for s in slots if constraints.rows[s] is not None]
        pending = constraints.start(slots) if held else None  # filled while the step runs
        device = self.device
        with torch.no_grad():
            argmax, logits = self.engine.extend(
                self.settings, cache, *self._inputs(step), step.adapters, plan=self.plan
            )
            if len(slots) != cache.batch:
                index = torch.tensor(slots, dtype=torch.long).to(device)
                argmax, logits = argmax.index_select(0, index), logits.index_select(0, index)
            self.engine.backend.flush(device)
            allowed = (
                _position_zero_mask(constraints.mask(pending), len(slots), width, logits.shape[-1], device)
                if pending is not None
                else None
            )
            verdict = verify(sampler, logits, argmax, slots, step.steps, step.proposals, step.draft_probs, allowed)
            if cache.rollback is not None:  # each row's linear-attention states after its last accepted token
                index = torch.full((cache.batch,), -1, dtype=torch.long)
                index[slots] = torch.tensor(verdict.accepted, dtype=torch.long)
                cache.roll_back(index.to(device))
                self.engine.backend.flush(device)  # a graph of its own on a lazily traced device, not the next step's
            flat_rows = [s for s, out in zip(slots, verdict.tokens) for _ in out]
            flat_ids = torch.tensor([t for out in verdict.tokens for t in out], dtype=torch.long)
            sampler.observe(flat_rows, flat_ids.to(sampler.device))
            choice = self._verified_logprobs(sampler, logits, slots, verdict)
        return StepResult(verdict.tokens, choice, width, logits, [None] * len(slots), list(verdict.accepted))

    def _inputs(self, step: StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode, chunk or verify plan's tokens, positions and kept positions on the device (a decode step keeps
        its one position: its `keep` is unused)."""
        if step.positions is None or (step.keep is None and step.kind != "decode"):
            raise ValueError(
                f"a {step.kind} StepPlan needs its positions{'' if step.kind == 'decode' else ' and keep'}."
            )
        keep = step.keep if step.keep is not None else step.positions
        return step.tokens.to(self.device), step.positions.to(self.device), keep.to(self.device)

    def _verified_logprobs(self, sampler: RowSampler, logits: torch.Tensor, slots: list, verdict) -> Choice:
        """The emitted tokens' log-probabilities (and top ones) where a row asked, `[n * T]` row-major."""
        asked = sampler.logprobs_asked(slots)
        if asked is None:
            return Choice(verdict.ids.flatten())
        n, width, vocab = logits.shape
        logp = torch.log_softmax(logits.float(), dim=-1).reshape(n * width, vocab)
        ids = verdict.ids.flatten().to(logp.device)
        choice = Choice(ids, logp.gather(1, ids.view(-1, 1)).squeeze(1))
        if asked > 0:
            choice.top_logprobs, choice.top_ids = torch.topk(logp, asked, dim=-1)
        return self.to_host(choice)

    def to_host(self, choice: Choice) -> Choice:
        """The step's results on the host, the only thing a step reads back: the device first runs what the
        step queued (`flush`: one graph on a lazily traced device), then the ids (and logprobs) cross."""
        self.engine.backend.flush(self.device)
        rest = (t.cpu() if t is not None else None for t in (choice.logprobs, choice.top_ids, choice.top_logprobs))
        return Choice(choice.ids.cpu(), *rest)


class _Picked:
    """A decode step's logits of the choosing rows, picked only when a request reads them (`output_logits`):
    `[i]` is choosing row i's `[vocab]`, and `[i, j]` its position j (0)."""

    def __init__(self, logits: torch.Tensor, index: torch.Tensor):
        self.logits, self.index = logits, index

    def __getitem__(self, key):
        i = key[0] if isinstance(key, tuple) else key
        return self.logits[int(self.index[i])]


def _position_zero_mask(
    packed: Optional[torch.Tensor], n: int, width: int, vocab: int, device
) -> Optional[torch.Tensor]:
    """The rows' grammar masks at position 0 (`packed`: `[n, words]`, all ones for a free row), as the
    `[n, k+1, vocab]` bool mask `verify` takes; later positions are free (a row with a grammar proposes
    nothing, so it emits position 0 only)."""
    if packed is None:
        return None
    allowed = torch.ones(n, width, vocab, dtype=torch.bool, device=device)
    allowed[:, 0] = unpack(packed, vocab, device)
    return allowed


def _prompt_scores(step: StepPlan, scored: tuple) -> list:
    """Each choosing row's prompt log-probabilities (`TokenEvent.prompt_logprobs`), None where not asked:
    `step.scored[j]` the number of top entries prefill row j asked for (None: none)."""
    token_lp, top_lp, top_ids = scored
    asked_rows = [step.picks[i] for i in range(len(step.choosing))]
    lengths = [len(step.tokens[j]) for j in asked_rows]
    longest = max(lengths)
    k = max((step.scored[j] or 0) for j in asked_rows)
    token_lp = token_lp[:, :longest].tolist()
    top_lp, top_ids = top_lp[:, :longest, :k].tolist(), top_ids[:, :longest, :k].tolist()
    out: list = []
    for j, n in zip(asked_rows, lengths):
        asked = step.scored[j]
        if asked is None:
            out.append(None)
            continue
        out.append(
            [None] + [(token_lp[j][p], list(zip(top_ids[j][p][:asked], top_lp[j][p][:asked]))) for p in range(1, n)]
        )
    return out


__all__ = ["StepRunner"]
