"""Choosing the next token on the device: logits processors with transformers' semantics, then argmax
or a draw.

Why a module of its own: the engine's compiled graphs return the argmax *and* the last position's
logits; greedy decoding without processors uses the argmax (nothing else runs). Anything else
(repetition penalty, `min_new_tokens`, temperature, top-k, top-p, min-p, sampling) runs here, on the
device, on `[batch, vocab]` float32 logits, and only the chosen ids go back to the host.

Processors apply in transformers' order: repetition penalty, min-new-tokens (EOS forbidden), then for
sampling temperature, top-k, top-p, min-p. Each matches the transformers processor of the same name
(tests check them on random logits). The repetition penalty keeps a `[batch, vocab]` "seen" mask on
the device instead of the growing id history, so its cost does not grow with the sequence.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

NEG_INF = float("-inf")


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Seen tokens' logits divided by `penalty` when positive, multiplied when negative."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def forbid(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set the logits of `token_ids` (1-D) to -inf (min_new_tokens keeps EOS out)."""
    out = logits.clone()
    out[:, token_ids] = NEG_INF
    return out


def temperature(logits: torch.Tensor, value: float) -> torch.Tensor:
    return logits / value


def top_k(logits: torch.Tensor, k: int, min_tokens_to_keep: int = 1) -> torch.Tensor:
    k = min(max(int(k), min_tokens_to_keep), logits.shape[-1])
    threshold = torch.topk(logits, k)[0][..., -1, None]
    return logits.masked_fill(logits < threshold, NEG_INF)


def top_p(logits: torch.Tensor, p: float, min_tokens_to_keep: int = 1) -> torch.Tensor:
    sorted_logits, sorted_indices = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - p)
    remove[..., -min_tokens_to_keep:] = False
    remove = remove.scatter(1, sorted_indices, remove)
    return logits.masked_fill(remove, NEG_INF)


def min_p(logits: torch.Tensor, p: float, min_tokens_to_keep: int = 1) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    remove = probs < p * probs.amax(dim=-1, keepdim=True)
    keep = torch.topk(probs, min(min_tokens_to_keep, probs.shape[-1]), dim=-1).indices
    remove.scatter_(-1, keep, False)
    return logits.masked_fill(remove, NEG_INF)


def check_options(do_sample: bool, temperature_: Optional[float], top_k_: Optional[int], top_p_: Optional[float],
                  min_p_: Optional[float], repetition_penalty_: Optional[float]) -> None:
    """Refuse values that cannot mean anything, with one sentence each (a string, a bool or NaN first)."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample={do_sample!r} must be True or False.")
    for name, value in (("temperature", temperature_), ("top_p", top_p_), ("min_p", min_p_),
                        ("repetition_penalty", repetition_penalty_)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise ValueError(f"{name}={value!r} must be a finite number{' (not a string)' if isinstance(value, str) else ''}.")
    if do_sample and temperature_ is not None and not temperature_ > 0:
        raise ValueError(f"temperature={temperature_} must be greater than 0 when sampling (use do_sample=False for greedy).")
    if top_p_ is not None and not 0 < top_p_ <= 1:
        raise ValueError(f"top_p={top_p_} must be in (0, 1].")
    if min_p_ is not None and not 0 <= min_p_ <= 1:
        raise ValueError(f"min_p={min_p_} must be in [0, 1].")
    if top_k_ is not None and (not isinstance(top_k_, int) or isinstance(top_k_, bool) or top_k_ < 0):
        raise ValueError(f"top_k={top_k_!r} must be a non-negative integer.")
    if repetition_penalty_ is not None and not repetition_penalty_ > 0:
        raise ValueError(f"repetition_penalty={repetition_penalty_} must be greater than 0.")


class Sampler:
    """The per-call choice of the next token (see the module docstring)."""

    def __init__(self, do_sample: bool = False, temperature: Optional[float] = None, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, min_p: Optional[float] = None,
                 repetition_penalty: Optional[float] = None, min_new_tokens: Optional[int] = None,
                 eos_token_ids: Sequence[int] = (), generator: Optional[torch.Generator] = None):
        check_options(do_sample, temperature, top_k, top_p, min_p, repetition_penalty)
        self.do_sample = bool(do_sample)
        self.temperature = temperature if do_sample and temperature not in (None, 1.0) else None
        self.top_k = top_k if do_sample and top_k else None
        self.top_p = top_p if do_sample and top_p is not None and top_p < 1.0 else None
        self.min_p = min_p if do_sample and min_p is not None else None
        self.penalty = repetition_penalty if repetition_penalty not in (None, 1.0) else None
        self.min_new_tokens = int(min_new_tokens or 0) if eos_token_ids else 0
        self.eos = list(eos_token_ids)
        self.generator = generator
        self.seen: Optional[torch.Tensor] = None
        self._eos_tensor: Optional[torch.Tensor] = None

    @property
    def needs_logits(self) -> bool:
        """False when the graph's own argmax is the answer (plain greedy)."""
        return self.do_sample or self.penalty is not None or self.min_new_tokens > 0

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, vocab_size: int, device: torch.device) -> None:
        """Record the prompt's tokens (left padding excluded, as transformers does) for the penalty."""
        if self.penalty is None:
            return
        ids = prompt_ids.to(device)
        mask = prompt_mask.to(device).bool()
        first = mask.int().argmax(dim=1, keepdim=True)  # transformers ignores everything before it
        keep = torch.arange(ids.shape[1], device=device)[None, :] >= first
        self.seen = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=device)
        self.seen.scatter_(1, torch.where(keep, ids.clamp(max=vocab_size), vocab_size), True)
        self.seen = self.seen[:, :vocab_size].contiguous()

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """Next ids `[batch]` from `[batch, vocab]` logits at new-token index `step` (0 = first)."""
        logits = logits.float()
        if self.penalty is not None:
            logits = repetition_penalty(logits, self.seen, self.penalty)
        if step < self.min_new_tokens:
            if self._eos_tensor is None or self._eos_tensor.device != logits.device:
                self._eos_tensor = torch.tensor(self.eos, device=logits.device)
            logits = forbid(logits, self._eos_tensor)
        if self.do_sample:
            if self.temperature is not None:
                logits = temperature(logits, self.temperature)
            if self.top_k is not None:
                logits = top_k(logits, self.top_k)
            if self.top_p is not None:
                logits = top_p(logits, self.top_p)
            if self.min_p is not None:
                logits = min_p(logits, self.min_p)
            probs = torch.softmax(logits, dim=-1)
            ids = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
        else:
            ids = logits.argmax(dim=-1)
        return ids

    def observe(self, ids: torch.Tensor) -> None:
        """Mark the chosen ids as seen (repetition penalty)."""
        if self.seen is not None:
            self.seen.scatter_(1, ids.view(-1, 1).to(self.seen.device).clamp(max=self.seen.shape[1] - 1), True)
