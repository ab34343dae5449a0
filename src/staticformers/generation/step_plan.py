"""What one generation step runs and what it gave back, as plain data: the seam between deciding a step and running it.

Why a module of its own: the loop used to decide a step, build its device inputs, run it, sample and emit in one
place, and chunked prefill and speculation reached into its private members to do the same. Now whoever decides a
step (the loop's admission, `chunking.chunk_plan`, `speculative/step.py:Speculator.plan_verify`) describes it as a
`StepPlan`; `runner.py:StepRunner` turns it into device inputs, runs the engine's step, masks and samples, and
returns a `StepResult`; the loop applies the result to its rows and emits their tokens. Nothing here holds a device
tensor of the batch's state: the plan's tensors are host inputs, the result's `logits` the step's output rows.

The kinds, each one shape of the plan:

- `"prefill"`: the prompts (or first chunks) of joining rows, `tokens` one list per row of `slots`, in that order.
- `"chunk"`: the next chunk of every prefilling row through the extend step `[B, C]`, one kept position per row; every
  decoding row feeds its last token at position 0 of its row of the step and takes its next token from it, as a
  decode step would give it (a row's positions after its tokens repeat its last token at its last position). On
  block caches the prefilling rows may instead run apart, over a view of the pool of their own batch and KV
  buckets (`view`), while the decoding rows take a decode step.
- `"decode"`: one token per row `[B, 1]`.
- `"verify"`: every decoding row's last token and up to k proposals `[B, k+1]`, every position's logits kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .sampling import Choice

KINDS = ("prefill", "chunk", "decode", "verify")


@dataclass
class StepPlan:
    """One step to run.

    `slots`: the rows whose tokens the step computes (a prefill's in the order of `tokens`). `choosing`: the rows
    that choose tokens from its logits, in the order of the result; `picks` where each one's logits are among the
    step's output rows (a prefill's, or a step run apart on a `view`: its index in `slots`; otherwise its slot);
    `steps`: the tokens each choosing row has generated so far (sampling's step). `advance`: the cache positions
    the step writes per row, applied before its tokens are emitted (a verify step's rows advance by each token they
    emit instead). `completes`: the rows whose prompt the step finishes (their prompt's blocks may be kept for
    prefix caching). `fails`: the rows that end with an error if the step raises. `counts`: what each row of the
    step's cache counts in its linear-attention state (`KVCache.count`; None: not set)."""

    kind: str
    slots: list
    choosing: list
    picks: list
    steps: list
    tokens: Any = None  # prefill: a list of token lists; otherwise `[B, T]` int64 on the host
    positions: Optional[torch.Tensor] = None  # `[B, T]` int64 on the host (not a prefill's)
    keep: Optional[torch.Tensor] = None  # `[B, n]` positions whose logits come back (chunk, verify)
    adapters: Optional[list] = None  # each computed row's adapter bank slot (None: the model batches none)
    counts: Optional[dict] = None
    advance: dict = field(default_factory=dict)
    completes: list = field(default_factory=list)
    fails: list = field(default_factory=list)
    scores: bool = False  # a prefill that also scores its prompts
    scored: list = field(default_factory=list)  # per prefill row: whether its request wants its prompt's scores
    proposals: list = field(default_factory=list)  # verify: each choosing row's proposed tokens
    draft_probs: Optional[torch.Tensor] = None  # verify: the draft model's probabilities of them (None: lookup)
    view: Optional[tuple] = None  # (batch, kv): the step runs on a view of the block pool whose row i is slots[i]

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"StepPlan kind {self.kind!r} is not one of {KINDS}.")

    @property
    def width(self) -> int:
        """Tokens each choosing row may emit: k+1 for a verify step, otherwise 1."""
        return self.tokens.shape[1] if self.kind == "verify" else 1


@dataclass
class StepResult:
    """What a step gave back, on the host except `logits`.

    `tokens[i]`: what choosing row i emits, in order (one token, or a verify step's accepted run). `choice`: their
    ids and log-probabilities, row i's token j at `i * width + j`. `logits`: the raw logits the tokens were chosen
    from, on the device, `[n, vocab]` or a verify step's `[n, width, vocab]` (`logits_of`; None when no row chose). `prompt_scores[i]`: row i's prompt
    log-probabilities, or None. `accepted[i]`: a verify step's accepted proposals."""

    tokens: list
    choice: Optional[Choice] = None
    width: int = 1
    logits: Any = None  # a tensor, or rows picked from one only when read (`runner.py`)
    prompt_scores: list = field(default_factory=list)
    accepted: list = field(default_factory=list)

    def logits_of(self, i: int, j: int = 0) -> torch.Tensor:
        """The `[vocab]` raw logits choosing row i's token j was chosen from, on the device."""
        return self.logits[i, j] if self.width > 1 else self.logits[i]


__all__ = ["KINDS", "StepPlan", "StepResult"]
