"""What goes into the generation loop and what comes out: a request, its token events, and the row it becomes.

Why a module of its own: the loop (`loop.py`), its scheduler (`scheduler.py`), speculation's proposers and the server
all read these, and none of them needs the loop to do so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .constraints import Grammar
from .sampling import SamplingParams


@dataclass
class GenerationRequest:
    """One sequence to continue: its prompt's token ids, how many new tokens at most, how to choose them,
    and which adapter of the model's adapter bank computes it (None: the model as it is, its active
    adapter if it has one; "__base__": no adapter)."""

    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: Any = None
    adapter: Optional[str] = None
    output_logits: bool = False  # each event carries the raw logits its token was chosen from (transformers' name)
    structured_outputs: Optional[Grammar] = None  # vLLM's name: the grammar the answer matches (`constraints.py`)


@dataclass
class TokenEvent:
    """What one step produced for one request: a token (or an error), and whether the request ended.

    `finish_reason`: "stop" (a stop id: EOS), "length" (`max_new_tokens` reached), "error" (`error`
    holds the exception; `token` is None), None while it runs."""

    request_id: Any
    token: Optional[int]
    index: int
    finish_reason: Optional[str] = None
    logprob: Optional[float] = None
    top_logprobs: Optional[list] = None  # [(token id, log-probability)] most likely first
    # the first event of a request that asked: one entry per prompt token, None for the first, else
    # (log-probability, [(token id, log-probability)] most likely first)
    prompt_logprobs: Optional[list] = None
    logits: Optional[torch.Tensor] = (
        None  # [vocab] on the device, unprocessed, when the request asked (`output_logits`)
    )
    error: Optional[BaseException] = None


@dataclass
class Row:
    """A request inside the loop: where its tokens are, what it generated, the KV blocks it holds."""

    request: GenerationRequest
    need: int  # cache positions it may use
    adapter: int = 0  # its slot in the model's adapter bank (0: none)
    length: int = 0  # positions written in its row
    generated: int = 0
    last: int = 0  # the last token, fed to the next decode step
    cancelled: bool = False
    tokens: list = field(default_factory=list)  # what it generated so far (speculative proposals read it)
    prompt: list = field(default_factory=list)  # what its prefill runs: the request's prompt, then what it generated
    blocks: list = field(default_factory=list)  # the pool blocks it holds (block caches), logical order
    window_blocks: list = field(default_factory=list)  # its window layers' blocks, when they are a group of their own
    order: int = 0  # when it took its slot (the newest is preempted first)
    resumed: bool = False  # preempted, then admitted again: its prompt holds its tokens (its prompt is not scored)
    generator: Any = None  # a preempted row's sampling generator, given back when it resumes
    grammar: Any = None  # a preempted row's grammar state (`constraints.RowConstraints.rows`), given back likewise

    def __post_init__(self):
        if not self.prompt:
            self.prompt = list(self.request.prompt)


__all__ = ["GenerationRequest", "Row", "TokenEvent"]
